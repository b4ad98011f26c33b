"""Passive health (`outlier_detection`), end to end in a real Envoy with the built filter (or the
dynamic module, GPUROUTE_RUNTIME=dynamic): a pod whose engine fails every request while its
metrics still read idle leaves the picks after `consecutive_5xx` server errors in a row, comes
back after its ejection, and at most half a pool is ever out.

Envoy's own outlier detection cannot do this for the filter: its override_host load balancer
sends a request to the host the filter names even when Envoy ejected that host (measured on
Envoy 1.40 while writing this: the host flagged failed_outlier_check still answered 54 of 160
requests). Before the filter's own, the failing pod took a third of these requests for as long
as it failed.
"""

import collections
import concurrent.futures
import contextlib
import json
import time

import pytest

from harness import RUNTIME, STAT_PREFIX, Envoy, Pusher, wait_for
from stubpod import pools_by, serving
from test_filter import connection_per_worker

BASE_EJECTION_MS = 3000
CONFIG = {
    "pools": [{"name": "llama", "models": ["llama-3"]}],
    "outlier_detection": {"base_ejection_ms": BASE_EJECTION_MS},
}
POD_POOL = {"a": "llama", "b": "llama", "c": "llama"}


@pytest.fixture(params=["filter", "filter_original_dst"])
def stack(request):
    with serving(POD_POOL) as pods:
        envoy = Envoy(request.param, pools_by(pods, POD_POOL, ["llama"]), CONFIG, concurrency=2)
        # The snapshot keeps reading every pod idle and healthy, as a pod whose engine fails
        # while its /metrics answer would.
        pusher = Pusher([envoy], {"llama": [{"address": p.address} for p in pods.values()]})
        try:
            yield envoy, pods
        finally:
            pusher.stop()
            envoy.stop()


def burst(envoy, n, tag, workers=4):
    """n chat requests, `workers` at a time: {(status, pod that answered): count}."""
    def one(i):
        body = {"model": "llama-3", "messages": [{"role": "user", "content": f"{tag} {i}"}]}
        s, h, _, _ = envoy.request("POST", "/v1/chat/completions", body)
        return s, h.get("x-served-by")

    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return collections.Counter(ex.map(one, range(n)))


def ejections(envoy):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.pool.llama.ejections")


def test_a_pod_failing_every_request_leaves_the_picks_and_comes_back(stack):
    envoy, pods = stack
    for p in pods.values():
        p.delay_s = 0.05
    pods["a"].status = 500
    # Bursts until two in a row find the pod out everywhere: the module reads every answer's
    # status and takes it out after five; a proxy-wasm worker reads a sample of them (one in 8)
    # until it sees an error, then every answer, and counts the answers it routed itself (one
    # clean burst can be luck: a worker not yet done may have sent none of its requests there).
    # Before passive health, a third of every burst failed and none ever came clean.
    failed, rounds, clean = 0, 0, 0
    while clean < 2:
        got = burst(envoy, 40, f"broken {rounds}")
        rounds += 1
        assert got[(200, "b")] + got[(200, "c")] + got[(500, "a")] == 40, got
        failed += got[(500, "a")]
        clean = clean + 1 if got[(500, "a")] == 0 else 0
        assert rounds < 20, f"still failing after {rounds} bursts ({failed} failed)"
    wait_for(lambda: ejections(envoy) >= 1, what="the ejection counted")
    if RUNTIME == "dynamic":
        # Five in a row, plus requests already on their way when it went out.
        assert 5 <= failed <= 5 + 4, failed
    else:
        assert 5 <= failed <= 2 * (5 + 40), failed

    # Fixed, and back once its ejection is over.
    pods["a"].status = 200
    time.sleep(BASE_EJECTION_MS / 1000 + 0.3)
    got = burst(envoy, 60, "back")
    assert got[(200, "a")] >= 5, got
    # Envoy writes its log file every few seconds.
    logged = f"of pool llama ejected for {BASE_EJECTION_MS} ms after 5 server errors in a row (status 500"
    wait_for(lambda: logged in envoy.log(), timeout=20, what="the ejection logged")


def test_at_most_half_a_pool_is_out_when_every_pod_fails(stack):
    envoy, pods = stack
    for p in pods.values():
        p.status = 503
    started = time.monotonic()
    got = burst(envoy, 90, "all broken")
    elapsed = time.monotonic() - started
    # Every answer is a pod's own: the filter neither fails the pool open nor leaves it empty.
    assert sum(n for (status, pod), n in got.items() if status == 503 and pod) == 90, got
    assert len({pod for (_, pod) in got}) >= 2, got
    wait_for(lambda: ejections(envoy) >= 1, what="an ejection counted")
    time.sleep(0.3)
    # One pod out at a time (half of three, rounded down) in each engine: the module's one, or
    # each of the two proxy-wasm workers. Without the bound every pod would go out in turn.
    assert elapsed < BASE_EJECTION_MS / 1000, f"the burst outlasted an ejection: {elapsed:.1f} s"
    engines = 2 if RUNTIME == "wasm" else 1
    assert ejections(envoy) <= engines, ejections(envoy)


@pytest.mark.skipif(RUNTIME != "wasm", reason="the dynamic module's workers share one record")
def test_a_pod_one_worker_ejects_is_out_on_the_other_workers_too():
    """A proxy-wasm worker counts the answers it routed; the pods it ejects go on a board in
    Envoy's shared data, and the other workers take them out of their picks at their next tick
    (20 ms) instead of each failing ~8 + 5 requests of its own first. Worker 1 alone meets the
    failing pod and ejects it; worker 2, which never routed to it, then sends it nothing, and
    counts no ejection of its own. Before the board it sent it a third of its requests."""
    with serving(POD_POOL) as pods:
        envoy = Envoy("filter", pools_by(pods, POD_POOL, ["llama"]), CONFIG, concurrency=2)
        pusher = Pusher([envoy], {"llama": [{"address": p.address} for p in pods.values()]})
        conns = connection_per_worker(envoy, 2)
        try:
            first, second = conns.values()

            def send(conn, n, tag):
                got = collections.Counter()
                for i in range(n):
                    body = json.dumps({"model": "llama-3", "messages": [{"role": "user", "content": f"{tag} {i}"}]})
                    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                    r = conn.getresponse()
                    r.read()
                    got[(r.status, r.getheader("x-served-by"))] += 1
                return got

            pods["a"].status = 500
            sent = 0
            while ejections(envoy) < 1:
                assert send(first, 10, f"first {sent}")[(200, "a")] == 0
                sent += 10
                assert sent < 400, "never ejected"
            time.sleep(0.2)
            got = send(second, 60, "second")
            assert got[(500, "a")] == 0, got
            assert ejections(envoy) == 1
        finally:
            for c in conns.values():
                c.close()
            pusher.stop()
            envoy.stop()


UNANSWERED_MS = 500


@contextlib.contextmanager
def unanswered_stack(mode, running):
    """Three pods of one pool, every one read by the snapshot with `running` requests and none
    waiting; passive health judging a request unanswered `UNANSWERED_MS` after it was sent."""
    config = {
        "pools": [{"name": "llama", "models": ["llama-3"]}],
        "outlier_detection": {"base_ejection_ms": 30_000, "unanswered_ms": UNANSWERED_MS},
    }
    with serving(POD_POOL) as pods:
        envoy = Envoy(mode, pools_by(pods, POD_POOL, ["llama"]), config)
        pusher = Pusher([envoy], {"llama": [{"address": p.address, "running": running}
                                            for p in pods.values()]})
        try:
            yield envoy, pods
        finally:
            pusher.stop()
            envoy.stop()


def unanswered(envoy):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.pool.llama.unanswered")


@pytest.mark.parametrize("mode,kind", [("filter", "idle"), ("filter_original_dst", "idle"),
                                       ("filter", "frozen"), ("filter", "stream")])
def test_a_pod_that_takes_requests_and_never_answers_leaves_the_picks(mode, kind):
    """A pod whose API server takes requests and never answers them while its /metrics read idle
    (an engine gone behind a live server): it wins picks by looking idle, no server error ever
    comes, and its clients wait until they give up. The filter counts a request sent to it that
    two scrapes taken `unanswered_ms` later do not account for as a failure in the pod's run:
    after five, it is out. Before (2026-12-07's freshness audit), such a pod kept its third of the
    requests for as long as it hung.

    `idle`: every pod reads idle. `frozen`: every pod reads 2 running, the hung one's counts frozen
    there as its engine stopped; it holds more requests than that. `stream`: streamed requests, the
    hung pod sending its answers' headers at once and no first token (as vLLM starts a stream)."""
    import threading

    hang = threading.Event()
    with unanswered_stack(mode, running=2 if kind == "frozen" else 0) as (envoy, pods), \
            concurrent.futures.ThreadPoolExecutor(100) as ex:
        if kind == "stream":
            pods["a"].hold_body = hang
        else:
            pods["a"].hold = hang
        try:
            def one(i):
                body = {"model": "llama-3", "messages": [{"role": "user", "content": f"first {i}"}],
                        "stream": kind == "stream"}
                try:
                    s, h, _, _ = envoy.request("POST", "/v1/chat/completions", body, timeout=30)
                    return s, h.get("x-served-by")
                except OSError:
                    return None, None

            # 30 requests at once: about a third go to the hung pod, and wait there. Then more
            # as clients keep coming, 3 every 0.2 s, until it is out: a pod whose counts froze
            # at 2 accounts for 2 of those it holds, and only those past its count are judged.
            started = time.monotonic()
            first = [ex.submit(one, i) for i in range(30)]
            more = 0
            while ejections(envoy) < 1:
                assert time.monotonic() - started < 15, "the hung pod never ejected"
                time.sleep(0.2)
                first += [ex.submit(one, 30 + more + k) for k in range(3)]
                more += 3
            took = time.monotonic() - started
            sent_to_a = len(pods["a"].requests)
            print(f"{mode} {kind}: the hung pod took {sent_to_a} of {30 + more}, out after {took:.2f} s")
            assert unanswered(envoy) >= 5
            assert sent_to_a >= 5, sent_to_a
            # Out: every request now goes to the two pods that answer.
            got = burst(envoy, 30, "after")
            assert set(got) <= {(200, "b"), (200, "c")} and sum(got.values()) == 30, got
            assert len(pods["a"].requests) == sent_to_a
        finally:
            hang.set()
        assert all(f.result()[0] == 200 for f in first)
        logged = "of pool llama ejected for 30000 ms after 5 failed requests in a row (the last unanswered after"
        wait_for(lambda: logged in envoy.log(), timeout=20, what="the ejection logged")


def test_a_slow_pod_whose_metrics_show_its_requests_is_not_ejected():
    """The evidence is the pod's own count: a pod that takes longer than `unanswered_ms` to answer
    while its metrics count the requests it holds is busy, not hung, and stays in the picks."""
    with unanswered_stack("filter", running=12) as (envoy, pods):
        for p in pods.values():
            p.delay_s = 4 * UNANSWERED_MS / 1000
        # 12 at a time: however they spread, no pod holds more than its metrics count.
        got = burst(envoy, 24, "slow", workers=12)
        assert sum(got.values()) == 24 and all(s == 200 for s, _ in got), got
        assert len({pod for _, pod in got}) == 3, got
        time.sleep(0.3)
        assert unanswered(envoy) == 0
        assert ejections(envoy) == 0


def test_a_request_judged_unanswered_is_not_counted_again_by_its_504():
    """A route timeout (what the README advises beside `unanswered_ms`) ends a hung request in
    Envoy's 504, a server error; judged unanswered before that, the request is already in its
    pod's run and counts there once. Before, each such request counted twice: the pod was out
    after 3 of them, not `consecutive_5xx` (5)."""
    import threading

    hang = threading.Event()
    config = {"pools": [{"name": "llama", "models": ["llama-3"]}],
              "outlier_detection": {"base_ejection_ms": 30_000, "unanswered_ms": UNANSWERED_MS}}
    with serving({"a": "llama"}) as pods:
        # One pod: every request goes to it (a pool of one may have it out).
        envoy = Envoy("filter", pools_by(pods, {"a": "llama"}, ["llama"]), config,
                      extra={"route_timeout_s": 2})
        pusher = Pusher([envoy], {"llama": [{"address": pods["a"].address}]})
        pods["a"].hold = hang
        try:
            for i in range(4):
                # Each waits for the route timeout, judged unanswered on the way.
                s, _, _, _ = envoy.chat("llama-3", f"hung {i}")
                assert s == 504, s
                wait_for(lambda: unanswered(envoy) == i + 1, timeout=5, what="judged unanswered")
                assert ejections(envoy) == 0, f"out after {i + 1} requests"
            s, _, _, _ = envoy.chat("llama-3", "hung 4")
            assert s == 504
            wait_for(lambda: ejections(envoy) == 1, timeout=5, what="out after the fifth")
        finally:
            hang.set()
            pusher.stop()
            envoy.stop()
