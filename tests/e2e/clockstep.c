// LD_PRELOAD shim for the e2e tests: a process's wall clock (CLOCK_REALTIME, gettimeofday, time)
// shifted by the int64 milliseconds stored in the file SKEW_FILE names (8 bytes, little-endian),
// read through a shared mapping, so a test steps the clock of a running Envoy as an NTP
// correction would, without touching the machine's. The monotonic clock is left alone.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
static volatile int64_t *skew;
static int (*real_cg)(clockid_t, struct timespec *);
static void init(void) {
    if (!real_cg) real_cg = dlsym(RTLD_NEXT, "clock_gettime");
    if (!skew) {
        const char *f = getenv("SKEW_FILE");
        if (f) {
            int fd = open(f, O_RDONLY);
            if (fd >= 0) { void *m = mmap(0, 8, PROT_READ, MAP_SHARED, fd, 0); if (m != MAP_FAILED) skew = m; close(fd); }
        }
    }
}
static void shift(struct timespec *ts) {
    if (!skew) return;
    int64_t ns = (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec + *skew * 1000000LL;
    ts->tv_sec = ns / 1000000000LL; ts->tv_nsec = ns % 1000000000LL;
}
int clock_gettime(clockid_t c, struct timespec *ts) {
    init();
    int r = real_cg(c, ts);
    if (r == 0 && (c == CLOCK_REALTIME || c == CLOCK_REALTIME_COARSE)) shift(ts);
    return r;
}
int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts; init(); real_cg(CLOCK_REALTIME, &ts); shift(&ts);
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}
time_t time(time_t *t) { struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts); if (t) *t = ts.tv_sec; return ts.tv_sec; }
