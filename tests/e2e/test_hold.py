"""Holding requests at the gateway while every pod of their pool is saturated (`hold`), in a real
Envoy with the built filter: a held request waits at the gateway, not in a pod's queue, and goes
to the first pod with room; priority orders the held; a request held too long goes to a
saturated pod as it would have without holding; a client that leaves is forgotten. Both builds:
the proxy-wasm filter's workers each hold their own requests, the dynamic module holds every
worker's in one queue."""

import concurrent.futures
import re
import socket
import threading
import time
import urllib.request

import pytest

from harness import STAT_PREFIX, Envoy, LdsListener, documented_stats, settle, snapshot, wait_for
from stubpod import serving

POOLS = {"name": "llama", "models": ["llama-3-8b"]}
# Metrics that stay fresh for the whole test: the test pushes every change itself.
SCORING = {"stale_after_ms": 60_000}
SATURATED = {"waiting": 9}  # over the default queue threshold (5 waiting per unit of speed)
# What befalls a held request, each counted per pool: `gpuroute.hold.<pool>.<event>`.
HOLD_EVENTS = ("held", "affinity", "released", "expired", "answered", "cancelled", "full")

@pytest.fixture(scope="module")
def pods():
    with serving(["p0", "p1", "p2"]) as pods:
        yield pods


def endpoints(pods):
    return [{"name": "llama", "endpoints": [pods[f"p{i}"].address for i in range(3)]}]


def push(gw, pods, loads):
    """A snapshot with each pod's load (`loads[i]`: fields of pod p<i>)."""
    snap = snapshot({"llama": [dict({"address": pods[f"p{i}"].address}, **loads[i]) for i in range(3)]})
    assert gw.push(snap)[0] == 204


def stat(gw, name):
    return gw.stats().get(STAT_PREFIX + name, 0)


def ask(gw, text, priority=None, timeout=20):
    """(status, the pod that served it, the pod's answer, seconds taken)."""
    return ask_with_headers(gw, text, priority, timeout)[:4]


def ask_with_headers(gw, text, priority=None, timeout=20):
    """`ask`, and the response's headers."""
    headers = {"x-gateway-priority": str(priority)} if priority is not None else {}
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": text}]}
    t0 = time.time()
    s, h, reply, _ = gw.request("POST", "/v1/chat/completions", body, headers, timeout=timeout)
    return s, h.get("x-served-by"), reply, time.time() - t0, h


def prometheus_lines(gw, family):
    """The lines of a family on /stats/prometheus."""
    with urllib.request.urlopen(f"http://{gw.admin}/stats/prometheus", timeout=5) as r:
        return [ln for ln in r.read().decode().splitlines() if ln.startswith(family + "{")]


def by_pool(gw, family):
    """A family's values on /stats/prometheus, by their `gpuroute_pool` label (Envoy's tag
    extraction, envoy/render.py's STATS_TAGS)."""
    lines = prometheus_lines(gw, family)
    return {ln.split('gpuroute_pool="')[1].split('"')[0] if 'gpuroute_pool="' in ln else None:
            int(float(ln.rsplit(" ", 1)[1])) for ln in lines}


def served(pods):
    return sum(len(p.requests) for p in pods.values())


def hold_counts(gw, pool, want):
    """`pool`'s hold counters ({event: count}) once they read `want` (the module hands its counts
    to Envoy every tick_ms), or after 3 s."""
    def counts():
        shown = gw.stats()
        return {event: shown.get(f"{STAT_PREFIX}gpuroute.hold.{pool}.{event}", 0) for event in HOLD_EVENTS}
    settle(lambda: counts() == want)
    return counts()


@pytest.fixture(scope="module")
def gw(pods):
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING, "debug_header": True,
                                          "hold": {"max_wait_ms": 10_000, "max_held": 3}})
    yield e
    e.stop()


@pytest.fixture(autouse=True)
def room_after(gw, pods):
    """Every test leaves the pool with room and nothing held."""
    yield
    push(gw, pods, [{}, {}, {}])
    wait_for(lambda: stat(gw, "gpuroute.held.llama") == 0, what="the held requests to go")


def test_a_request_waits_at_the_gateway_until_a_pod_has_room(gw, pods):
    push(gw, pods, [SATURATED] * 3)
    before = (served(pods), gw.stat(STAT_PREFIX + "gpuroute.hold.llama.held"), gw.stat(STAT_PREFIX + "gpuroute.hold.llama.released"))
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        pending = ex.submit(ask_with_headers, gw, "wait for me")
        wait_for(lambda: stat(gw, "gpuroute.held.llama") == 1, what="the request to be held")
        time.sleep(0.3)  # a few ticks: still held, no pod has it
        assert not pending.done() and served(pods) == before[0]
        assert gw.stat(STAT_PREFIX + "gpuroute.hold.llama.held") == before[1] + 1
        # p2's queue empties: the request goes there, within a tick or two.
        pushed = time.time()
        push(gw, pods, [SATURATED, SATURATED, {"waiting": 0}])
        s, pod, reply, _, headers = pending.result(10)
        took = time.time() - pushed
    assert (s, pod) == (200, "p2"), reply
    # The debug header says how long it was held, before the decision's breakdown.
    held_ms = re.match(r"held=(\d+)ms; pool=llama; picked=", headers["x-gateway-debug"])
    assert held_ms and 300 <= int(held_ms.group(1)) < 10_000, headers["x-gateway-debug"]
    assert reply["headers"]["x-gateway-pool"] == "llama"
    assert took < 2, f"{took:.2f} s from room to the request's answer"
    assert gw.stat(STAT_PREFIX + "gpuroute.hold.llama.released") == before[2] + 1
    assert stat(gw, "gpuroute.held.llama") == 0
    assert gw.stat(STAT_PREFIX + "gpuroute.pool.llama.requests.picked") > 0  # batched to the tick


def test_the_held_go_by_priority_and_only_as_many_as_there_is_room_for(gw, pods):
    """Two held requests, the later with a higher priority; a pod with room for one more request
    (4 waiting, the threshold at 5): the later one goes, and the gateway, counting it as in flight
    while the pod works on it, holds the other (no herd onto the pod that looked free)."""
    push(gw, pods, [SATURATED] * 3)
    p0 = pods["p0"]
    start = {n: len(p.requests) for n, p in pods.items()}
    p0.hold = threading.Event()  # p0 keeps what it gets until the end of the test
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            first = ex.submit(ask, gw, "standard, first")
            wait_for(lambda: stat(gw, "gpuroute.held.llama") == 1, what="the first to be held")
            urgent = ex.submit(ask, gw, "urgent, second", priority=5)
            wait_for(lambda: stat(gw, "gpuroute.held.llama") == 2, what="the second to be held")
            push(gw, pods, [{"waiting": 4}, SATURATED, SATURATED])
            wait_for(lambda: len(p0.requests) > start["p0"], what="p0 to get a request")
            assert "urgent" in p0.requests[-1]["body"], p0.requests[-1]
            time.sleep(0.3)
            assert stat(gw, "gpuroute.held.llama") == 1 and not first.done(), \
                "the first went too, onto a pod that had room for one"
            push(gw, pods, [SATURATED, {"waiting": 0}, SATURATED])
            s, pod, reply, _ = first.result(10)
            assert (s, pod) == (200, "p1") and "standard" in reply["body"], reply
            p0.hold.set()
            assert urgent.result(10)[:2] == (200, "p0")
    finally:
        p0.hold.set()
        p0.hold = None
    got = {n: len(p.requests) - start[n] for n, p in pods.items()}
    assert got == {"p0": 1, "p1": 1, "p2": 0}, got


def test_a_request_that_comes_while_others_are_held_for_room_queues_behind_them(gw, pods):
    """A request held for room (priority 5); a snapshot gives one pod room for one more, and a
    request (priority 0) comes right after it: the held one takes the room, the newcomer is held
    behind it. Before, the newcomer decided at once on the new snapshot while the held one waited
    for the next tick (proxy-wasm) or its wake (the module): 9 of 10 and 8 of 10 newcomers took
    the room, the held one waiting on for the next (an audit)."""
    p0 = pods["p0"]
    keep = threading.Event()  # the pods keep what they get: room for one is room for one
    for p in pods.values():
        p.hold = keep
    try:
        for trial in range(4):
            push(gw, pods, [SATURATED] * 3)
            start = len(p0.requests)
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                urgent = ex.submit(ask, gw, f"urgent, held {trial}", priority=5)
                wait_for(lambda: stat(gw, "gpuroute.held.llama") == 1, what="the urgent one to be held")
                time.sleep(0.03 + 0.007 * trial)  # somewhere between two ticks
                push(gw, pods, [{"waiting": 4}, SATURATED, SATURATED])
                later = ex.submit(ask, gw, f"standard, later {trial}")
                wait_for(lambda: len(p0.requests) > start, what="p0 to get a request")
                time.sleep(0.3)
                got = [r["body"] for r in p0.requests[start:]]
                assert len(got) == 1 and "urgent" in got[0], (trial, got)
                assert stat(gw, "gpuroute.held.llama") == 1 and not later.done(), trial
                keep.set()
                push(gw, pods, [{}, {}, {}])
                assert urgent.result(10)[:2] == (200, "p0")
                assert later.result(10)[0] == 200
                keep.clear()
    finally:
        keep.set()
        for p in pods.values():
            p.hold = None


def test_a_client_that_leaves_while_held_is_forgotten(gw, pods):
    push(gw, pods, [SATURATED] * 3)
    cancelled = gw.stat(STAT_PREFIX + "gpuroute.hold.llama.cancelled")
    before = served(pods)
    host, port = gw.listen.rsplit(":", 1)
    body = b'{"model":"llama-3-8b","messages":[{"role":"user","content":"bye"}]}'
    c = socket.create_connection((host, int(port)), timeout=5)
    c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: stat(gw, "gpuroute.held.llama") == 1, what="the request to be held")
    c.close()
    wait_for(lambda: stat(gw, "gpuroute.held.llama") == 0, what="the request to be forgotten")
    assert gw.stat(STAT_PREFIX + "gpuroute.hold.llama.cancelled") == cancelled + 1
    # Nothing reached a pod, and the gateway serves on.
    push(gw, pods, [{}, {}, {}])
    time.sleep(0.1)
    assert served(pods) == before
    assert ask(gw, "still here")[0] == 200


def test_sheddable_requests_are_shed_and_a_full_worker_sends_at_once(gw, pods):
    push(gw, pods, [SATURATED] * 3)
    s, _, reply, took = ask(gw, "batch job", priority=-1)
    assert s == 429 and took < 2, reply
    full = gw.stat(STAT_PREFIX + "gpuroute.hold.llama.full")
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        held = [ex.submit(ask, gw, f"held {i}") for i in range(3)]
        wait_for(lambda: stat(gw, "gpuroute.held.llama") == 3, what="three to be held")
        # A sheddable request is shed, as it would be with room to hold: it was never to be
        # held, so it is not counted as turned away by a full queue.
        assert ask(gw, "batch job", priority=-1)[0] == 429
        time.sleep(0.3)  # past a flush of the module's counts (every tick_ms)
        assert gw.stat(STAT_PREFIX + "gpuroute.hold.llama.full") == full
        # max_held is 3: the fourth goes to a saturated pod at once.
        s, pod, _, took = ask(gw, "one too many")
        assert s == 200 and pod in ("p0", "p1", "p2") and took < 2
        wait_for(lambda: gw.stat(STAT_PREFIX + "gpuroute.hold.llama.full") == full + 1, what="hold.full")
        assert not any(f.done() for f in held)
        push(gw, pods, [{}, {}, {}])
        assert all(f.result(10)[0] == 200 for f in held)


def test_every_pools_hold_stats_are_there_at_zero_before_its_first_hold(pods):
    """With `hold` on, every pool's hold counters and held gauge are defined, at 0, when the
    configuration is read, in both builds: Prometheus sees each series before its first count.
    The proxy-wasm build defined a pool's at its first hold event, and a counter that first
    appears at 1 gives `increase()` no earlier sample (a pool's first `full` never alerted).
    Without `hold`, none (as the module always had it)."""
    with serving(["q0"]) as other:
        pools = endpoints(pods) + [{"name": "qwen", "endpoints": [other["q0"].address]}]
        config = {"pools": [POOLS, {"name": "qwen", "models": ["qwen"]}], "scoring": SCORING}
        want = {f"gpuroute.hold.{pool}.{event}" for pool in ("llama", "qwen") for event in HOLD_EVENTS} | \
            {"gpuroute.held.llama", "gpuroute.held.qwen"}
        e = Envoy("filter", pools, dict(config, hold={}))
        try:
            settle(lambda: want <= {n.removeprefix(STAT_PREFIX) for n in e.stats()})
            shown = e.stats()
            assert {n: shown.get(STAT_PREFIX + n) for n in sorted(want)} == {n: 0 for n in sorted(want)}
            for family in ("envoy_gpuroute_hold_full", "envoy_gpuroute_hold_held", "envoy_gpuroute_held"):
                assert by_pool(e, family) == {"llama": 0, "qwen": 0}, family
            # And each pool's wait histogram, no values yet.
            hists = {n.removeprefix(STAT_PREFIX) for n in e.stats("hold_ms")}
            assert hists == {"gpuroute.hold_ms.llama", "gpuroute.hold_ms.qwen"}, hists
        finally:
            e.stop()
        e = Envoy("filter", pools, config)
        try:
            assert e.chat("llama-3-8b")[0] == 200
            time.sleep(0.3)  # past a flush of the module's counts (every tick_ms)
            assert not [n for n in e.stats() if re.match(r"gpuroute\.(hold|held)", n.removeprefix(STAT_PREFIX))], e.stats()
        finally:
            e.stop()


def test_a_full_hold_queue_counts_only_the_requests_it_turns_away(pods):
    """`hold.full` counts the requests that would have been held had the queue room, not every
    request while it is full: requests to another pool with room go as always, uncounted
    (before, each was counted)."""
    with serving(["q0"]) as other:
        e = Envoy("filter", endpoints(pods) + [{"name": "qwen", "endpoints": [other["q0"].address]}],
                  {"pools": [POOLS, {"name": "qwen", "models": ["qwen"]}], "scoring": SCORING,
                   "hold": {"max_wait_ms": 10_000, "max_held": 1}})
        try:
            snap = snapshot({"llama": [dict({"address": pods[f"p{i}"].address}, **SATURATED) for i in range(3)],
                             "qwen": [{"address": other["q0"].address}]})
            assert e.push(snap)[0] == 204
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                held = ex.submit(ask, e, "held")
                wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="one held")
                body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(3):
                    s, h, _, _ = e.request("POST", "/v1/chat/completions", body)
                    assert (s, h.get("x-served-by")) == (200, "q0")
                time.sleep(0.3)  # past a flush of the module's counts (every tick_ms)
                assert stat(e, "gpuroute.hold.llama.full") == 0
                # One to the saturated pool: turned away by the full queue, counted in its pool.
                assert ask(e, "too many")[0] == 200
                wait_for(lambda: stat(e, "gpuroute.hold.llama.full") == 1, what="hold.full")
                assert (stat(e, "gpuroute.hold.qwen.full"), stat(e, "gpuroute.held.qwen")) == (0, 0)
                assert not held.done()
                push(e, pods, [{}, {}, {}])
                assert held.result(10)[0] == 200
        finally:
            e.stop()


def test_a_request_held_where_it_overflowed_goes_home_once_its_pool_has_room():
    """A request whose pool was saturated overflows to its failover pool; that one full too, it
    is held there. Once a snapshot shows its own pool with room it goes there, not after its
    whole wait to a saturated pod of the failover pool while later requests overtook it (an
    audit: both held went to the burst pod after 8 s). Its hold counts and the held gauge are
    the failover pool's, where it was held, though it went home (before, one count for every
    pool: no telling which was holding)."""
    scoring = {"stale_after_ms": 60_000, "queue_threshold": 2}
    with serving(["l0", "l1", "b0"]) as pods:
        e = Envoy("filter", [{"name": "llama", "endpoints": [pods["l0"].address, pods["l1"].address]},
                             {"name": "burst", "endpoints": [pods["b0"].address]}],
                  {"pools": [{"name": "llama", "models": ["llama-3-8b"], "failover": ["burst"], "overflow": True,
                              "scoring": scoring}, {"name": "burst", "models": [], "scoring": scoring}],
                   "hold": {"max_wait_ms": 8_000}, "debug_header": True})

        def push_loads(llama, burst):
            snap = snapshot({"llama": [dict({"address": pods[n].address}, **llama) for n in ("l0", "l1")],
                             "burst": [dict({"address": pods["b0"].address}, **burst)]})
            assert e.push(snap)[0] == 204

        gate = threading.Event()
        pods["b0"].hold = gate
        try:
            push_loads(SATURATED, {})
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                # Two fill the burst pod (kept in flight there), two are held.
                sent = []
                for i in range(4):
                    sent.append(ex.submit(ask_with_headers, e, f"request {i}"))
                    time.sleep(0.2)
                wait_for(lambda: stat(e, "gpuroute.held.burst") == 2, what="two held")
                assert len(pods["b0"].requests) == 2
                assert (stat(e, "gpuroute.held.llama"), e.stat(STAT_PREFIX + "gpuroute.hold.burst.held"),
                        stat(e, "gpuroute.hold.llama.held")) == (0, 2, 0)
                # In Prometheus, the names the process-wide stats had, the pool a label (llama's
                # series at 0: both builds define every pool's with the configuration).
                for family in ("envoy_gpuroute_held", "envoy_gpuroute_hold_held"):
                    assert by_pool(e, family) == {"burst": 2, "llama": 0}, family
                t0 = time.time()
                push_loads({}, {"waiting": 2})
                for f in sent[2:]:
                    s, pod, _, _, h = f.result(10)
                    assert s == 200 and pod in ("l0", "l1"), (s, pod, h.get("x-gateway-debug"))
                    assert "overflow" not in h.get("x-gateway-debug", ""), h.get("x-gateway-debug")
                assert time.time() - t0 < 3
                gate.set()
                assert [f.result(10)[:2] for f in sent[:2]] == [(200, "b0")] * 2
            wait_for(lambda: stat(e, "gpuroute.held.burst") == 0, what="none held")
            assert {n: e.stat(STAT_PREFIX + f"gpuroute.hold.{n}") for n in
                    ("burst.held", "burst.released", "burst.expired", "llama.held", "llama.released")} == \
                {"burst.held": 2, "burst.released": 2, "burst.expired": 0, "llama.held": 0, "llama.released": 0}
            # Their waits too (Envoy shows a histogram's new values after its stats flush, 5 s).
            waits = {"burst": 2, "llama": 0}
            settle(lambda: by_pool(e, "envoy_gpuroute_hold_ms_count") == waits, timeout=12)
            assert by_pool(e, "envoy_gpuroute_hold_ms_count") == waits
        finally:
            gate.set()
            e.stop()


def test_requests_held_under_a_replaced_configuration_stay_counted_and_go(pods, tmp_path):
    """An LDS change while requests are held: the held ones, under the old configuration (its
    filter chain draining), stay in the `gpuroute.held.<pool>` gauge and go once the pool has room. The
    module's gauge dropped to 0 while the new configuration, holding none, wrote it (an audit);
    every configuration now writes all of theirs."""
    lds = LdsListener(tmp_path / "lds")
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING, "hold": {"max_wait_ms": 20_000}},
              workdir=tmp_path / "envoy", patch=lds.patch,
              envoy_args=["--drain-time-s", "10", "--drain-strategy", "immediate"])
    try:
        push(e, pods, [SATURATED] * 3)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            held = [ex.submit(ask, e, f"held {i}") for i in range(3)]
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 3, what="three held")
            lds.change(e, timeout_s=10, tick_ms=21)
            seen = []
            for _ in range(25):
                time.sleep(0.1)
                seen.append(stat(e, "gpuroute.held.llama"))
            assert min(seen) == 3, seen
            push(e, pods, [{}, {}, {}])
            assert [f.result(10)[0] for f in held] == [200] * 3
        wait_for(lambda: stat(e, "gpuroute.held.llama") == 0, what="none held")
    finally:
        e.stop()


def test_each_worker_holds_and_sends_its_own(pods):
    """Two Envoy workers, each holding requests that reached it (the kernel spreads the
    connections): when the pool has room, both send theirs, each from its own tick."""
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING, "hold": {}}, concurrency=2)
    try:
        push(e, pods, [SATURATED] * 3)
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            held = []
            # Until both workers hold some (each request on a connection of its own).
            while len(held) < 16 and (len(held) < 4 or len(e.worker_connections()) < 2):
                held.append(ex.submit(ask, e, f"worker test {len(held)}"))
                wait_for(lambda: stat(e, "gpuroute.held.llama") == len(held), what=f"{len(held)} held")
            assert len(e.worker_connections()) == 2, e.worker_connections()
            time.sleep(0.2)
            assert not any(f.done() for f in held)
            push(e, pods, [{}, {}, {}])
            answers = [f.result(10) for f in held]
        assert all(a[0] == 200 for a in answers), answers
        wait_for(lambda: stat(e, "gpuroute.held.llama") == 0, what="none held")
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.released") == len(held)
    finally:
        e.stop()


DOCUMENT = "Summarise the attached contract. " + "Clause %d: the parties agree to the terms. " * 300


def prefix_gateway(pods, affinity_wait_ms):
    return Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING, "debug_header": True,
                                             "hold": {"max_wait_ms": 10_000, "affinity_wait_ms": affinity_wait_ms}})


def cache_on_one_pod(e, pods):
    """Sends the long prompt once with every pod free: (the pod that now caches it, the index of
    that pod, the loads that saturate it alone)."""
    push(e, pods, [{}, {}, {}])
    s, home, reply, _ = ask(e, DOCUMENT % tuple(range(300)) + " First question?")
    assert s == 200, reply
    i = int(home[1:])
    return home, i, [SATURATED if j == i else {} for j in range(3)]


def test_a_request_waits_for_the_saturated_pod_that_caches_its_prompt(pods):
    """`hold.affinity_wait_ms`: the pod that caches a request's prompt is saturated and others are
    not; the request waits at the gateway for that pod instead of being prefilled anew elsewhere,
    while requests that have no such pod go at once; when the pod has room, it goes there."""
    e = prefix_gateway(pods, 5_000)
    try:
        home, i, loads = cache_on_one_pod(e, pods)
        push(e, pods, loads)
        waited = e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity")
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            follow_up = ex.submit(ask_with_headers, e, DOCUMENT % tuple(range(300)) + " Second question?")
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="the follow-up to be held")
            assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity") == waited + 1
            # Another request of the pool is not held behind it: it goes to a pod with room.
            s, pod, reply, took = ask(e, "an unrelated short question")
            assert s == 200 and pod != home and took < 2, (pod, reply)
            time.sleep(0.3)
            assert not follow_up.done() and stat(e, "gpuroute.held.llama") == 1
            push(e, pods, [{}, {}, {}])
            s, pod, reply, _, headers = follow_up.result(10)
        assert (s, pod) == (200, home), reply
        assert re.match(r"held=\d+ms; pool=llama; picked=", headers["x-gateway-debug"]), headers
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.released") == 1
    finally:
        e.stop()


def test_a_pod_that_gets_room_takes_the_held_request_it_suits(pods):
    """Two requests held while every pod is saturated, the first a follow-up whose prompt one pod
    caches. Another pod gets room: the second request takes it, and the first waits on for its
    prompt's pod, then goes there."""
    e = prefix_gateway(pods, 5_000)
    try:
        home, i, _ = cache_on_one_pod(e, pods)
        other = (i + 1) % 3
        push(e, pods, [SATURATED] * 3)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            follow_up = ex.submit(ask, e, DOCUMENT % tuple(range(300)) + " Second question?")
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="the follow-up to be held")
            unrelated = ex.submit(ask, e, "an unrelated short question")
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 2, what="both to be held")
            push(e, pods, [{} if j == other else SATURATED for j in range(3)])
            s, pod, reply, _ = unrelated.result(10)
            assert (s, pod) == (200, f"p{other}"), reply
            time.sleep(0.3)
            assert not follow_up.done() and stat(e, "gpuroute.held.llama") == 1
            assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity") == 1
            push(e, pods, [{}, {}, {}])
            s, pod, reply, _ = follow_up.result(10)
        assert (s, pod) == (200, home), reply
    finally:
        e.stop()


def test_an_adapter_request_waits_for_its_adapters_saturated_pod(pods):
    """An adapter request whose adapter runs only on a saturated pod waits for that pod (any
    other would load the adapter), while a request for the base model goes at once; when the
    pod has room, the adapter request goes there."""
    lora = {"max_loras": 4, "running": ["sql-lora"], "waiting": []}
    e = Envoy("filter", endpoints(pods), {"pools": [dict(POOLS, adapters=["sql-lora"])], "scoring": SCORING,
                                          "hold": {"max_wait_ms": 10_000}})
    try:
        push(e, pods, [dict(SATURATED, lora=lora), {}, {}])
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            body = {"model": "sql-lora", "messages": [{"role": "user", "content": "count the rows"}]}
            adapter = ex.submit(e.request, "POST", "/v1/chat/completions", body, {}, timeout=20)
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="the adapter request to be held")
            assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity") == 1
            s, pod, reply, took = ask(e, "a base-model question")
            assert s == 200 and pod in ("p1", "p2") and took < 2, (pod, reply)
            time.sleep(0.3)
            assert not adapter.done()
            push(e, pods, [{"lora": lora}, {}, {}])
            s, h, reply, _ = adapter.result(10)
        assert (s, h.get("x-served-by")) == (200, "p0"), reply
    finally:
        e.stop()


def test_past_its_wait_an_adapter_request_goes_to_its_pod_under_lora_queue_threshold(pods):
    """With a low `queue_threshold` (1), an adapter request whose adapter's pod has 3 waiting
    waits for it up to `affinity_wait_ms`, then goes there all the same (under
    `lora_queue_threshold`, 5), not to a pod with room that would load the adapter; at 9 waiting
    it goes to a pod with room."""
    lora = {"max_loras": 4, "running": ["sql-lora"], "waiting": []}
    full = {"max_loras": 4, "running": ["a", "b", "c", "d"], "waiting": []}
    e = Envoy("filter", endpoints(pods), {"pools": [dict(POOLS, adapters=["sql-lora"])],
                                          "scoring": dict(SCORING, queue_threshold=1),
                                          "hold": {"max_wait_ms": 10_000, "affinity_wait_ms": 400}})
    body = {"model": "sql-lora", "messages": [{"role": "user", "content": "count the rows"}]}
    try:
        for waiting, want in [(3, {"p0"}), (9, {"p1", "p2"})]:
            push(e, pods, [{"waiting": waiting, "lora": lora}, {"lora": full}, {"lora": full}])
            t0 = time.time()
            s, h, reply, _ = e.request("POST", "/v1/chat/completions", body, {}, timeout=20)
            took = time.time() - t0
            assert s == 200 and h.get("x-served-by") in want, (waiting, h.get("x-served-by"), reply)
            assert 0.4 <= took < 2.5, (waiting, took)
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity") == 2
    finally:
        e.stop()


def test_a_request_waits_for_its_prompts_pod_at_most_affinity_wait_ms(pods):
    """Past `hold.affinity_wait_ms` it goes to a pod with room; with the option at 0 it goes there
    at once."""
    e = prefix_gateway(pods, 400)
    try:
        home, _, loads = cache_on_one_pod(e, pods)
        push(e, pods, loads)
        s, pod, reply, took = ask(e, DOCUMENT % tuple(range(300)) + " Second question?")
        assert s == 200 and pod != home, (pod, reply)
        assert 0.4 <= took < 2.5, took
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.affinity") == 1
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.released") == 1
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.expired") == 0
    finally:
        e.stop()
    e = prefix_gateway(pods, 0)
    try:
        home, _, loads = cache_on_one_pod(e, pods)
        push(e, pods, loads)
        s, pod, reply, took = ask(e, DOCUMENT % tuple(range(300)) + " Second question?")
        assert s == 200 and pod != home and took < 2, (pod, reply)
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.held") == 0
    finally:
        e.stop()


def test_with_order_shortest_the_shortest_prefill_goes_first(pods):
    """`hold.order: shortest` orders the held by what a pod must still prefill: of three held
    requests, a long prompt that one pod caches goes first, then a short uncached one, then a
    long uncached one, each as a pod gets room for one."""
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING,
                                          "hold": {"max_wait_ms": 10_000, "order": "shortest"}})
    keep = threading.Event()  # the pods keep what they get, so a pod with room for one takes one
    try:
        home, i, _ = cache_on_one_pod(e, pods)
        other = (i + 1) % 3
        start = {n: len(p.requests) for n, p in pods.items()}
        for p in pods.values():
            p.hold = keep
        push(e, pods, [SATURATED] * 3)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            asked = {}
            for name, text in [("long", "long " + "context " * 2000),
                               ("cached", DOCUMENT % tuple(range(300)) + " Second question?"),
                               ("short", "short " + "words " * 200)]:
                asked[name] = ex.submit(ask, e, text)
                wait_for(lambda: stat(e, "gpuroute.held.llama") == len(asked), what=f"{name} to be held")

            def got(pod):
                return [r["body"] for r in pods[pod].requests[start[pod]:]]

            for left, (name, j, marker) in enumerate([("cached", i, "Second question"),
                                                      ("short", other, "short words")], 1):
                # Room for one on one pod; the one that went before stays on its pod.
                push(e, pods, [{"waiting": 4} if k == j else SATURATED for k in range(3)])
                wait_for(lambda: got(f"p{j}"), what=f"p{j} to get a request")
                assert len(got(f"p{j}")) == 1 and marker in got(f"p{j}")[0], (name, got(f"p{j}")[0][:60])
                time.sleep(0.2)
                assert stat(e, "gpuroute.held.llama") == 3 - left
            keep.set()
            push(e, pods, [{}, {}, {}])
            assert all(f.result(10)[0] == 200 for f in asked.values())
    finally:
        keep.set()
        for p in pods.values():
            p.hold = None
        e.stop()


def test_every_hold_stat_is_documented(gw):
    """After the tests above (held, released, cancelled, full), every `gpuroute` stat Envoy
    shows is one the README names."""
    patterns = documented_stats()
    shown = sorted({n.removeprefix(STAT_PREFIX) for n in gw.stats() if n.startswith(STAT_PREFIX)})
    assert {"gpuroute.hold.llama.held", "gpuroute.hold.llama.released", "gpuroute.hold.llama.cancelled", "gpuroute.held.llama"} <= set(shown)
    # No process-wide hold stat beside the pool's (a sum in Prometheus would count twice).
    assert not {"gpuroute.hold.held", "gpuroute.held", "gpuroute.hold_ms"} & set(shown), shown
    undocumented = [n for n in shown if not any(p.fullmatch(n) for p in patterns)]
    assert not undocumented, f"stats the README does not name: {undocumented}"


def test_a_held_request_goes_to_a_saturated_pod_after_max_wait(pods):
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING,
                                          "hold": {"max_wait_ms": 400}})
    try:
        push(e, pods, [SATURATED] * 3)
        expired = e.stat(STAT_PREFIX + "gpuroute.hold.llama.expired")
        s, pod, reply, took = ask(e, "patience")
        assert s == 200 and pod in ("p0", "p1", "p2"), reply
        assert 0.4 <= took < 2.5, took
        assert e.stat(STAT_PREFIX + "gpuroute.hold.llama.expired") == expired + 1
        assert stat(e, "gpuroute.held.llama") == 0
        # Its wait, in its pool's histogram (one for all pools before): in Prometheus the name
        # the one histogram had, the pool a label, with the shipped buckets (13 ms is one of
        # envoy/render.py's HISTOGRAM_BUCKETS, not one of Envoy's defaults). Envoy merges the
        # workers' histograms into what it shows on its stats flush, every 5 s.
        assert STAT_PREFIX + "gpuroute.hold_ms.llama" in e.stats("hold_ms")
        settle(lambda: by_pool(e, "envoy_gpuroute_hold_ms_count") == {"llama": 1}, timeout=12)
        assert by_pool(e, "envoy_gpuroute_hold_ms_count") == {"llama": 1}
        buckets = {ln.split('le="')[1].split('"')[0]: int(float(ln.rsplit(" ", 1)[1]))
                   for ln in prometheus_lines(e, "envoy_gpuroute_hold_ms_bucket") if 'gpuroute_pool="llama"' in ln}
        assert (buckets.get("13"), buckets.get("320"), buckets.get("+Inf")) == (0, 0, 1), buckets
    finally:
        e.stop()


def test_a_held_request_whose_pool_left_the_snapshot_is_answered_and_counted_so(pods):
    """ORIGINAL_DST: a held request whose pool is gone from the snapshot when it is decided again
    has no pod to be sent to, and the gateway answers it 503 itself. It is counted
    `hold.<pool>.answered`, not `released` (both builds counted it so before), which says a
    request went to a pod; `held` stays the sum of how they left."""
    e = Envoy("filter_original_dst", endpoints(pods), {"pools": [POOLS], "scoring": SCORING,
                                                       "hold": {"max_wait_ms": 10_000}})
    try:
        push(e, pods, [SATURATED] * 3)
        before = served(pods)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            pending = ex.submit(ask, e, "nowhere to go")
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="the request to be held")
            assert e.push(snapshot({"other": [{"address": pods["p0"].address}]}))[0] == 204
            s, pod, reply, _ = pending.result(10)
        assert (s, pod, reply["error"]["code"]) == (503, None, "no_healthy_endpoints"), reply
        assert served(pods) == before
        counts = hold_counts(e, "llama", dict.fromkeys(HOLD_EVENTS, 0) | {"held": 1, "answered": 1})
        assert counts == dict.fromkeys(HOLD_EVENTS, 0) | {"held": 1, "answered": 1}, counts
        assert stat(e, "gpuroute.held.llama") == 0
        assert counts["held"] == sum(counts[k] for k in ("released", "expired", "answered", "cancelled"))
        assert by_pool(e, "envoy_gpuroute_hold_answered") == {"llama": 1}  # the pool a label, as the others'
    finally:
        e.stop()


def test_a_sheddable_request_held_for_its_prompts_pod_is_shed_once_its_pool_fills_up(pods):
    """A sheddable request (priority -1) waits for the saturated pod caching its prompt while
    other pods have room (`affinity_wait_ms`); decided again once every pod is saturated, it is
    shed (429), as it would have been had it come then: answered by the gateway, counted
    `answered`, not `released` (before, in both builds)."""
    e = prefix_gateway(pods, 5_000)
    try:
        _, _, loads = cache_on_one_pod(e, pods)
        push(e, pods, loads)
        before = served(pods)
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            pending = ex.submit(ask, e, DOCUMENT % tuple(range(300)) + " Second question?", -1)
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 1, what="the request to be held for its pod")
            push(e, pods, [SATURATED] * 3)
            s, _, reply, _ = pending.result(10)
        assert s == 429, reply
        assert served(pods) == before
        want = dict.fromkeys(HOLD_EVENTS, 0) | {"held": 1, "affinity": 1, "answered": 1}
        assert hold_counts(e, "llama", want) == want
        assert stat(e, "gpuroute.held.llama") == 0
        assert e.stat(STAT_PREFIX + "gpuroute.pool.llama.requests.shed") == 1
    finally:
        e.stop()


def test_requests_held_when_a_replaced_configurations_drain_ends_count_as_cancelled(pods, tmp_path):
    """An LDS change while requests are held, the pool saturated past the old filter chain's
    drain: Envoy resets the held requests when the drain ends, and each is counted in
    `hold.<pool>.cancelled` and leaves the `gpuroute.held.<pool>` gauge, as a client that leaves is. The module
    lost them: the old configuration's counts waited for a flush that never came once Envoy
    destroyed it."""
    lds = LdsListener(tmp_path / "lds")
    e = Envoy("filter", endpoints(pods), {"pools": [POOLS], "scoring": SCORING, "hold": {"max_wait_ms": 30_000}},
              workdir=tmp_path / "envoy", patch=lds.patch, envoy_args=lds.envoy_args)
    try:
        push(e, pods, [SATURATED] * 3)
        before = served(pods)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            held = [ex.submit(ask, e, f"held {i}", timeout=30) for i in range(3)]
            wait_for(lambda: stat(e, "gpuroute.held.llama") == 3, what="three held")
            lds.change(e, timeout_s=10, tick_ms=21)
            # The old chain drains for a second, then its connections close: the held are reset.
            for f in held:
                with pytest.raises(Exception):
                    f.result(15)
        wait_for(lambda: stat(e, "gpuroute.hold.llama.cancelled") == 3, what="three cancelled", timeout=5)
        wait_for(lambda: stat(e, "gpuroute.held.llama") == 0, what="none held", timeout=5)
        assert served(pods) == before
        time.sleep(0.5)  # a few of the new configuration's flushes: nothing counted twice
        assert (stat(e, "gpuroute.hold.llama.cancelled"), stat(e, "gpuroute.held.llama")) == (3, 0)
    finally:
        e.stop()
