"""Per-pool scoring (`pools[].scoring`), end to end in a real Envoy with the built filter: pools
on the same snapshot, one that takes older metrics than the other, and two with a low queue
threshold that keep (or, past their own threshold, give up) adapter affinity."""

import pytest

from harness import STAT_PREFIX, Envoy, now_ms, snapshot
from stubpod import serving

CONFIG = {
    "debug_header": True,
    "pools": [
        {"name": "chat", "models": ["chat-model"]},
        # Its pods' metrics come slower: up to 10 s old still count.
        {"name": "batch", "models": ["batch-model"], "scoring": {"stale_after_ms": 10000, "preset": "throughput"}},
        # A low queue threshold (what `hold` wants); adapter requests keep the default 5 for their
        # adapter's pods, or, in `strict`, 2.
        {"name": "lora", "models": ["lora-model"], "adapters": ["sql-lora"], "scoring": {"queue_threshold": 1}},
        {
            "name": "strict",
            "models": ["strict-model"],
            "adapters": ["sql-strict"],
            "scoring": {"queue_threshold": 1, "lora_queue_threshold": 2},
        },
    ],
}


@pytest.fixture(scope="module")
def pods():
    with serving([f"{pool}-{i}" for pool in ("chat", "batch", "lora", "strict") for i in range(2)]) as pods:
        yield pods


@pytest.fixture(scope="module")
def envoy(pods):
    pools = [{"name": pool, "endpoints": [pods[f"{pool}-{i}"].address for i in range(2)]} for pool in ("chat", "batch", "lora", "strict")]
    e = Envoy("filter", pools, CONFIG)
    yield e
    e.stop()


def outcome(envoy, pool, what):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.pool.{pool}.requests.{what}")


def test_each_pool_judges_freshness_by_its_own_scoring(envoy, pods):
    scraped = now_ms() - 3000
    snap = snapshot({pool: [{"address": pods[f"{pool}-{i}"].address, "last_scrape_ms": scraped} for i in range(2)]
                     for pool in ("chat", "batch")})
    assert envoy.push(snap)[0] == 204
    before = {p: (outcome(envoy, p, "picked"), outcome(envoy, p, "fail_open")) for p in ("chat", "batch")}
    for model in ("chat-model", "batch-model"):
        for _ in range(5):
            s, h, _, _ = envoy.chat(model, "hello")
            assert s == 200 and h["x-served-by"].startswith(model.split("-")[0])
    after = {p: (outcome(envoy, p, "picked"), outcome(envoy, p, "fail_open")) for p in ("chat", "batch")}
    # 3 s old: stale for chat (the default 1 s), so Envoy's own balancing picked; fresh for
    # batch, whose pods the filter picked.
    assert (after["chat"][0] - before["chat"][0], after["chat"][1] - before["chat"][1]) == (0, 5)
    assert (after["batch"][0] - before["batch"][0], after["batch"][1] - before["batch"][1]) == (5, 0)


def test_a_low_queue_threshold_keeps_adapter_requests_on_their_adapters_pod(envoy, pods):
    def pool_pods(pool, adapter):
        # Pod 0 runs the adapter with 3 requests queued; pod 1 is idle, its two slots taken by
        # other adapters (it would have to evict one to load this one).
        return [
            {"address": pods[f"{pool}-0"].address, "waiting": 3, "running": 2,
             "lora": {"max_loras": 2, "running": [adapter], "waiting": []}},
            {"address": pods[f"{pool}-1"].address,
             "lora": {"max_loras": 2, "running": ["x", "y"], "waiting": []}},
        ]

    snap = snapshot({"lora": pool_pods("lora", "sql-lora"), "strict": pool_pods("strict", "sql-strict")})
    assert envoy.push(snap)[0] == 204

    def served(model, n=4):
        return {envoy.chat(model)[1]["x-served-by"] for _ in range(n)}

    # At a threshold of 1, pod 0 is saturated for the base model, which goes to pod 1 ...
    assert served("lora-model") == {"lora-1"}
    # ... but not for its adapter's requests (lora_queue_threshold 5): no load on pod 1.
    assert served("sql-lora") == {"lora-0"}
    # In `strict` the adapter's own threshold is 2: pod 0 is saturated for its requests too.
    assert served("strict-model") == {"strict-1"}
    assert served("sql-strict") == {"strict-1"}
    debug = envoy.chat("sql-strict")[1]["x-gateway-debug"]
    assert debug.endswith(f"left-out={pods['strict-0'].address} saturated"), debug
