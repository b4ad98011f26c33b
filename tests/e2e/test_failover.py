"""A pool's failover (`pools[].failover`, `overflow`), end to end in a real Envoy with the built
filter (or the dynamic module, GPUROUTE_RUNTIME=dynamic): while the snapshot shows a pool without
a healthy pod with fresh metrics, its requests go, unchanged but for the pool, to the first of
its failover pools that has one; with `overflow`, also while all its pods are saturated (by the
snapshot, or by what the gateway sent them since), to the first with room. They come back when it
serves again, and nothing moves when nothing is known.
"""

import concurrent.futures
import json
import threading
import time
import urllib.request

import pytest

from harness import STAT_PREFIX, Envoy, settle, snapshot, wait_for
from stubpod import pools_by, serving

CONFIG = {
    "pools": [
        {"name": "llama", "models": ["llama-3"], "aliases": {"llama": "llama-3"}, "adapters": ["sql"],
         "failover": ["dr", "standby"], "overflow": True,
         # Two requests waiting per pod saturate it, so that a burst of four fills the pool.
         "scoring": {"queue_threshold": 2}},
        # Standby pools: no names of their own, only another pool's failover.
        {"name": "dr", "models": [], "scoring": {"queue_threshold": 2}},
        {"name": "standby", "models": []},
        {"name": "qwen", "models": ["qwen"]},
    ],
    "debug_header": True,
}
POD_POOL = {"llama-0": "llama", "llama-1": "llama", "dr-0": "dr", "standby-0": "standby", "qwen-0": "qwen"}
POOLS = ["llama", "dr", "standby", "qwen"]


@pytest.fixture(scope="module")
def pods():
    with serving(POD_POOL) as pods:
        yield pods


@pytest.fixture(scope="module")
def envoy(pods):
    # Two workers: a burst's requests are counted across them.
    e = Envoy("filter", pools_by(pods, POD_POOL, POOLS), CONFIG, concurrency=2)
    yield e
    e.stop()


SATURATED = {"waiting": 40, "running": 60, "kv_cache_usage": 0.9}


def push(envoy, pods, down=(), busy=()):
    """A snapshot with every pod healthy but those of the pools in `down`, and idle but those of
    the pools in `busy` (saturated: a queue and KV use past the default thresholds)."""
    snap = snapshot({pool: [dict({"address": p.address, "healthy": pool not in down}, **(SATURATED if pool in busy else {}))
                            for n, p in pods.items() if POD_POOL[n] == pool] for pool in POOLS})
    assert envoy.push(snap)[0] == 204


def send(envoy, model, text="hello"):
    """(pool of the pod that served, what it received, the response headers)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    s, h, echo, raw = envoy.request("POST", "/v1/chat/completions", body)
    assert s == 200, (s, raw[:300])
    return POD_POOL[h["x-served-by"]], echo, h


def failed_over(envoy, to, why="failover"):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.{why}.llama.to.{to}")


def test_a_pool_without_a_healthy_pod_fails_over_in_order_and_comes_back(envoy, pods):
    push(envoy, pods)
    for i in range(6):
        assert send(envoy, "llama-3", f"up {i}")[0] == "llama"
    assert failed_over(envoy, "dr") == 0

    # Every llama pod fails its scrapes: its requests go to the first failover pool, as they
    # were (the alias resolved, the adapter with its base model), the pool header naming it.
    push(envoy, pods, down={"llama"})
    for i in range(6):
        pool, echo, h = send(envoy, "llama-3", f"down {i}")
        assert pool == "dr", (i, h)
        assert echo["headers"]["x-gateway-pool"] == "dr"
        assert h["x-gateway-debug"].startswith("failover=llama->dr; pool=dr"), h
    pool, echo, _ = send(envoy, "llama")
    assert pool == "dr" and json.loads(echo["body"])["model"] == "llama-3"
    pool, echo, _ = send(envoy, "sql")
    assert pool == "dr" and json.loads(echo["body"])["model"] == "sql"
    assert echo["headers"]["x-gateway-base-model-name"] == "llama-3"
    assert failed_over(envoy, "dr") == 8
    # Another pool's requests are not moved.
    assert send(envoy, "qwen")[0] == "qwen"

    # The first failover pool down too: the next in the list.
    push(envoy, pods, down={"llama", "dr"})
    assert [send(envoy, "llama-3", f"b {i}")[0] for i in range(3)] == ["standby"] * 3
    assert failed_over(envoy, "standby") == 3

    # None can serve: the request stays with its pool and fails open there (Envoy's own
    # balancing over the pool's cluster), as without failover.
    fail_open = f"{STAT_PREFIX}gpuroute.pool.llama.requests.fail_open"
    before = envoy.stat(fail_open)
    push(envoy, pods, down={"llama", "dr", "standby"})
    assert [send(envoy, "llama-3", f"c {i}")[0] for i in range(3)] == ["llama"] * 3
    assert envoy.stat(fail_open) - before == 3
    assert (failed_over(envoy, "dr"), failed_over(envoy, "standby")) == (8, 3)

    # llama serves again: its requests come back with the next snapshot.
    push(envoy, pods)
    assert [send(envoy, "llama-3", f"d {i}")[0] for i in range(4)] == ["llama"] * 4
    assert failed_over(envoy, "dr") == 8

    # One labelled family in Prometheus: the pool and the failover pool as labels.
    with urllib.request.urlopen(f"http://{envoy.admin}/stats/prometheus", timeout=5) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("envoy_gpuroute_failover_to{")]
    counts = {(ln.split('gpuroute_pool="')[1].split('"')[0], ln.split('gpuroute_target="')[1].split('"')[0]):
              int(ln.rsplit(" ", 1)[1]) for ln in lines}
    assert counts == {("llama", "dr"): 8, ("llama", "standby"): 3}, lines


def test_with_overflow_a_saturated_pool_sends_its_requests_to_a_failover_pool_with_room(envoy, pods):
    sheddable = {"x-gateway-priority": "-1"}
    body = {"model": "llama-3", "messages": [{"role": "user", "content": "burst"}]}
    # Every llama pod saturated: to the first failover pool with room, sheddable requests too
    # (they are shed only when no pod anywhere has room).
    push(envoy, pods, busy={"llama"})
    for i in range(4):
        pool, _, h = send(envoy, "llama-3", f"burst {i}")
        assert pool == "dr" and h["x-gateway-debug"].startswith("overflow=llama->dr; pool=dr"), h
    s, h, _, _ = envoy.request("POST", "/v1/chat/completions", body, sheddable)
    assert s == 200 and POD_POOL[h["x-served-by"]] == "dr", (s, h)
    assert failed_over(envoy, "dr", "overflow") == 5
    # The first failover pool saturated too: the next with room.
    push(envoy, pods, busy={"llama", "dr"})
    assert [send(envoy, "llama-3", f"b {i}")[0] for i in range(3)] == ["standby"] * 3
    # No room anywhere: the request stays, and the pool's own saturation rules apply (a
    # sheddable request is shed).
    push(envoy, pods, busy={"llama", "dr", "standby"})
    assert send(envoy, "llama-3", "everything busy")[0] == "llama"
    s, _, err, _ = envoy.request("POST", "/v1/chat/completions", body, sheddable)
    assert s == 429, (s, err)
    # Room again in llama: the requests come back.
    push(envoy, pods)
    assert [send(envoy, "llama-3", f"c {i}")[0] for i in range(3)] == ["llama"] * 3
    assert (failed_over(envoy, "dr", "overflow"), failed_over(envoy, "standby", "overflow")) == (5, 3)
    with urllib.request.urlopen(f"http://{envoy.admin}/stats/prometheus", timeout=5) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("envoy_gpuroute_overflow_to{")]
    assert sorted(ln.split('gpuroute_target="')[1].split('"')[0] for ln in lines) == ["dr", "standby"], lines


def test_with_overflow_a_burst_moves_over_as_it_fills_the_pools_not_at_the_next_snapshot(envoy, pods):
    """The requests the gateway sent since the snapshot count as waiting at their pods, as the
    pick counts them: the request that finds every pod of the pool full by that count goes to
    the first failover pool with room at once, and when that one fills up the same way, on to
    the next. No snapshot is pushed during the burst."""
    push(envoy, pods)
    held = {name: p for name, p in pods.items() if POD_POOL[name] in ("llama", "dr")}
    at = lambda pool: sum(len(p.requests) for n, p in held.items() if POD_POOL[n] == pool)
    before = {to: failed_over(envoy, to, "overflow") for to in ("dr", "standby")}
    gate = threading.Event()
    for p in held.values():
        p.hold = gate
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            try:
                # Requests held at the pods, each sent once the one before reached its pod: two
                # per pod, the queue threshold of llama (two pods) and of dr (one).
                burst = []
                for i, pool in enumerate(["llama"] * 4 + ["dr"] * 2):
                    n = at(pool)
                    burst.append(ex.submit(send, envoy, "llama-3", f"burst {i}"))
                    wait_for(lambda: at(pool) > n, what=f"burst request {i} at a {pool} pod")
                    time.sleep(0.05)
                last = send(envoy, "llama-3", "one more")
            finally:
                gate.set()
            served = [f.result() for f in burst]
    finally:
        for p in held.values():
            p.hold = None
    assert [pool for pool, _, _ in served] == ["llama"] * 4 + ["dr"] * 2
    assert all(h["x-gateway-debug"].startswith("overflow=llama->dr; pool=dr") for _, _, h in served[4:])
    pool, _, h = last
    assert pool == "standby" and h["x-gateway-debug"].startswith("overflow=llama->standby; pool=standby"), h
    # Each request counted once, for the pool that took it (the module hands its counts to Envoy
    # on its next tick).
    moved = lambda: {to: failed_over(envoy, to, "overflow") - before[to] for to in before}
    settle(lambda: moved() == {"dr": 2, "standby": 1})
    assert moved() == {"dr": 2, "standby": 1}
    # Their answers in, the pool has room again, still without a new snapshot.
    assert [send(envoy, "llama-3", f"after {i}")[0] for i in range(3)] == ["llama"] * 3


def test_nothing_moves_on_what_is_not_known(envoy, pods):
    """A snapshot gone stale (the aggregator stopped) says nothing against any pool: once the
    last one, which showed the pool down, is older than `stale_after_ms` (1 s), the pool keeps
    its requests and they fail open there."""
    push(envoy, pods, down={"llama"})
    assert send(envoy, "llama-3", "fresh")[0] == "dr"
    before = failed_over(envoy, "dr")
    time.sleep(1.2)
    assert [send(envoy, "llama-3", f"stale {i}")[0] for i in range(3)] == ["llama"] * 3
    assert failed_over(envoy, "dr") == before


def test_a_standby_pool_is_not_listed_and_cannot_be_asked_for(envoy):
    s, _, body, _ = envoy.request("GET", "/v1/models")
    assert s == 200
    assert sorted(m["id"] for m in body["data"]) == ["llama", "llama-3", "qwen", "sql"]
    s, _, body, _ = envoy.request("POST", "/v1/chat/completions",
                                  {"model": "dr", "messages": [{"role": "user", "content": "hi"}]})
    assert s == 404 and body["error"]["code"] == "model_not_found", body


def test_an_adapter_request_stays_on_its_adapters_pod_under_lora_queue_threshold(envoy, pods):
    """Every llama pod saturated (2 waiting, `queue_threshold: 2`), llama-0 running `sql` far
    under `scoring.lora_queue_threshold` (5): `sql` requests keep to llama-0, as in a pool without
    overflow, instead of loading the adapter on the failover pool. Before, all four went over (an
    audit: `overflow=main->burst`). At the adapter's threshold they go over."""
    def push_lora(waiting_0):
        def pod(name, waiting, running, slots):
            return {"address": pods[name].address, "waiting": waiting, "running": 2,
                    "lora": {"max_loras": slots, "running": running, "waiting": []}}
        snap = snapshot({
            # llama-1's one slot is taken: only llama-0 holds `sql`.
            "llama": [pod("llama-0", waiting_0, ["sql"], 4), pod("llama-1", 2, ["other"], 1)],
            **{pool: [{"address": p.address} for n, p in pods.items() if POD_POOL[n] == pool]
               for pool in POOLS if pool != "llama"},
        })
        assert envoy.push(snap)[0] == 204

    before = failed_over(envoy, "dr", "overflow")
    push_lora(2)
    for i in range(4):
        _, _, h = send(envoy, "sql", f"adapter {i}")
        assert h["x-served-by"] == "llama-0" and h["x-gateway-debug"].startswith("pool=llama;"), h
    assert failed_over(envoy, "dr", "overflow") == before
    # A base-model request goes over as before.
    assert send(envoy, "llama-3", "base")[0] == "dr"
    # llama-0 at lora_queue_threshold: the adapter's request goes over too.
    push_lora(5)
    pool, _, h = send(envoy, "sql", "adapter at threshold")
    assert pool == "dr" and h["x-gateway-debug"].startswith("overflow=llama->dr; pool=dr"), h
    assert failed_over(envoy, "dr", "overflow") == before + 2
    push(envoy, pods)


def test_a_turn_continuing_a_stored_response_stays_on_its_pod_while_the_pool_overflows(envoy, pods):
    """Responses API with overflow: every llama pod saturated, a turn that continues a stored
    response a llama pod holds goes to that pod (no other pool's pod has the response: vLLM
    answers 404 there), while a new conversation goes over. Before, the turn went over with the
    rest (df34236's build: served by dr-0)."""
    push(envoy, pods)
    s, h, first, _ = envoy.request("POST", "/v1/responses", {"model": "llama-3", "input": "remember 42"})
    assert s == 200 and POD_POOL[h["x-served-by"]] == "llama", (s, h)
    held = h["x-served-by"]
    push(envoy, pods, busy={"llama"})
    # Either worker: the one that served the answer wrote the id's shared slot.
    for i in range(4):
        turn = {"model": "llama-3", "previous_response_id": first["id"], "input": f"what was it? ({i})"}
        s, h, _, _ = envoy.request("POST", "/v1/responses", turn)
        assert (s, h["x-served-by"]) == (200, held), (s, h)
        assert h["x-gateway-debug"].startswith("previous-response; pool=llama;"), h
    s, h, _, _ = envoy.request("POST", "/v1/responses", {"model": "llama-3", "input": "a new one"})
    assert s == 200 and POD_POOL[h["x-served-by"]] == "dr", (s, h)
    push(envoy, pods)
