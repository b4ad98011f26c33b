"""An earlier build of the filter and this one in one Envoy, as during an upgrade or a rollback.

Envoy keeps the shared data of a `vm_id` for every VM of that id, whatever its code: while a
listener update drains the old filter chains, the old build's VMs and the new build's read and
write the same keys (the snapshot, the workers' registry and in-flight tables, the prefix
records). So each build must read what the other writes, or routing breaks for the drain time
(minutes, for keep-alive connections). The earlier build is the commit named in
upgrade_base.txt, built by `make wasm-base`; its snapshot is JSON only, where this build also
stores a binary form and reads the JSON when that form is not the current one.

Side by side: one Envoy with each build on its own gateway and ingest listener (same `vm_id`,
same plugin configuration). Then the upgrade as it happens: the listeners served by LDS, their
.wasm changed from the earlier build to this one and back.
"""

import json
import threading
import time
from collections import Counter

import pytest

from harness import (BASE_WASM, RUNTIME, STAT_PREFIX, UPGRADE_BASE, WASM, Envoy, LdsListener, free_port, snapshot,
                     wasm_filter)
from stubpod import serving

pytestmark = pytest.mark.skipif(
    RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module keeps its state in the process, not in shared data")

# Snapshots stay fresh for a minute: a listener change can take seconds on a loaded machine,
# and a pod gone stale in between would fail open for a reason the test is not about.
CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True,
          "scoring": {"stale_after_ms": 60_000}}
READ_JSON = STAT_PREFIX + "gpuroute.snapshot.read_json"
NAMES = ["llama-0", "llama-1", "llama-2"]


@pytest.fixture(scope="module")
def pods():
    if not BASE_WASM.exists():
        pytest.fail(f"the earlier build is missing: {BASE_WASM} (`make wasm-base` builds {UPGRADE_BASE})")
    with serving(NAMES) as pods:
        yield pods


def pools_of(pods):
    return [{"name": "llama", "endpoints": [pods[n].address for n in NAMES]}]


def loads(pods, idle):
    """A snapshot where pod `idle` is idle and the others busy."""
    busy = {"waiting": 3, "running": 30, "kv_cache_usage": 0.6}
    return snapshot({"llama": [dict({"address": pods[n].address}, **({} if i == idle else busy))
                               for i, n in enumerate(NAMES)]})


class Beside:
    """Envoy's configuration patched with the earlier build on a second gateway listener and a
    second ingest listener, copies of the rendered ones on ports of their own."""

    def __init__(self):
        self.listen = f"127.0.0.1:{free_port()}"
        self.ingest = f"127.0.0.1:{free_port()}"

    def __call__(self, config):
        listeners = config["static_resources"]["listeners"]
        for name, addr in [("openai", self.listen), ("gpuroute_ingest", self.ingest)]:
            copy = json.loads(json.dumps(next(lst for lst in listeners if lst["name"] == name)))
            copy["name"] = name + "_base"
            host, port = addr.rsplit(":", 1)
            copy["address"]["socket_address"].update(address=host, port_value=int(port))
            wasm_filter(copy)["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(BASE_WASM)
            listeners.append(copy)


def chat(e, addr, text="hello", messages=None):
    body = {"model": "llama-3-8b", "messages": messages or [{"role": "user", "content": text}]}
    return e.request("POST", "/v1/chat/completions", body, addr=addr, timeout=30)


def entry(debug, address):
    """One candidate's scores in an `x-gateway-debug` header: {"total": .., "queue": .., ...}."""
    for part in debug.split("; "):
        if part.startswith(address + " total="):
            return {k: float(v) for k, v in (kv.split("=") for kv in part.split(" ")[1:] if "=" in kv)}
    raise AssertionError(f"{address} not scored in {debug}")


def picked(resp):
    debug = resp[1].get("x-gateway-debug", "")
    assert resp[0] == 200 and debug.startswith("pool=llama; picked="), (resp[0], debug)
    return resp[1]["x-served-by"]


@pytest.fixture(scope="module")
def beside(pods):
    b = Beside()
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=2, patch=b)
    e.base_listen, e.base_ingest = b.listen, b.ingest
    yield e
    e.stop()


def test_each_build_routes_by_the_snapshot_the_other_took(beside, pods):
    e = beside
    builds = {"earlier": (e.base_listen, e.base_ingest), "this": (e.listen, e.ingest)}
    # Pushed to each build's ingest in turn, and back: both gateways follow every push.
    for k, (pusher, idle) in enumerate([("this", 1), ("earlier", 2), ("this", 0), ("earlier", 1)]):
        json_reads = e.stat(READ_JSON)
        assert e.push(loads(pods, idle), addr=builds[pusher][1])[0] == 204
        for name, (listen, _) in builds.items():
            got = Counter(picked(chat(e, listen, f"push {k} via {name}, request {i}")) for i in range(8))
            assert got == {NAMES[idle]: 8}, (pusher, name, got)
        if pusher == "earlier":
            # This build's workers found the binary form of an older version, and read the JSON.
            assert e.stat(READ_JSON) > json_reads
    assert e.alive()


@pytest.mark.parametrize("holder,prober", [("earlier", "this"), ("this", "earlier")])
def test_each_build_counts_the_others_requests_in_flight(beside, pods, holder, prober):
    """Requests one build sent and that are still in flight count against their pod in the
    other build's picks: a pod the snapshot shows idle, holding requests the other build sent,
    scores as more queued than the same pod with nothing in flight."""
    e = beside
    addr = {"earlier": e.base_listen, "this": e.listen}
    target = pods["llama-0"]
    quiet = {"running": 12, "waiting": 2}
    snap = snapshot({"llama": [{"address": pods[n].address, **({} if n == "llama-0" else quiet)} for n in NAMES]})
    assert e.push(snap)[0] == 204
    before = entry(chat(e, addr[prober], "probe before")[1]["x-gateway-debug"], target.address)
    target.hold = threading.Event()
    threads = []
    try:
        start = len(target.started)
        for i in range(10):
            if len(target.started) - start >= 3:
                break
            t = threading.Thread(target=chat, args=(e, addr[holder], f"held {holder} {i}"))
            t.start()
            threads.append(t)
            deadline = time.time() + 2
            while len(target.started) - start <= i and time.time() < deadline and t.is_alive():
                time.sleep(0.01)
        held = len(target.started) - start
        assert held >= 3, f"the {holder} build sent {held} requests to {target.name}"
        time.sleep(0.2)  # the workers exchange their tables every shared_refresh_ms, or at a tick
        out = {}
        probe = threading.Thread(target=lambda: out.update(r=chat(e, addr[prober], "probe after")))
        probe.start()
        probe.join(1.0)  # it waits on the held pod if it went there
    finally:
        target.hold.set()
        target.hold = None
        for t in threads:
            t.join(30)
    probe.join(30)
    after = entry(out["r"][1]["x-gateway-debug"], target.address)
    # Nothing in flight: the idle pod has the best queue score; with the other build's requests
    # in prefill on it, a lower one (they count as queued until their first byte comes back).
    assert before["queue"] == 1.0, before
    assert after["queue"] < before["queue"] - 0.05, (held, before, after)


@pytest.mark.parametrize("first,second", [("earlier", "this"), ("this", "earlier")])
def test_a_conversation_keeps_its_pod_across_builds(beside, pods, first, second):
    """A follow-up turn routed by one build finds the pod the other build sent the turn before
    to: the builds read each other's prefix records."""
    e = beside
    addr = {"earlier": e.base_listen, "this": e.listen}
    assert e.push(snapshot({"llama": [{"address": pods[n].address} for n in NAMES]}))[0] == 204
    system = f"You answer questions about parcels for the {first}-{second} depot. " * 30
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Where is parcel 5521?"}]
    pod = picked(chat(e, addr[first], messages=turn))
    turn += [{"role": "assistant", "content": "In the hub."}, {"role": "user", "content": "And 5522?"}]
    # One try only: a turn routed records its own prefix, so a second try would find that. The
    # other build takes the records at its next tick (20 ms) or exchange.
    time.sleep(0.5)
    r = chat(e, addr[second], messages=turn)
    prefix = entry(r[1]["x-gateway-debug"], pods[pod].address).get("prefix", 0.0)
    # A new prompt's home gets at most 0.27 (0.9 x 0.3): more is the earlier turn's record.
    assert prefix > 0.5, r[1]["x-gateway-debug"]
    assert picked(r) == pod


def test_upgrading_and_rolling_back_the_filter_keeps_routing_by_the_stored_snapshot(pods, tmp_path):
    """The gateway and ingest listeners served by LDS, their .wasm changed from the earlier build
    to this one and back. After each change the new VMs route at once by the snapshot the other
    build stored (no push in between, no fail-open), then by the next one pushed to them."""
    lds = LdsListener(tmp_path / "lds", names=("openai", "gpuroute_ingest"))
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=2, workdir=tmp_path / "envoy", wasm=BASE_WASM,
              patch=lds.patch, envoy_args=lds.envoy_args)
    try:
        def routes_to(idle, label):
            # Fresh connections: each reaches the listener's current filter chain.
            def body(i):
                return {"model": "llama-3-8b", "messages": [{"role": "user", "content": f"{label} {i}"}]}

            got = Counter(picked(e.request("POST", "/v1/chat/completions", body(i), {"connection": "close"}))
                          for i in range(8))
            assert got == {NAMES[idle]: 8}, (label, got)

        assert e.push(loads(pods, 1))[0] == 204
        routes_to(1, "earlier build")
        lds.change(e, timeout_s=20, wasm=WASM)
        routes_to(1, "upgraded, before any push")
        assert e.stat(READ_JSON) > 0  # no binary form yet: the stored JSON
        assert e.push(loads(pods, 2))[0] == 204
        routes_to(2, "upgraded, pushed")
        lds.change(e, timeout_s=20, wasm=BASE_WASM)
        routes_to(2, "rolled back, before any push")
        assert e.push(loads(pods, 0))[0] == 204
        routes_to(0, "rolled back, pushed")
        fail_open = {k: v for k, v in e.stats(r"gpuroute\..*fail_open").items() if v}
        assert not fail_open, fail_open
        assert e.alive()
    finally:
        e.stop()
