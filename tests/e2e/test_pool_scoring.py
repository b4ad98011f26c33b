"""Per-pool scoring (`pools[].scoring`), end to end in a real Envoy with the built filter: two
pools on the same snapshot, one that takes older metrics than the other."""

import pytest

from harness import STAT_PREFIX, Envoy, now_ms, snapshot
from stubpod import serving

CONFIG = {
    "pools": [
        {"name": "chat", "models": ["chat-model"]},
        # Its pods' metrics come slower: up to 10 s old still count.
        {"name": "batch", "models": ["batch-model"], "scoring": {"stale_after_ms": 10000, "preset": "throughput"}},
    ],
}


@pytest.fixture(scope="module")
def pods():
    with serving(["chat-0", "chat-1", "batch-0", "batch-1"]) as pods:
        yield pods


@pytest.fixture(scope="module")
def envoy(pods):
    pools = [{"name": pool, "endpoints": [pods[f"{pool}-{i}"].address for i in range(2)]} for pool in ("chat", "batch")]
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
