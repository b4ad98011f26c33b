"""Weighted traffic splits (`splits`), end to end in a real Envoy with the built filter: a public
model name divided between versions in different pools, the body rewritten to the version each
conversation took, every turn of a conversation on the same version, and a counter per target."""

import json

import pytest

from harness import STAT_PREFIX, Envoy, Pusher, snapshot
from stubpod import pools_by, serving

CONFIG = {
    "pools": [
        {"name": "stable", "models": ["chat-v1"], "adapters": ["sql-v1", "sql-v2"]},
        {"name": "canary", "models": ["chat-v2"]},
    ],
    "splits": {
        "chat": [{"model": "chat-v1", "weight": 3}, {"model": "chat-v2", "weight": 1}],
        # A drained version (weight 0) gets nothing new.
        "sql": [{"model": "sql-v1", "weight": 1}, {"model": "sql-v2", "weight": 0}],
    },
    "debug_header": True,
}
POD_POOL = {"stable-0": "stable", "stable-1": "stable", "canary-0": "canary"}
POOL_MODEL = {"stable": "chat-v1", "canary": "chat-v2"}


@pytest.fixture(scope="module")
def pods():
    with serving(POD_POOL) as pods:
        yield pods


@pytest.fixture(scope="module")
def envoy(pods):
    pools = pools_by(pods, POD_POOL, ["stable", "canary"])
    e = Envoy("filter", pools, CONFIG)
    push(e, pods)
    yield e
    e.stop()


def conversation(i, turns):
    """Turn `turns` of conversation `i`: its messages so far."""
    messages = [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": f"Question number {i}: what is {i} squared?"},
    ]
    for t in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"It is {i * i}. (turn {t})"},
            {"role": "user", "content": f"And plus {t}?"},
        ]
    return messages


def send(envoy, model, messages, path="/v1/chat/completions", extra=None):
    """(pod name, what the pod received) for one request; asserts it was served."""
    body = {"model": model, "messages": messages, **(extra or {})}
    s, h, echo, raw = envoy.request("POST", path, body)
    assert s == 200, (s, raw[:300])
    return h["x-served-by"], echo


def counter(envoy, split, target):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.split.{split}.to.{target}")


def rerouted(envoy, split):
    return envoy.stat(f"{STAT_PREFIX}gpuroute.split.{split}.rerouted")


def push(envoy, pods, canary_healthy=True):
    snap = snapshot({
        "stable": [{"address": p.address} for n, p in pods.items() if POD_POOL[n] == "stable"],
        "canary": [{"address": pods["canary-0"].address, "healthy": canary_healthy}],
    })
    assert envoy.push(snap)[0] == 204


def test_a_split_divides_conversations_by_weight_and_rewrites_the_model(envoy, pods):
    before = {t: counter(envoy, "chat", t) for t in ("chat-v1", "chat-v2")}
    took = {}
    n = 160
    for i in range(n):
        pod, echo = send(envoy, "chat", conversation(i, 1))
        sent = json.loads(echo["body"])
        pool = POD_POOL[pod]
        # The pod got the version of its own pool, in a body whose length matches its header;
        # Envoy's route followed the version (model header), and nothing else changed.
        assert sent["model"] == POOL_MODEL[pool]
        assert echo["headers"]["x-gateway-model-name"] == sent["model"]
        assert int(echo["headers"]["content-length"]) == len(echo["body"].encode())
        assert sent["messages"] == conversation(i, 1)
        took[i] = sent["model"]
    v2 = sum(1 for m in took.values() if m == "chat-v2")
    # Weights 3 : 1 over 160 conversations: 40 expected on chat-v2, a standard deviation of
    # ~5.5; both a split sending everything one way and one ignoring the weights fail this.
    assert 20 <= v2 <= 60, took
    # One counter per target, counting exactly what the pods saw.
    after = {t: counter(envoy, "chat", t) for t in ("chat-v1", "chat-v2")}
    assert (after["chat-v1"] - before["chat-v1"], after["chat-v2"] - before["chat-v2"]) == (n - v2, v2)

    # Every later turn of a conversation stays on its version (and so on its KV cache), on
    # the Messages API too.
    for i in range(0, n, 4):
        for turns in (2, 4):
            pod, _ = send(envoy, "chat", conversation(i, turns))
            assert POOL_MODEL[POD_POOL[pod]] == took[i], (i, turns)
        system, *rest = conversation(i, 3)
        pod, echo = send(envoy, "chat", rest, path="/v1/messages",
                         extra={"system": system["content"], "max_tokens": 16})
        assert json.loads(echo["body"])["model"] == took[i]


def test_a_responses_turn_continuing_a_stored_response_keeps_its_version(envoy, pods):
    """Responses API through a split: a turn that continues a stored response
    (`previous_response_id`) goes to the version, and the pod, whose answer carried the id. The
    split keys a conversation by its first user message, which such a turn does not repeat (the
    pod holds the history): each turn was keyed by its own new input, and with weights 3 : 1
    about a third of them took the other version's pool, where vLLM answers 404."""
    pusher = Pusher([envoy], {
        "stable": [{"address": p.address} for n, p in pods.items() if POD_POOL[n] == "stable"],
        "canary": [{"address": pods["canary-0"].address}]})
    try:
        turns, followed = continue_responses(envoy)
    finally:
        pusher.stop()
    # The turns whose own key named the other version: about a third (24 of 72 expected).
    print(f"\n{followed} of {turns} turns took their response's version over their own key's")
    assert followed >= 8, followed


def continue_responses(envoy):
    """24 Responses conversations of 4 turns through the split, each turn continuing the one
    before: (turns that continued one, those whose own key named another version)."""
    turns = followed = 0
    for i in range(24):
        s, h, answer, _ = envoy.request("POST", "/v1/responses", {
            "model": "chat", "instructions": "You answer in one sentence.", "input": f"Remember {i}."})
        assert s == 200 and answer["id"].startswith("resp_"), (s, answer)
        held = h["x-served-by"]
        for t in range(3):
            turn = {"model": "chat", "previous_response_id": answer["id"], "input": f"What was it? ({t})"}
            s, h, answer, raw = envoy.request("POST", "/v1/responses", turn)
            assert s == 200, (s, raw[:300])
            assert h["x-served-by"] == held, (i, t, h["x-gateway-debug"])
            assert json.loads(answer["body"])["model"] == POOL_MODEL[POD_POOL[held]]
            turns += 1
            followed += "(response);" in h["x-gateway-debug"]
    return turns, followed


def test_every_worker_and_replica_gives_a_conversation_the_same_version(envoy, pods):
    """No shared state: a second gateway replica with two workers takes each conversation to
    the version the first one did."""
    pools = pools_by(pods, POD_POOL, ["stable", "canary"])
    other = Envoy("filter", pools, CONFIG, concurrency=2)
    try:
        push(envoy, pods)
        push(other, pods)
        for i in range(40):
            versions = set()
            for gw in (envoy, other, other):
                _, echo = send(gw, "chat", conversation(500 + i, 2))
                versions.add(json.loads(echo["body"])["model"])
            assert len(versions) == 1, (i, versions)
        # Both workers of the second replica served (each connection lands on one of them).
        served = [v for v in other.worker_connections().values() if v]
        assert len(served) == 2, other.worker_connections()
    finally:
        other.stop()


def test_a_version_whose_pool_cannot_serve_passes_its_conversations_to_the_others(envoy, pods):
    """A canary whose pods are all unhealthy (or their metrics stale) would only fail: its
    conversations go to the versions that can serve, by weight, and come back once it can."""
    push(envoy, pods)
    own = {i: json.loads(send(envoy, "chat", conversation(i, 1))[1]["body"])["model"] for i in range(60)}
    on_canary = [i for i, m in own.items() if m == "chat-v2"]
    assert on_canary, own
    before = rerouted(envoy, "chat")
    for i in own:
        # Pushed before each request, as sidecar-metrics would every 100 ms: metrics older
        # than stale_after_ms (1 s) say nothing against any pool, and nothing is moved then.
        push(envoy, pods, canary_healthy=False)
        pod, echo = send(envoy, "chat", conversation(i, 2))
        assert POD_POOL[pod] == "stable" and json.loads(echo["body"])["model"] == "chat-v1", i
    assert rerouted(envoy, "chat") - before == len(on_canary)
    # The debug header names the version taken, and that it was moved.
    push(envoy, pods, canary_healthy=False)
    s, h, _, _ = envoy.request("POST", "/v1/chat/completions", {"model": "chat", "messages": conversation(on_canary[0], 2)})
    assert s == 200 and h["x-gateway-debug"].startswith("split=chat->chat-v1 (rerouted); pool=stable"), h
    for i in on_canary:
        push(envoy, pods)
        pod, _ = send(envoy, "chat", conversation(i, 3))
        assert POD_POOL[pod] == "canary", i
    assert rerouted(envoy, "chat") - before == len(on_canary) + 1
    s, h, _, _ = envoy.request("POST", "/v1/chat/completions", {"model": "chat", "messages": conversation(on_canary[0], 4)})
    assert s == 200 and h["x-gateway-debug"].startswith("split=chat->chat-v2; pool=canary"), h


def test_a_split_key_header_keys_the_split_instead_of_the_conversation(envoy, pods):
    """`x-gateway-split-key` (a user, a tenant): every conversation with one key gets one
    version, and keys spread over the versions by weight."""
    push(envoy, pods)
    by_key = {}
    for user in range(40):
        for i in range(3):
            body = {"model": "chat", "messages": conversation(1000 + user * 3 + i, 1)}
            s, h, echo, _ = envoy.request("POST", "/v1/chat/completions", body, {"x-gateway-split-key": f"user-{user}"})
            assert s == 200
            model = json.loads(echo["body"])["model"]
            assert by_key.setdefault(user, model) == model, (user, i)
            # Passed on to the pod as it came (it is not one of the filter's own headers).
            assert echo["headers"]["x-gateway-split-key"] == f"user-{user}"
    on_v2 = sum(1 for m in by_key.values() if m == "chat-v2")
    # Weights 3 : 1 over 40 keys: 10 expected, a standard deviation of ~2.7.
    assert 3 <= on_v2 <= 20, by_key


def test_a_drained_target_gets_nothing_and_adapters_keep_their_base(envoy, pods):
    for i in range(20):
        pod, echo = send(envoy, "sql", conversation(i, 1))
        assert POD_POOL[pod] == "stable"
        assert json.loads(echo["body"])["model"] == "sql-v1"
        assert echo["headers"]["x-gateway-model-name"] == "sql-v1"
        assert echo["headers"]["x-gateway-base-model-name"] == "chat-v1"
    assert counter(envoy, "sql", "sql-v2") == 0
    assert counter(envoy, "sql", "sql-v1") >= 20


def test_served_names_bypass_the_split_and_the_list_names_it(envoy, pods):
    # A client may still ask for a version by its own name: no rewrite, no split counter.
    before = counter(envoy, "chat", "chat-v2")
    pod, echo = send(envoy, "chat-v2", conversation(1, 1))
    assert POD_POOL[pod] == "canary" and json.loads(echo["body"])["model"] == "chat-v2"
    assert counter(envoy, "chat", "chat-v2") == before
    s, _, models, _ = envoy.request("GET", "/v1/models")
    assert s == 200
    ids = {m["id"]: m for m in models["data"]}
    assert {"chat", "sql", "chat-v1", "chat-v2", "sql-v1", "sql-v2"} == set(ids)
    assert ids["chat"]["root"] == "chat-v1"
    s, _, one, _ = envoy.request("GET", "/v1/models/sql")
    assert (s, one["id"], one["root"]) == (200, "sql", "chat-v1")
