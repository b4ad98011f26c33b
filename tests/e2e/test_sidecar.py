"""sidecar-metrics + a real Envoy with the filter, end to end: pods export vLLM metrics, the
aggregator scrapes and pushes, the filter routes by what it pushed.

Measured here (printed with -s): how long from a pod's metrics changing until the filter routes
by the change, and how long until a dead pod stops being picked.
"""

import statistics
import time
import urllib.request

import pytest

from harness import ROOT, STAT_PREFIX, ClockStep, Envoy, Pusher, Sidecar, free_port
from stubpod import StubPod, tls_context

CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True}
INTERVAL_MS = 100
BUSY = dict(waiting=3, running=40, kv=0.6)
IDLE = dict(waiting=0, running=1, kv=0.05)


def picked(resp):
    """The pod the filter chose (from the debug header), or None when it failed open."""
    dbg = resp[1].get("x-gateway-debug", "")
    for part in dbg.split("; "):
        if part.startswith("picked="):
            return part[len("picked="):]
    return None


def chat(gw):
    return gw.chat("llama-3-8b", "hi")


@pytest.fixture()
def stack():
    pods = [StubPod(f"pod-{i}") for i in range(3)]
    for p in pods:
        p.set_load(**BUSY)
    gw = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG)
    sc = Sidecar({"llama": [p.address for p in pods]}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"],
                 interval_ms=INTERVAL_MS, extra={"ramp": {"window_ms": 6000, "start_weight": 0.1, "startup_grace_ms": 1000}})
    deadline = time.time() + 10
    while not sc.ready() and time.time() < deadline:
        time.sleep(0.05)
    assert sc.ready()
    time.sleep(1.0)  # past the aggregator's start-up grace: from here on a returning pod ramps
    yield pods, gw, sc
    sc.stop()
    gw.stop()
    for p in pods:
        try:
            p.close()
        except Exception:
            pass


def wait_until_picked(gw, address, timeout=5.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if picked(chat(gw)) == address:
            return time.time() - t0
        time.sleep(0.01)
    raise AssertionError(f"{address} never picked")


def test_routing_follows_a_load_change_within_two_intervals(stack):
    pods, gw, sc = stack
    pods[0].set_load(**IDLE)
    wait_until_picked(gw, pods[0].address)
    delays = []
    for i in range(10):
        now, nxt = pods[i % 3], pods[(i + 1) % 3]
        time.sleep(0.03 * (i % 4))  # land at different phases of the scrape interval
        now.set_load(**BUSY)
        nxt.set_load(**IDLE)
        delays.append(wait_until_picked(gw, nxt.address) * 1000)
    delays.sort()
    print(f"\nmetrics change -> filter routes by it (interval {INTERVAL_MS} ms): "
          f"median {statistics.median(delays):.0f} ms, max {delays[-1]:.0f} ms, all {[round(d) for d in delays]}")
    assert statistics.median(delays) <= INTERVAL_MS * 1.5
    assert delays[-2] <= INTERVAL_MS * 2, delays  # 9 of 10 within two intervals


def test_a_dead_pod_stops_being_picked_within_a_second_and_ramps_up_when_back(stack):
    pods, gw, sc = stack
    pods[0].set_load(**IDLE)
    wait_until_picked(gw, pods[0].address)
    # How fast the aggregator's rounds actually run here (each publishes a snapshot): on a
    # machine too loaded to keep the interval, the time allowed below scales with it.
    nominal = 1000 / INTERVAL_MS
    t0, before = time.time(), gw.stat(STAT_PREFIX + "gpuroute.snapshot.accepted")
    time.sleep(1.0)
    rounds_per_s = (gw.stat(STAT_PREFIX + "gpuroute.snapshot.accepted") - before) / (time.time() - t0)
    slowness = 1.0 if rounds_per_s >= 0.8 * nominal else nominal / max(rounds_per_s, 0.5)
    pods[0].close()
    t0 = time.time()
    # Each request's time since the close, status and debug header: what a failure shows.
    seen = []

    def observe():
        s, h, _, _ = chat(gw)
        seen.append((round((time.time() - t0) * 1000), s, h.get("x-gateway-debug", "")))
        return s, h

    while picked(observe()) == pods[0].address:
        assert time.time() - t0 < 3 * slowness, f"dead pod still picked after {3 * slowness:.1f} s"
        time.sleep(0.005)
    gone = time.time() - t0
    # Requests kept succeeding meanwhile: Envoy retried on the next endpoint of the header.
    for _ in range(20):
        s, h = observe()
        assert s == 200 and h["x-served-by"] != "pod-0", seen[-3:]
        assert picked((s, h)) != pods[0].address, f"picked again after it was out: {seen[-23:]}"
    print(f"\ndead pod out of the candidates after {gone * 1000:.0f} ms "
          f"(aggregator rounds {rounds_per_s:.1f}/s, {nominal:.0f}/s configured)")
    # The figure: out within a second at the configured interval. On a machine so loaded that
    # the aggregator's rounds ran slower than that (seen in a CI run 7x slower than usual), the
    # time allowed scales by the same factor.
    assert gone <= 1.2 * slowness, (gone, rounds_per_s)

    # It comes back idle while the others are busy: ramp-up keeps it from taking everything.
    for p in pods[1:]:
        p.set_load(**IDLE)
    pods[0].restart()
    pods[0].set_load(**IDLE)
    t0 = time.time()
    early = []
    while time.time() - t0 < 2.0:
        early.append(picked(chat(gw)))
        time.sleep(0.005)
    share_early = early.count(pods[0].address) / len(early)
    time.sleep(5.0)
    late = [picked(chat(gw)) for _ in range(150)]
    share_late = late.count(pods[0].address) / len(late)
    print(f"returning pod's share of picks: first 2 s {share_early:.2f}, after 7 s {share_late:.2f}")
    assert share_early < 0.2
    assert share_late > share_early


def test_a_pool_whose_only_pod_came_back_routes_to_it_while_it_ramps():
    """Ramp-up sets a returning pod's share beside the others; with no other pod (a one-pod
    pool whose pod restarted, or every pod back at once) the filter still picks it rather than
    failing open to Envoy's balancer: before, 9 requests in 10 at a weight of 0.1 failed open
    (counted in fail_open.no_fresh_pod) and went where Envoy's balancer sent them, blind to
    load."""
    pod = StubPod("solo")
    gw = Envoy("filter", [{"name": "llama", "endpoints": [pod.address]}], CONFIG)
    sc = Sidecar({"llama": [pod.address]}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"], interval_ms=INTERVAL_MS,
                 extra={"ramp": {"window_ms": 20000, "start_weight": 0.1, "startup_grace_ms": 500}})
    try:
        wait_until_picked(gw, pod.address, timeout=10)
        time.sleep(0.6)  # past the aggregator's start-up grace: from here on a returning pod ramps

        def published():
            return sc.snapshot()["pools"][0]["pods"][0]

        pod.close()
        deadline = time.time() + 5
        while published()["healthy"]:
            assert time.time() < deadline, "the dead pod never turned unhealthy"
            time.sleep(0.02)
        pod.restart()
        deadline = time.time() + 5
        while not published()["healthy"]:
            assert time.time() < deadline, "the pod never came back"
            time.sleep(0.02)
        assert published()["ramp_weight"] < 0.5, published()
        failed_open = gw.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod")
        picks = [picked(chat(gw)) for _ in range(40)]
        assert published()["ramp_weight"] < 0.5, "still ramping throughout"
        assert picks.count(pod.address) == 40, picks
        assert gw.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod") == failed_open
    finally:
        sc.stop()
        gw.stop()
        pod.close()


@pytest.mark.parametrize("step_ms", [-3_600_000, 3_600_000])
def test_a_dead_aggregators_snapshot_goes_stale_when_envoys_wall_clock_steps(step_ms):
    """Ages are counted on Envoy's monotonic clock: its wall clock stepped back an hour (an NTP
    correction, a VM resumed) after the last snapshot came in, a dead aggregator's snapshot
    still goes stale after stale_after_ms and the pool fails open. On the wall clock the
    snapshot read 0 ms old for the whole hour (snapshot.age_ms 0), routed on as it was."""
    clock = ClockStep()
    if not clock.available:
        pytest.skip("no C compiler for the clock shim")
    pods = [StubPod(f"pod-{i}") for i in range(2)]
    gw = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG, env=clock.env)
    try:
        pusher = Pusher([gw], {"llama": [{"address": p.address} for p in pods]})
        wait_until_picked(gw, pods[0].address)
        pusher.stop()  # the aggregator dies
        clock.set(step_ms)
        t0 = time.time()
        while picked(chat(gw)) is not None:
            assert time.time() - t0 < 5, f"still routing on a dead aggregator's snapshot after 5 s: {gw.stats('snapshot.age')}"
            time.sleep(0.01)
        gone = time.time() - t0
        age = gw.stat(STAT_PREFIX + "gpuroute.snapshot.age_ms")
        print(f"\nEnvoy's clock stepped {step_ms} ms: failing open after {gone * 1000:.0f} ms, snapshot.age_ms {age}")
        assert 1000 <= age < 60_000, age
        # A new snapshot is taken and routed on, and ages from its own arrival.
        pusher = Pusher([gw], {"llama": [{"address": p.address} for p in pods]})
        wait_until_picked(gw, pods[0].address)
        pusher.stop()
    finally:
        clock.set(0)
        gw.stop()
        for p in pods:
            p.close()


def test_push_keeps_trying_while_envoy_is_down_and_resumes_when_it_is_back():
    pods = [StubPod(f"pod-{i}") for i in range(2)]
    pods[1].set_load(**BUSY)
    ports = {k: f"127.0.0.1:{free_port()}" for k in ("listen", "admin", "ingest")}
    sc = Sidecar({"llama": [p.address for p in pods]}, [f"http://{ports['ingest']}/gpuroute/v1/snapshot"],
                 interval_ms=INTERVAL_MS)
    gw = None
    try:
        time.sleep(0.5)
        assert not sc.ready()  # nobody accepted a push yet, but it keeps scraping
        pools = [{"name": "llama", "endpoints": [p.address for p in pods]}]
        gw = Envoy("filter", pools, CONFIG, **ports)
        t0 = time.time()
        while picked(chat(gw)) != pods[0].address:
            assert time.time() - t0 < 3
            time.sleep(0.01)
        print(f"\nEnvoy up -> routing by fresh metrics after {(time.time() - t0) * 1000:.0f} ms")
        assert sc.ready()
        # Envoy restarts: its shared data is gone; the next push restores routing.
        gw.stop()
        gw = Envoy("filter", pools, CONFIG, **ports)
        t0 = time.time()
        while picked(chat(gw)) != pods[0].address:
            assert time.time() - t0 < 3
            time.sleep(0.01)
        # The aggregator restarts: its versions continue upwards, Envoy accepts them.
        sc.stop()
        sc.start()
        pods[0].set_load(**BUSY)
        pods[1].set_load(**IDLE)
        t0 = time.time()
        while picked(chat(gw)) != pods[1].address:
            assert time.time() - t0 < 3, gw.stats()
            time.sleep(0.01)
        assert gw.stat(STAT_PREFIX + "gpuroute.snapshot.rejected.invalid") == 0
    finally:
        sc.stop()
        if gw:
            gw.stop()
        for p in pods:
            p.close()


def test_pods_serving_https_with_mutual_tls_are_scraped_and_routed_to():
    """Pods that serve HTTPS only and want a client certificate (vLLM with `--ssl-certfile` and
    `--ssl-ca-certs`, or what a mesh with strict mutual TLS asks): sidecar-metrics scrapes them
    with `scrape_tls`, Envoy connects with the pool's upstream TLS (envoy/render.py), and the
    filter routes by what was scraped. The test certificates are testdata/tls/'s."""
    tls = ROOT / "testdata" / "tls"
    pods = [StubPod(f"pod-{i}", tls=tls_context(tls / "pod.pem", tls / "pod.key", client_ca=tls / "ca.pem"))
            for i in range(3)]
    for p in pods:
        p.set_load(**BUSY)
    pods[1].set_load(**IDLE)
    client = {"cert_file": str(tls / "client.pem"), "key_file": str(tls / "client.key")}
    pools = [{"name": "llama", "endpoints": [p.address for p in pods],
              "tls": {"ca_file": str(tls / "ca.pem"), "san": ["pod.test"], **client}}]
    gw = Envoy("filter", pools, CONFIG)
    sc = Sidecar({}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"], interval_ms=INTERVAL_MS, extra={
        "pools": [{"name": "llama", "metrics_scheme": "https", "pods": [{"address": p.address} for p in pods]}],
        "scrape_tls": {"ca_file": str(tls / "ca.pem"), **client},
    })
    try:
        # Plain HTTP gets nowhere: the pods speak TLS only.
        with pytest.raises(Exception):
            urllib.request.urlopen(f"http://{pods[0].address}/metrics", timeout=2).read()
        deadline = time.time() + 10
        while not sc.ready() and time.time() < deadline:
            time.sleep(0.05)
        assert sc.ready(), sc.log_path.read_text()[-2000:]
        # The first snapshots may come before the first scrapes have answered (pods unhealthy).
        wait_until_picked(gw, pods[1].address)
        r = chat(gw)
        assert r[0] == 200 and r[1]["x-served-by"] == "pod-1", r[1].get("x-gateway-debug")
        # Scraped on, over TLS: the routing follows the next load change.
        pods[1].set_load(**BUSY)
        pods[2].set_load(**IDLE)
        wait_until_picked(gw, pods[2].address)
        assert chat(gw)[1]["x-served-by"] == "pod-2"
    finally:
        sc.stop()
        gw.stop()
        for p in pods:
            p.close()
