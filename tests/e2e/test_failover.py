"""A pool's failover (`pools[].failover`), end to end in a real Envoy with the built filter (or
the dynamic module, GPUROUTE_RUNTIME=dynamic): while the snapshot shows a pool without a healthy
pod with fresh metrics, its requests go, unchanged but for the pool, to the first of its failover
pools that has one; they come back when it serves again, and nothing moves when nothing is known.
"""

import json
import time
import urllib.request

import pytest

from harness import STAT_PREFIX, Envoy, snapshot
from stubpod import pools_by, serving

CONFIG = {
    "pools": [
        {"name": "llama", "models": ["llama-3"], "aliases": {"llama": "llama-3"}, "adapters": ["sql"],
         "failover": ["dr", "standby"]},
        # Standby pools: no names of their own, only another pool's failover.
        {"name": "dr", "models": []},
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
    e = Envoy("filter", pools_by(pods, POD_POOL, POOLS), CONFIG)
    yield e
    e.stop()


def push(envoy, pods, down=(), version=None):
    """A snapshot with every pod healthy but those of the pools in `down`."""
    snap = snapshot({pool: [{"address": p.address, "healthy": pool not in down}
                            for n, p in pods.items() if POD_POOL[n] == pool] for pool in POOLS},
                    version=version)
    assert envoy.push(snap)[0] == 204


def send(envoy, model, text="hello"):
    """(pool of the pod that served, what it received, the response headers)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    s, h, echo, raw = envoy.request("POST", "/v1/chat/completions", body)
    assert s == 200, (s, raw[:300])
    return POD_POOL[h["x-served-by"]], echo, h


def failed_over(envoy, to):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.failover.llama.to.{to}")


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
