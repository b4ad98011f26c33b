"""The dynamic module inside Envoy's process: what would crash Envoy rather than fail a request.

A held request the module answers itself when it decides again (here: its pool left the snapshot
on an ORIGINAL_DST gateway, 503 "no endpoint") is answered from `on_http_filter_scheduled`,
outside Envoy's filter iteration: Envoy then ends the stream inside `send_response`, running the
module's `stream_complete` hook there. That hook deletes the stream's scheduler; it must first
take the request out of the hold queue, or the ticker thread and the other workers, which wake
held requests through the queue, commit through a deleted scheduler (Envoy crashed with
SIGSEGV in `Config::wake_held`, or its workers hung)."""

import concurrent.futures

import pytest

from harness import RUNTIME, STAT_PREFIX, Envoy, snapshot, wait_for
from stubpod import serving

pytestmark = pytest.mark.skipif(RUNTIME != "dynamic", reason="the dynamic module's own hooks")

HELD = 300
ROUNDS = 8


def held(gw):
    try:
        return gw.stats().get(STAT_PREFIX + "gpuroute.held.llama", 0)
    except OSError:
        return 0


def test_held_requests_answered_by_the_module_on_their_second_decision_do_not_crash_envoy():
    with serving(["p0", "p1"]) as pods:
        addrs = [pods["p0"].address, pods["p1"].address]
        gw = Envoy("filter_original_dst", [{"name": "llama", "endpoints": addrs}],
                   {"pools": [{"name": "llama", "models": ["llama-3-8b"]}],
                    "scoring": {"stale_after_ms": 60_000},
                    # Wakes the first held request every millisecond: the race in a few rounds.
                    "tick_ms": 1,
                    "hold": {"max_wait_ms": 30_000, "max_held": 60_000}},
                   concurrency=2)
        try:
            statuses = {}
            for _ in range(ROUNDS):
                saturated = snapshot({"llama": [{"address": a, "waiting": 9} for a in addrs]})
                assert gw.push(saturated)[0] == 204
                with concurrent.futures.ThreadPoolExecutor(HELD) as ex:
                    asks = [ex.submit(gw.chat, "llama-3-8b", f"hi {i}", None, "/v1/chat/completions", 30)
                            for i in range(HELD)]
                    wait_for(lambda: not gw.alive() or held(gw) >= HELD, 30, "every request held")
                    assert gw.alive(), gw.log()[-3000:]
                    # The pool leaves the snapshot: each held request is answered by the module.
                    assert gw.push(snapshot({"other": [{"address": addrs[0]}]}))[0] == 204
                    for a in asks:
                        try:
                            s = a.result()[0]
                        except Exception as e:  # noqa: BLE001 - a crash shows as a reset or timeout
                            s = type(e).__name__
                        statuses[s] = statuses.get(s, 0) + 1
                assert gw.alive(), gw.log()[-3000:]
            assert statuses == {503: HELD * ROUNDS}
            assert "Caught" not in gw.log()
        finally:
            gw.stop()
