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

from harness import ROOT, RUNTIME, STAT_PREFIX, Envoy, snapshot, wait_for
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


EXPIRING = 6000


def peak_rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def test_held_requests_whose_waits_run_out_together_wake_each_other_once():
    """Every request that goes wakes the held requests whose wait ran out (`Wake::Sent`); each
    of those that had not yet run its wake got another: 6,000 held requests whose waits ran out
    together posted ~18 million events to Envoy's workers (its memory went from 0.2 to 1.3 GB,
    the last answers took up to two minutes). At most one wake per held request is on its way."""
    import json
    import socket
    import time

    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    with serving(["p0", "p1"]) as pods:
        addrs = [pods["p0"].address, pods["p1"].address]
        gw = Envoy("filter", [{"name": "llama", "endpoints": addrs}],
                   {"pools": [{"name": "llama", "models": ["llama-3-8b"]}],
                    "scoring": {"stale_after_ms": 600_000},
                    "hold": {"max_wait_ms": 3000, "max_held": 65_536}},
                   concurrency=2)
        try:
            saturated = snapshot({"llama": [{"address": a, "waiting": 9} for a in addrs]})
            assert gw.push(saturated)[0] == 204
            conns = []
            host, port = gw.listen.rsplit(":", 1)
            for k in range(EXPIRING // 500):
                s = socket.create_connection((host, int(port)))
                s.settimeout(0.05)
                c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                c.initiate_connection()
                c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
                for i in range(500):
                    sid = c.get_next_available_stream_id()
                    body = json.dumps({"model": "llama-3-8b",
                                       "messages": [{"role": "user", "content": f"x{k} {i}"}]}).encode()
                    c.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"),
                                         (":scheme", "http"), (":authority", "gw"),
                                         ("content-type", "application/json"),
                                         ("content-length", str(len(body)))])
                    c.send_data(sid, body, end_stream=True)
                s.sendall(c.data_to_send())
                conns.append((s, c))
            wait_for(lambda: held(gw) >= EXPIRING, 30, "every request held")
            before = peak_rss_kb(gw.proc.pid)
            done, t0 = 0, time.time()
            while done < EXPIRING and time.time() - t0 < 60 and gw.alive():
                for s, c in conns:
                    try:
                        data = s.recv(1 << 20)
                    except socket.timeout:
                        continue
                    for ev in c.receive_data(data):
                        if isinstance(ev, h2.events.StreamEnded):
                            done += 1
                        elif isinstance(ev, h2.events.DataReceived):
                            c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    s.sendall(c.data_to_send())
            grown_mb = (peak_rss_kb(gw.proc.pid) - before) // 1024
            assert gw.alive()
            assert done == EXPIRING, f"{done} answered in {time.time() - t0:.0f} s"
            # Fixed: ~140 MB (the requests themselves, upstream); before: ~1,100 MB.
            assert grown_mb < 500, f"Envoy grew by {grown_mb} MB"
            for s, _ in conns:
                s.close()
        finally:
            gw.stop()


def test_a_released_request_whose_route_answers_at_once_is_answered():
    """A held request released from `on_http_filter_scheduled` whose route answers at once (no
    route for its pool here: the route table's direct 503) is answered inside
    `continue_decoding`, where Envoy runs the stream's response and completion hooks; the module
    resumes it only once it no longer borrows the stream's state (before, those hooks took a
    second `&mut` to it while `on_scheduled` held one: undefined behaviour, seen with a probe
    build, not as a wrong answer). The answer carries the debug header written on release."""

    def no_pool_routes(config):
        for listener in config["static_resources"]["listeners"]:
            for chain in listener.get("filter_chains", []):
                for f in chain.get("filters", []):
                    rc = f.get("typed_config", {}).get("route_config")
                    for vh in (rc or {}).get("virtual_hosts", []):
                        vh["routes"] = [r for r in vh["routes"]
                                        if not any(h.get("name") == "x-gateway-pool"
                                                   for h in r["match"].get("headers", []))]

    with serving(["p0"]) as pods:
        addr = pods["p0"].address
        gw = Envoy("filter", [{"name": "llama", "endpoints": [addr]}],
                   {"pools": [{"name": "llama", "models": ["llama-3-8b"]}],
                    "scoring": {"stale_after_ms": 60_000}, "debug_header": True,
                    "hold": {"max_wait_ms": 200}},
                   patch=no_pool_routes)
        try:
            assert gw.push(snapshot({"llama": [{"address": addr, "waiting": 9}]}))[0] == 204
            for _ in range(3):
                status, headers, _, _ = gw.chat("llama-3-8b")
                assert status == 503
                assert headers.get("x-gateway-debug", "").startswith("held=")
            assert gw.alive()
            wait_for(lambda: held(gw) == 0, 5, "none held")
        finally:
            gw.stop()


# The module built with its `panic-probe` feature (make native): a request naming a hook in
# `x-gpuroute-panic` makes that hook panic.
PANIC_MODULE_DIR = ROOT / "target" / "dynmod-panic" / "release"


def test_a_panic_in_a_hook_is_caught_and_the_request_goes_on_unrouted():
    """A panic unwinding out of an `extern "C"` hook aborts the process: Envoy and every request
    in it. No panic is known (the audits' fuzzing found none); each hook catches one, logs it,
    counts it in `gpuroute.module.panics`, and lets the stream go on: a request whose routing
    it cut short gets the shipped route table's 503 `routing_unavailable` (retryable, as from a
    worker whose proxy-wasm VM failed), one already routed its answer, and Envoy keeps serving
    (the build before aborted at the first)."""
    if not (PANIC_MODULE_DIR / "libgpuroute.so").exists():
        pytest.fail(f"the panic-probe build is missing: {PANIC_MODULE_DIR} (`make native` builds it)")
    with serving(["p0", "p1"]) as pods:
        addrs = [pods["p0"].address, pods["p1"].address]
        gw = Envoy("filter", [{"name": "llama", "endpoints": addrs}],
                   {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True,
                    "scoring": {"stale_after_ms": 60_000}},
                   concurrency=2, module_dir=PANIC_MODULE_DIR)
        try:
            assert gw.push(snapshot({"llama": [{"address": a} for a in addrs]}))[0] == 204
            body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}]}
            hooks = ["request_headers", "request_body", "response_headers"]
            for hook in hooks * 3:
                s, h, answer, raw = gw.request("POST", "/v1/chat/completions", body, {"x-gpuroute-panic": hook})
                if hook == "response_headers":
                    assert s == 200 and h["x-served-by"] in ("p0", "p1"), (hook, s, raw[:200])
                else:
                    assert (s, answer["error"]["code"]) == (503, "routing_unavailable"), (hook, s, raw[:200])
                assert gw.proc.poll() is None, f"Envoy exited after a panic in {hook}"
            # The requests after them are routed as before.
            for _ in range(4):
                s, h, _, _ = gw.request("POST", "/v1/chat/completions", body)
                assert s == 200 and h["x-gateway-debug"].startswith("pool=llama"), h
            wait_for(lambda: gw.stat(STAT_PREFIX + "gpuroute.module.panics") == 9, 5, "9 panics counted")
        finally:
            gw.stop()
        # Envoy writes its log file out at exit.
        for hook in hooks:
            assert f"gpuroute: caught a panic in {hook}: panic-probe in {hook}" in gw.log()
