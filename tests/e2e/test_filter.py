"""End-to-end tests of the filter in a real Envoy 1.40 (pip-installed) with the built .wasm,
against stub pods that say who served each request."""

import concurrent.futures
import contextlib
import http.client
import json
import re
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter

import pytest

from harness import (RUNTIME, STAT_PREFIX, TOKEN, TRAP_WASM, Envoy, LdsListener, Pusher, documented_stats, pod_picks_stat,
                     settle, snapshot, wait_for)
from stubpod import StubPod, serving

CONFIG = {
    "pools": [
        {
            "name": "llama",
            "models": ["llama-3-8b"],
            "aliases": {"llama": "llama-3-8b"},
            "adapters": ["sql-lora", "chat-lora"],
        },
        {"name": "qwen", "models": ["qwen-7b"]},
    ],
    "debug_header": True,
}


@pytest.fixture(scope="module")
def pods():
    with serving(["llama-0", "llama-1", "llama-2", "qwen-0"]) as pods:
        yield pods


def pools_of(pods):
    return [
        {"name": "llama", "endpoints": [pods[f"llama-{i}"].address for i in range(3)]},
        {"name": "qwen", "endpoints": [pods["qwen-0"].address]},
    ]


def trap_config(pods):
    """The filter's configuration plus the endpoints the trap build (the floor's) routes to: the
    first pool's, llama."""
    return dict(CONFIG, floor_endpoints=pools_of(pods)[0]["endpoints"])


@pytest.fixture(scope="module")
def envoy(pods):
    e = Envoy("filter", pools_of(pods), CONFIG)
    yield e
    e.stop()


def fresh(pods, llama=None, qwen=None):
    """A snapshot where every pod is idle unless overridden."""
    llama = llama or [{} for _ in range(3)]
    return snapshot(
        {
            "llama": [dict({"address": pods[f"llama-{i}"].address}, **llama[i]) for i in range(3)],
            "qwen": [dict({"address": pods["qwen-0"].address}, **(qwen or {}))],
        }
    )


def served_by(resp):
    return resp[1].get("x-served-by")


def test_routes_by_model_to_the_right_pool(envoy, pods):
    assert envoy.push(fresh(pods))[0] == 204
    for _ in range(5):
        assert served_by(envoy.chat("qwen-7b")) == "qwen-0"
        assert served_by(envoy.chat("llama-3-8b")).startswith("llama-")
    # What the pod received: routing headers set by the filter.
    s, _, body, _ = envoy.chat("qwen-7b")
    assert body["headers"]["x-gateway-pool"] == "qwen"
    assert body["headers"]["x-gateway-model-name"] == "qwen-7b"


def test_least_loaded_pod_wins_from_a_pushed_snapshot(envoy, pods):
    loads = [
        {"waiting": 3, "running": 40, "kv_cache_usage": 0.6},
        {"waiting": 0, "running": 2, "kv_cache_usage": 0.1},
        {"waiting": 2, "running": 30, "kv_cache_usage": 0.5},
    ]
    assert envoy.push(fresh(pods, loads))[0] == 204
    got = Counter(served_by(envoy.chat("llama-3-8b")) for _ in range(10))
    assert got == {"llama-1": 10}, got
    # The load moves: the routing follows the next snapshot.
    loads[0], loads[1] = loads[1], loads[0]
    assert envoy.push(fresh(pods, loads))[0] == 204
    got = Counter(served_by(envoy.chat("llama-3-8b")) for _ in range(10))
    assert got == {"llama-0": 10}, got


def test_finished_requests_leave_the_in_flight_count(envoy, pods):
    """A request counts against its pod while in flight and stops counting when it ends (the
    host deleting the request's context): sequential requests keep going to the idle pod. If
    finished requests stayed counted, the idle pod would look busier than the others after a
    few requests and the picks would spread."""
    loads = [{"running": 0}, {"running": 3}, {"running": 3}]
    assert envoy.push(fresh(pods, loads))[0] == 204
    # Distinct prompts, so prefix affinity plays no part; 12 requests stay well inside the
    # snapshot's 1 s freshness (a stale snapshot would fail open to Envoy's balancer).
    rs = [envoy.chat("llama-3-8b", f"question {i}: {'x' * i}") for i in range(12)]
    assert all(r[1]["x-gateway-debug"].startswith("pool=llama; picked=") for r in rs)
    got = Counter(served_by(r) for r in rs)
    assert got == {"llama-0": 12}, got


def test_requests_whose_client_went_away_leave_the_in_flight_count(pods):
    """A client that disconnects while its pod is still working (a timeout, a cancelled
    stream): Envoy resets the upstream stream and deletes the request's context, and the request
    stops counting against its pod. Eight requests are held in flight and abandoned; afterwards
    sequential requests go to the idle pod as if they had never been sent. Had they stayed
    counted, the pod that took most of them would look busiest and the picks would spread."""
    # One snapshot for the whole test, fresh throughout: a new snapshot re-bases the in-flight
    # counts (it reflects what was in flight when it was scraped) and would hide a leak.
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 30_000}))
    hold = threading.Event()
    try:
        assert e.push(fresh(pods, [{"running": 0}, {"running": 3}, {"running": 3}]))[0] == 204
        for i in range(3):
            pods[f"llama-{i}"].hold = hold
        before = sum(len(pods[f"llama-{i}"].requests) for i in range(3))
        host, port = e.listen.rsplit(":", 1)
        clients = []
        for i in range(8):
            body = json.dumps({"model": "llama-3-8b", "messages": [{"role": "user", "content": f"abandoned {i}"}]}).encode()
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            clients.append(c)
        deadline = time.time() + 10
        while sum(len(pods[f"llama-{i}"].requests) for i in range(3)) < before + 8 and time.time() < deadline:
            time.sleep(0.02)
        held = sum(len(pods[f"llama-{i}"].requests) for i in range(3)) - before
        assert held == 8, held
        for c in clients:
            c.close()
        time.sleep(0.3)  # Envoy sees the resets
        for i in range(3):
            pods[f"llama-{i}"].hold = None
        rs = [e.chat("llama-3-8b", f"after {i}: {'y' * i}") for i in range(12)]
        got = Counter(served_by(r) for r in rs)
        assert got == {"llama-0": 12}, got
    finally:
        hold.set()
        for i in range(3):
            pods[f"llama-{i}"].hold = None
        e.stop()


BIG_ASKS = {
    "chat-n16": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sample me"}], "n": 16}),
    "batch-8x2": ("/v1/completions", {"prompt": [f"p{i}" for i in range(8)], "n": 2}),
}
# Both prompts are shorter than a prefix block (64 characters): no prefix home pulls them to a
# pod, so where they go is the load's choice alone.


@pytest.mark.parametrize("big", sorted(BIG_ASKS))
def test_a_request_for_n_choices_counts_as_n_in_flight(pods, big):
    """vLLM's v1 engine runs each of a request's `n` choices, and each prompt of a completions
    batch, as a request of its own: one request for 16 choices (or 8 prompts with 2 choices
    each) is 16 sequences on its pod, as the pod's gauges will show at the next scrape. Counted
    as 16 until then, it steers the requests after it to the other pods, which report 4 running
    each; counted as one, it would leave its pod looking the least loaded."""
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 30_000}))
    hold = threading.Event()
    llama = [pods[f"llama-{i}"] for i in range(3)]
    clients = []
    try:
        assert e.push(fresh(pods, [{"running": 0}, {"running": 4}, {"running": 4}]))[0] == 204
        for p in llama:
            p.hold = hold
        before = [len(p.requests) for p in llama]
        host, port = e.listen.rsplit(":", 1)

        def send(path, ask):
            """A request held at its pod; returns once a pod has it."""
            body = json.dumps(dict(ask, model="llama-3-8b")).encode()
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
            clients.append(c)
            deadline = time.time() + 10
            while sum(len(p.requests) for p in llama) < sum(before) + len(clients) and time.time() < deadline:
                time.sleep(0.01)

        send(*BIG_ASKS[big])
        for i in range(6):
            send("/v1/chat/completions", {"messages": [{"role": "user", "content": f"question {i}"}]})
        got = {p.name: [r["path"] for r in p.requests[b:]] for p, b in zip(llama, before)}
        assert sum(len(v) for v in got.values()) == 7, got
        # The big request went to the idle pod, and nothing after it.
        assert got["llama-0"] == [BIG_ASKS[big][0]], got
    finally:
        hold.set()
        for p in llama:
            p.hold = None
        for c in clients:
            c.close()
        e.stop()


def test_an_odd_n_is_the_pods_to_answer(envoy, pods):
    """An `n` that is not a positive integer (or is huge) is not the gateway's to refuse: the
    request is routed, its body intact, and the pod answers it as it would (vLLM: a 400)."""
    assert envoy.push(fresh(pods))[0] == 204
    for n in [0, -1, "many", 2.5, 10**12, None, [2]]:
        ask = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "n": n}
        s, h, body, _ = envoy.request("POST", "/v1/chat/completions", ask)
        assert s == 200 and body["pod"].startswith("llama-"), (n, s, body)
        assert h["x-gateway-debug"].startswith("pool=llama; picked="), (n, h.get("x-gateway-debug"))
        assert json.loads(body["body"]) == ask


def test_stats_count_outcomes_per_pool_and_picks_per_pod(envoy, pods):
    """The filter's Envoy stats: picks per pool and per pod (batched in the worker, handed to
    Envoy on the tick), rejections by code, and the decision-time histogram. The per-pod counts
    must match who actually served the requests."""
    stats = envoy.stats

    def pod_stat(name):
        return pod_picks_stat("llama", pods[name].address)

    def counts():
        return {k: v for k, v in stats().items() if ".picks." in k or ".requests." in k or ".rejected." in k}

    # Counts of the tests before this one that the filter still batches (the dynamic module
    # hands its counters to Envoy every tick) must land before the baseline, not inside it.
    before, deadline = counts(), time.time() + 3
    while time.time() < deadline:
        time.sleep(0.1)
        now = counts()
        if now == before:
            break
        before = now
    before = stats()
    assert envoy.push(fresh(pods))[0] == 204
    served = Counter(served_by(envoy.chat("llama-3-8b", f"stats {i}")) for i in range(20))
    for _ in range(5):
        assert served_by(envoy.chat("qwen-7b")) == "qwen-0"
    assert envoy.request("POST", "/v1/chat/completions", b"{not json")[0] == 400
    want = {
        STAT_PREFIX + "gpuroute.pool.llama.requests.picked": 20,
        STAT_PREFIX + "gpuroute.pool.qwen.requests.picked": 5,
        STAT_PREFIX + "gpuroute.rejected.invalid_json": 1,
        **{pod_stat(name): n for name, n in served.items()},
    }
    deadline = time.time() + 3
    while True:
        now = stats()
        got = {k: now.get(k, 0) - before.get(k, 0) for k in want}
        if got == want or time.time() > deadline:
            break
        time.sleep(0.05)
    assert got == want
    # Envoy publishes histogram values on its stats flush (every 5 s by default).
    deadline = time.time() + 7
    while "P50" not in str(stats().get(STAT_PREFIX + "gpuroute.decision_us", "")) and time.time() < deadline:
        time.sleep(0.2)
    assert "P50" in str(stats().get(STAT_PREFIX + "gpuroute.decision_us")), stats().get(STAT_PREFIX + "gpuroute.decision_us")


def test_pods_past_max_pod_stats_share_the_other_counter(pods):
    """Envoy never removes a stat, so per-pod pick counters are bounded (`max_pod_stats`): the
    first pods picked get their own, in every pool together; the picks of any pod after them
    are counted as pod `other` of its pool, and nothing is lost. Prometheus sees `other` as the
    endpoint label."""
    e = Envoy("filter", pools_of(pods), dict(CONFIG, max_pod_stats=2))
    try:
        def picks():
            return {k: v for k, v in e.stats().items() if k.endswith(".picks") or ".gpuroute_endpoint." in k}

        saturated = {"waiting": 9, "kv_cache_usage": 0.9}
        expected = Counter()
        for i in range(3):  # llama-0, then llama-1, then llama-2 the only pod with room
            load = [{} if j == i else saturated for j in range(3)]
            assert e.push(fresh(pods, load))[0] == 204
            for n in range(3):
                assert served_by(e.chat("llama-3-8b", f"series {i} {n}")) == f"llama-{i}"
            expected[pod_picks_stat("llama", pods[f"llama-{i}"].address if i < 2 else "other")] += 3
            # Each pod's first picks land before the next pod's: which pods got a counter of
            # their own is then the order they were picked in, in both builds.
            settle(lambda: picks() == expected)
            assert picks() == expected
        for n in range(2):
            assert served_by(e.chat("qwen-7b", f"series q {n}")) == "qwen-0"
        expected[pod_picks_stat("qwen", "other")] += 2
        settle(lambda: picks() == expected)
        assert picks() == expected
        assert e.stats()[STAT_PREFIX + "gpuroute.pool.llama.requests.picked"] == 9
        with urllib.request.urlopen(f"http://{e.admin}/stats/prometheus", timeout=5) as r:
            lines = [ln for ln in r.read().decode().splitlines() if "gpuroute_pool_picks{" in ln]
        endpoints = sorted(ln.split('gpuroute_endpoint="')[1].split('"')[0] for ln in lines)
        assert endpoints == sorted([pods["llama-0"].address, pods["llama-1"].address, "other", "other"]), lines
    finally:
        e.stop()


@pytest.mark.skipif(RUNTIME != "wasm", reason="the proxy-wasm build's set is in shared data; the module's in its process")
def test_max_pod_stats_holds_across_workers_and_configuration_changes(pods, tmp_path):
    """The bound is the Envoy's, not a worker's or a configuration's: two workers, and a change
    of the filter's configuration (new plugin instances) between the second pod and the third.
    The third pod is still past the limit; the first keeps its counter in the new instances."""
    lds = LdsListener(tmp_path / "lds")
    e = Envoy("filter", pools_of(pods), dict(CONFIG, max_pod_stats=2), concurrency=2, workdir=tmp_path / "envoy",
              patch=lds.patch, envoy_args=lds.envoy_args)
    try:
        saturated = {"waiting": 9, "kv_cache_usage": 0.9}
        expected = Counter()

        def only_room_on(i, key):
            assert e.push(fresh(pods, [{} if j == i else saturated for j in range(3)]))[0] == 204
            for n in range(8):  # fresh connections: the kernel spreads them over both workers
                assert served_by(e.chat("llama-3-8b", f"bound {i} {n}")) == f"llama-{i}"
            expected[pod_picks_stat("llama", key)] += 8
            settle(lambda: picks() == expected)
            assert picks() == expected

        def picks():
            return {k: v for k, v in e.stats().items() if k.endswith(".picks")}

        only_room_on(0, pods["llama-0"].address)
        only_room_on(1, pods["llama-1"].address)
        lds.change(e, timeout_s=10, tick_ms=21)
        only_room_on(2, "other")
        only_room_on(0, pods["llama-0"].address)
        assert e.alive()
    finally:
        e.stop()


def test_max_pod_stats_0_counts_no_pick_by_pod(pods):
    """`max_pod_stats: 0`: picks are counted per pool only; no pod has a counter, nor `other`."""
    e = Envoy("filter", pools_of(pods), dict(CONFIG, max_pod_stats=0))
    try:
        assert e.push(fresh(pods))[0] == 204
        for n in range(6):
            assert served_by(e.chat("llama-3-8b", f"no pod stats {n}")).startswith("llama-")
        assert served_by(e.chat("qwen-7b")) == "qwen-0"
        settle(lambda: e.stats().get(STAT_PREFIX + "gpuroute.pool.llama.requests.picked") == 6)
        stats = e.stats()
        assert stats[STAT_PREFIX + "gpuroute.pool.llama.requests.picked"] == 6, stats
        assert [k for k in stats if k.endswith(".picks") or ".gpuroute_endpoint." in k] == [], stats
    finally:
        e.stop()


def test_every_stat_the_filter_shows_is_documented(envoy, pods):
    """After requests that reach most outcomes (picks in two pools, refusals, a fail-open, a
    rejected and an accepted snapshot), every `gpuroute` stat Envoy shows is one the README
    names. The dynamic module defines its metrics when its configuration loads, so there this
    covers names no request reached too."""
    patterns = documented_stats()
    assert len(patterns) >= 15, patterns
    assert envoy.push(fresh(pods))[0] == 204
    for i in range(10):
        assert envoy.chat("llama-3-8b", f"documented {i}")[0] == 200
    assert envoy.chat("qwen-7b")[0] == 200
    assert envoy.chat("sql-lora")[0] == 200
    assert envoy.request("POST", "/v1/chat/completions", b"{not json")[0] == 400
    assert envoy.chat("no-such-model")[0] == 404
    assert envoy.push({"version": 1})[0] == 400
    stale_qwen = fresh(pods)
    stale_qwen["pools"][1]["pods"][0]["last_scrape_ms"] = stale_qwen["generated_at_ms"] - 60_000
    assert envoy.push(stale_qwen)[0] == 204
    assert envoy.chat("qwen-7b")[0] == 200  # no fresh pod: a fail-open
    assert envoy.request("GET", "/v1/models")[0] == 200
    time.sleep(0.2)  # the batched counts reach Envoy within tick_ms
    shown = sorted({name.removeprefix(STAT_PREFIX) for name in envoy.stats() if name.startswith(STAT_PREFIX)})
    assert len(shown) >= 10, shown
    undocumented = [n for n in shown if not any(p.fullmatch(n) for p in patterns)]
    assert not undocumented, f"stats the README does not name: {undocumented}"
    for must in ("gpuroute.fail_open.no_fresh_pod", "gpuroute.rejected.model_not_found", "gpuroute.models_list"):
        assert must in shown, shown


def test_destination_header_lists_fallbacks_and_debug_explains(envoy, pods):
    assert envoy.push(fresh(pods))[0] == 204
    s, h, body, _ = envoy.chat("llama-3-8b")
    dest = body["headers"]["x-gateway-destination-endpoint"].split(",")
    assert len(dest) == 3 and len(set(dest)) == 3
    assert dest[0] == pods[h["x-served-by"]].address
    assert h["x-gateway-debug"].startswith("pool=llama; picked=" + dest[0])
    assert "queue=" in h["x-gateway-debug"] and "kv=" in h["x-gateway-debug"]
    assert "left-out=" not in h["x-gateway-debug"]


def test_debug_header_names_the_pods_left_out_and_why(envoy, pods):
    addr = [pods[f"llama-{i}"].address for i in range(3)]
    assert envoy.push(fresh(pods, [{"healthy": False}, {"kv_cache_usage": 0.99}, {}]))[0] == 204
    s, h, _, _ = envoy.chat("llama-3-8b")
    assert s == 200 and served_by((s, h)) == "llama-2"
    debug = h["x-gateway-debug"]
    assert debug.startswith(f"pool=llama; picked={addr[2]}; {addr[2]} total="), debug
    assert debug.endswith(f"; left-out={addr[0]} unhealthy,{addr[1]} saturated"), debug


def test_debug_header_of_a_large_pool_is_capped(envoy, pods):
    # 600 pods the snapshot says are stale besides the three real ones: the whole left-out list
    # would be ~17 KB; the header stays within 8 KiB and counts what it leaves out.
    snap = fresh(pods)
    ts = snap["generated_at_ms"]
    llama = next(p for p in snap["pools"] if p["name"] == "llama")
    llama["pods"] += [dict(llama["pods"][0], address=f"10.9.{i // 200}.{i % 200}:8000", last_scrape_ms=ts - 60_000)
                      for i in range(600)]
    assert envoy.push(snap)[0] == 204
    s, h, _, _ = envoy.chat("llama-3-8b")
    assert s == 200 and h["x-served-by"].startswith("llama-")
    debug = h["x-gateway-debug"]
    assert len(debug) <= 8192, len(debug)
    assert debug.count(" total=") == 3, debug[:400]
    listed = debug.count(" stale")
    assert 200 <= listed < 600 and debug.endswith(f"; omitted=0 scored,{600 - listed} left-out"), debug[-200:]


def test_lora_affinity(envoy, pods):
    loras = [
        {"lora": {"max_loras": 2, "running": ["chat-lora", "x"], "waiting": []}, "running": 3},
        {"lora": {"max_loras": 2, "running": ["sql-lora", "y"], "waiting": []}, "running": 9, "kv_cache_usage": 0.4},
        {"lora": {"max_loras": 2, "running": ["a", "b"], "waiting": []}, "running": 1},
    ]
    assert envoy.push(fresh(pods, loras))[0] == 204
    # The resident pod wins although it is busier: the others would have to evict an adapter.
    got = Counter(served_by(envoy.chat("sql-lora")) for _ in range(6))
    assert got == {"llama-1": 6}, got
    # The debug header says why the idler pods were not considered.
    debug = envoy.chat("sql-lora")[1]["x-gateway-debug"]
    others = ",".join(f"{pods[f'llama-{i}'].address} adapter-elsewhere" for i in (0, 2))
    assert debug.endswith("; left-out=" + others), debug
    # An adapter nobody has goes to a pod with a free slot.
    loras[2]["lora"]["running"] = ["a"]
    assert envoy.push(fresh(pods, loras))[0] == 204
    assert Counter(served_by(envoy.chat("chat-lora")) for _ in range(4)) == {"llama-0": 4}
    loras[0]["lora"]["running"] = ["x", "z"]
    assert envoy.push(fresh(pods, loras))[0] == 204
    assert Counter(served_by(envoy.chat("chat-lora")) for _ in range(4)) == {"llama-2": 4}
    s, _, body, _ = envoy.chat("sql-lora")
    assert body["headers"]["x-gateway-base-model-name"] == "llama-3-8b"
    assert json.loads(body["body"])["model"] == "sql-lora"


def test_alias_is_rewritten_for_the_pod(envoy, pods):
    assert envoy.push(fresh(pods))[0] == 204
    s, _, body, _ = envoy.chat("llama", "alias me")
    assert s == 200
    sent = json.loads(body["body"])
    assert sent["model"] == "llama-3-8b"
    assert sent["messages"][0]["content"] == "alias me"
    assert int(body["headers"]["content-length"]) == len(body["body"].encode())


@pytest.mark.parametrize("shape", ["model first", "model last", "byte-order mark, model first"])
def test_alias_is_rewritten_whatever_comes_before_it(envoy, pods, shape):
    """The proxy-wasm filter hands Envoy only the bytes up to the model's value (Envoy drains
    them and puts the new ones before the rest): with `model` first (curl, OpenAI's Node SDK)
    a few bytes, with `model` after `messages` (OpenAI's Python SDK) nearly all of them. Either
    way the pod gets the whole body with the model rewritten, a byte-order mark left out, and a
    content-length that matches."""
    assert envoy.push(fresh(pods))[0] == 204
    messages = [{"role": "user", "content": "rewrite me \u00e9 " * 40}]
    doc = {"messages": messages, "model": "llama"} if shape == "model last" else {"model": "llama", "messages": messages}
    raw = json.dumps(doc).encode()
    if shape.startswith("byte-order mark"):
        raw = b"\xef\xbb\xbf" + raw
    s, _, answer, _ = envoy.request("POST", "/v1/chat/completions", raw)
    assert s == 200, answer
    got = answer["body"].encode()
    assert got == json.dumps(dict(doc, model="llama-3-8b")).encode(), got[:200]
    assert int(answer["headers"]["content-length"]) == len(got)


def test_large_body_arriving_in_many_reads_is_routed_and_rewritten_whole(envoy, pods):
    """A 600 KB body reaches the filter over many socket reads (Envoy buffers it in several
    slices): the filter reads all of it, and an alias rewrite replaces all of it."""
    assert envoy.push(fresh(pods))[0] == 204
    text = "".join(f"line {i} of a long document. " for i in range(24_000))
    body = {"model": "llama", "messages": [{"role": "user", "content": text}]}
    s, _, answer, _ = envoy.request("POST", "/v1/chat/completions", body)
    assert s == 200, answer
    sent = json.loads(answer["body"])
    assert sent["model"] == "llama-3-8b"
    assert sent["messages"][0]["content"] == text
    assert int(answer["headers"]["content-length"]) == len(answer["body"].encode())
    # Without a rewrite the body passes byte for byte.
    raw = json.dumps(dict(body, model="llama-3-8b")).encode()
    s, _, answer, _ = envoy.request("POST", "/v1/chat/completions", raw)
    assert s == 200 and answer["body"].encode() == raw


def raw_http1(addr, head, parts, expect_continue=False):
    """Sends one HTTP/1.1 request as given (`head`, then each of `parts` in its own write) and
    returns (status, headers, body) of the answer; with `expect_continue`, the body goes only
    after Envoy's interim `100 Continue`, as curl sends a body over 1 KB."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        got = b""
        if expect_continue:
            while b"\r\n\r\n" not in got:
                got += sock.recv(65536)
            interim, _, got = got.partition(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100"), interim
        for p in parts:
            sock.sendall(p)
            time.sleep(0.01)
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        head_bytes, _, body = got.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(body) < int(headers.get("content-length", 0)):
            body += sock.recv(65536)
        return int(lines[0].split()[1]), headers, body


def test_chunked_uploads_and_expect_continue_are_routed_whole(envoy, pods):
    """What curl and streaming clients send: a body in chunks (with a trailer section, which
    Envoy's HTTP/1 codec drops), and `Expect: 100-continue` before a body over 1 KB."""
    assert envoy.push(fresh(pods))[0] == 204
    text = "a chunked upload " * 300
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": text}]}).encode()
    pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)]
    chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    for end in (b"0\r\n\r\n", b"0\r\nx-client-trailer: 1\r\n\r\n"):
        status, headers, answer = raw_http1(envoy.listen, head, [*chunks, end])
        assert status == 200 and headers["x-served-by"].startswith("llama-"), (status, answer[:300])
        sent = json.loads(json.loads(answer)["body"])
        assert sent["model"] == "llama-3-8b" and sent["messages"][0]["content"] == text
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
    status, headers, answer = raw_http1(envoy.listen, head, pieces, expect_continue=True)
    assert status == 200 and headers["x-served-by"].startswith("llama-"), (status, answer[:300])
    assert json.loads(json.loads(answer)["body"])["model"] == "llama-3-8b"


def test_a_turn_continuing_a_stored_response_goes_to_the_pod_that_holds_it(pods):
    """Responses API: a turn that sends `previous_response_id` goes to the pod whose answer
    carried that id (a server that stores responses in memory, as vLLM with its store enabled,
    has it nowhere else), however loaded that pod is, from either of Envoy's two workers; other
    turns go by load as before. So do the response's own calls (retrieve, delete, cancel). The
    stub pods send a Responses answer's first bytes apart, so the id is read across chunks."""
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=2)
    try:
        assert e.push(fresh(pods))[0] == 204
        s, h, first, _ = e.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "remember 42"})
        assert s == 200 and first["id"].startswith("resp_"), first
        held = h["x-served-by"]
        # The pod that holds the response becomes the busiest; the others are idle.
        busy = [{"waiting": 4 if f"llama-{i}" == held else 0} for i in range(3)]
        assert e.push(fresh(pods, busy))[0] == 204
        # No wait: the worker that served the answer wrote the id's shared slot before the
        # client had it, so the other worker finds it at once (its records come on the tick).
        turn = {"model": "llama-3-8b", "previous_response_id": first["id"], "input": "what was it?"}
        served = [e.request("POST", "/v1/responses", turn)[1] for _ in range(8)]
        assert all(s["x-served-by"] == held for s in served), (held, [s["x-served-by"] for s in served])
        assert all(s["x-gateway-debug"].startswith("previous-response; pool=llama") for s in served)
        # An id the gateway never saw, and a turn without one, go by load.
        for other in ({**turn, "previous_response_id": "resp_unknown"}, {"model": "llama-3-8b", "input": "hi"}):
            assert e.request("POST", "/v1/responses", other)[1]["x-served-by"] != held
        # The response's own calls carry no model: the id takes them to the pod that holds it.
        rid = first["id"]
        for method, path in [("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items?limit=5"),
                             ("DELETE", f"/v1/responses/{rid}"), ("POST", f"/v1/responses/{rid}/cancel")] * 2:
            s, h, body, _ = e.request(method, path)
            assert (s, h.get("x-served-by"), body["path"]) == (200, held, path), (method, path, s, body)
        # An unknown id keeps the route table's answer.
        s, _, body, _ = e.request("GET", "/v1/responses/resp_unknown")
        assert (s, body["error"]["code"]) == (404, "not_found")
        # Counted: 11 answers' ids learned; 8 turns and 8 calls pinned; the unknown id's turn
        # and call not. The Envoy's two workers each count their own: the stats sum them.
        stat = lambda n: e.stat(STAT_PREFIX + f"gpuroute.responses.{n}")
        assert (stat("learned"), stat("pinned"), stat("unpinned")) == (11, 16, 2)
    finally:
        e.stop()


def test_a_stored_response_is_learned_for_the_pod_that_answered_it(tmp_path):
    """The id of a Responses answer belongs to the pod that stored it, which is not always the
    pod the filter picked: Envoy retries a refused connection on the next endpoint, and with no
    snapshot yet it picks the pod itself. Before, the id was learned for the pick (the turns
    continuing a retried answer went to the pod that never saw it: vLLM's 404 "response not
    found"), and not at all when the filter failed open (an audit)."""
    a, b = StubPod("answer-a"), StubPod("answer-b")
    port_a = int(a.address.rsplit(":", 1)[1])
    e = Envoy("filter", [{"name": "llama", "endpoints": [a.address, b.address]}],
              {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True,
               "scoring": {"stale_after_ms": 60_000}}, workdir=tmp_path / "envoy")

    def snap(busy):
        return snapshot({"llama": [{"address": p.address, "waiting": 4 if p is busy else 0} for p in (a, b)]})

    def continued(rid):
        turn = {"model": "llama-3-8b", "previous_response_id": rid, "input": "what was it?"}
        return [e.request("POST", "/v1/responses", turn)[1]["x-served-by"] for _ in range(4)]

    try:
        # No snapshot: Envoy's balancer picks; the id is learned for the pod that answered.
        s, h, first, _ = e.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "one"})
        assert s == 200 and e.stat(STAT_PREFIX + "gpuroute.fail_open.no_snapshot") == 1
        holder = h["x-served-by"]
        assert e.push(snap(busy=a if holder == a.name else b))[0] == 204
        assert continued(first["id"]) == [holder] * 4
        # The pick refuses connections: Envoy retries on the next endpoint, which answers.
        a.close()
        assert e.push(snap(busy=b))[0] == 204
        s, h, second, _ = e.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "two"})
        assert (s, h["x-served-by"]) == (200, b.name) and "picked=" + a.address in h["x-gateway-debug"]
        # The pick is back, and still the idler one: the turns go to the pod holding the answer.
        a = StubPod("answer-a", port=port_a)
        assert e.push(snap(busy=b))[0] == 204
        assert continued(second["id"]) == [b.name] * 4
    finally:
        e.stop()
        a.close()
        b.close()


def test_every_worker_takes_each_new_snapshot_and_reads_it_in_binary(pods):
    """The worker that takes a push stores the snapshot as JSON and in a binary form, which the
    other workers decode in a fraction of the JSON's time (README, "A new snapshot"). Each push
    here moves the one idle pod; requests on new connections, which the kernel spreads over
    Envoy's two workers, all go to it, so both workers took every snapshot; and (proxy-wasm) none
    read the JSON. The dynamic module keeps one engine for all workers: the routing part only."""
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=2)
    try:
        for n in range(6):
            idle = f"llama-{n % 3}"
            assert e.push(fresh(pods, [{"waiting": 0 if f"llama-{i}" == idle else 6} for i in range(3)]))[0] == 204
            got = [served_by(e.chat("llama-3-8b", text=f"push {n} request {r}")) for r in range(8)]
            assert got == [idle] * 8, (n, got)
        workers = e.worker_connections()
        assert len([c for c in workers.values() if c > 0]) == 2, workers
        assert e.stat(STAT_PREFIX + "gpuroute.snapshot.accepted") == 6
        if RUNTIME == "wasm":
            assert e.stat(STAT_PREFIX + "gpuroute.snapshot.read_json") == 0
    finally:
        e.stop()


def ttft_histogram(e, pool):
    """Pool `pool`'s time-to-first-byte histogram's count and sum, and the decision-time
    histogram's count (the requests sampled), as of Envoy's last stats flush (every 5 s by
    default), which publishes both at once; read in Prometheus's format, as deploy/monitoring
    reads them."""
    with urllib.request.urlopen(f"http://{e.admin}/stats/prometheus", timeout=5) as r:
        lines = r.read().decode().splitlines()
    got = {}
    for line in lines:
        for part in ("count", "sum"):
            if line.startswith(f"envoy_gpuroute_pool_ttft_ms_{part}{{") and f'gpuroute_pool="{pool}"' in line:
                got[part] = float(line.rsplit(" ", 1)[1])
        if line.startswith("envoy_gpuroute_decision_us_count{"):
            got["decisions"] = float(line.rsplit(" ", 1)[1])
    return got


def test_streamed_requests_time_to_first_byte_is_recorded_per_pool():
    """`gpuroute.pool.<pool>.ttft_ms`: a streamed request's time from its routing decision to
    the first byte of its answer (the pod's queue and prefill), for the requests whose decision
    time is sampled (proxy-wasm: the worker's first and, at random, one in 8 after it; the
    dynamic module: every one). Not for a buffered answer, whose first byte is its last. Checked
    in Prometheus's format, as deploy/monitoring reads it: the pool a label, the count and the
    sum."""
    slow = StubPod("slow-0", delay_s=0.15)
    # A pool whose one pod refuses connections: its streamed requests get Envoy's 503.
    gone = StubPod("gone-0")
    gone.close()
    # One push for the whole test, which takes longer than the default staleness (1 s).
    config = {"pools": [{"name": "slow", "models": ["m"]}, {"name": "gone", "models": ["g"]}],
              "scoring": {"stale_after_ms": 60_000}}
    e = Envoy("filter", [{"name": "slow", "endpoints": [slow.address]},
                         {"name": "gone", "endpoints": [gone.address]}], config)
    try:
        assert e.push(snapshot({"slow": [{"address": slow.address}], "gone": [{"address": gone.address}]}))[0] == 204
        streamed = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(16):
            assert e.request("POST", "/v1/chat/completions", streamed)[0] == 200

        def family():
            return ttft_histogram(e, "slow")

        def settled(ok):
            deadline = time.time() + 8
            while not ok(family()) and time.time() < deadline:
                time.sleep(0.2)
            return family()

        # Every request so far was streamed: each one whose decision was timed has its first
        # byte timed too (the module times all 16).
        want = 16 if RUNTIME == "dynamic" else None
        got = settled(lambda g: g.get("decisions", 0) >= 1 and g.get("count") == g["decisions"]
                      and want in (None, g["count"]))
        assert got.get("count", 0) >= 1 and got["count"] == got["decisions"] and want in (None, got["count"]), got
        mean_ms = got["sum"] / got["count"]
        assert 150 <= mean_ms < 1000, got
        # Buffered answers until some of their decisions were timed: no first byte is timed.
        for _ in range(8):
            for _ in range(8):
                assert e.chat("m")[0] == 200
            after = settled(lambda g: g["decisions"] > got["decisions"])
            if after["decisions"] > got["decisions"]:
                break
        assert after["decisions"] > got["decisions"] and after["count"] == got["count"], (got, after)
        # An error's first byte is no first token: 64 streamed requests to the pool whose pod
        # refuses connections (Envoy's 503; proxy-wasm times about 8 of them), none timed.
        # Before, each timed one was, at a few ms, pulling the histogram down when pods failed.
        for _ in range(64):
            assert e.request("POST", "/v1/chat/completions", dict(streamed, model="g"))[0] == 503
        final = settled(lambda g: g["decisions"] > after["decisions"])
        assert final["decisions"] > after["decisions"], (after, final)
        assert ttft_histogram(e, "gone").get("count", 0) == 0, ttft_histogram(e, "gone")
    finally:
        e.stop()
        slow.close()


def test_a_responses_streams_first_token_comes_after_its_preamble():
    """vLLM streams a Responses answer's `response.created` and `response.in_progress` events
    before the engine has produced anything: the first byte is not the first token, as it is
    for a chat stream. The request stays in prefill, and its time to first token runs, until the
    first event past them (here 1 s later). Before, both ended at the preamble (an audit: 3-6 ms
    timed for 1.5 s of prefill, and the gateway's counts showed the pod idle meanwhile)."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]

    def event(kind, data):
        return f"event: {kind}\ndata: {json.dumps(dict(data, type=kind))}\n\n".encode()

    def chunk(b):
        return b"%x\r\n%s\r\n" % (len(b), b)

    def serve():
        conn, _ = listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            response = {"id": "resp_pre_1", "object": "response", "text": {"format": {"type": "text"}}}
            conn.sendall(chunk(event("response.created", {"response": response})
                               + event("response.in_progress", {"response": response})))
            time.sleep(1.0)
            conn.sendall(chunk(event("response.output_text.delta", {"delta": "hi"}))
                         + chunk(event("response.completed", {"response": response})) + b"0\r\n\r\n")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    config = {"pools": [{"name": "r", "models": ["m"]}], "scoring": {"stale_after_ms": 60_000}}
    e = Envoy("filter", [{"name": "r", "endpoints": [address]}], config)
    try:
        assert e.push(snapshot({"r": [{"address": address}]}))[0] == 204
        # The worker's first request: its decision, and so its first token, is timed.
        s, _, _, raw = e.request("POST", "/v1/responses", {"model": "m", "input": "hi", "stream": True}, timeout=10)
        assert s == 200 and b"response.completed" in raw, raw[:200]

        deadline = time.time() + 8  # Envoy flushes its stats every 5 s
        while ttft_histogram(e, "r").get("count", 0) < 1 and time.time() < deadline:
            time.sleep(0.2)
        got = ttft_histogram(e, "r")
        assert got.get("count") == 1 and got["sum"] >= 900, got
    finally:
        e.stop()
        listener.close()


def test_fail_open_without_fresh_metrics(envoy, pods):
    before = envoy.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod")
    stale = fresh(pods)
    for pool in stale["pools"]:
        for p in pool["pods"]:
            p["last_scrape_ms"] = stale["generated_at_ms"] - 60_000
    assert envoy.push(stale)[0] == 204
    got = Counter(served_by(envoy.chat("llama-3-8b")) for _ in range(30))
    # Envoy's own least_request fallback spreads them; nobody is refused.
    assert sum(got.values()) == 30 and len(got) >= 2, got
    assert envoy.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod") - before == 30
    # The debug header says why nobody was picked.
    stale_pods = ",".join(f"{pods[f'llama-{i}'].address} stale" for i in range(3))
    assert envoy.chat("llama-3-8b")[1]["x-gateway-debug"] == "pool=llama; left-out=" + stale_pods


def test_fail_open_when_every_pod_is_unhealthy(envoy, pods):
    assert envoy.push(fresh(pods, [{"healthy": False}] * 3))[0] == 204
    s, h, _, _ = envoy.chat("llama-3-8b")
    assert s == 200 and h["x-served-by"].startswith("llama-")
    unhealthy = ",".join(f"{pods[f'llama-{i}'].address} unhealthy" for i in range(3))
    assert h["x-gateway-debug"] == "pool=llama; left-out=" + unhealthy


def test_snapshot_ages_out(pods):
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 300}))
    try:
        loads = [{"waiting": 4}, {"waiting": 0}, {"waiting": 4}]
        assert e.push(fresh(pods, loads))[0] == 204
        assert served_by(e.chat("llama-3-8b")) == "llama-1"
        time.sleep(0.5)
        before = e.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod")
        e.chat("llama-3-8b")
        assert e.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod") == before + 1
    finally:
        e.stop()


def test_a_turn_continuing_a_stored_response_reaches_its_pod_with_the_metrics_stale(pods):
    """The aggregator down: every pod's metrics past stale_after_ms, the gateway fails open
    (Envoy's balancer picks) and a turn continuing a stored response reached its pod by chance;
    vLLM answers 404 on the others (the build before: 3 of 3 pods served such turns). It now
    goes to its pod at the snapshot's last address; other requests fail open as before."""
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 300}))
    try:
        assert e.push(fresh(pods))[0] == 204
        s, h, first, _ = e.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "remember 42"})
        assert s == 200 and first["id"].startswith("resp_"), first
        held = h["x-served-by"]
        time.sleep(0.5)
        stat = lambda: e.stat(STAT_PREFIX + "gpuroute.fail_open.no_fresh_pod")
        before = stat()
        turn = {"model": "llama-3-8b", "previous_response_id": first["id"], "input": "what was it?"}
        served = []
        for _ in range(12):
            s, h, _, _ = e.request("POST", "/v1/responses", turn)
            assert s == 200
            served.append(h["x-served-by"])
        assert served == [held] * 12, served
        assert stat() == before
        # A new conversation fails open.
        e.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "hi"})
        assert stat() == before + 1
    finally:
        e.stop()


def test_a_runaway_version_is_replaced_once_its_snapshot_is_stale(pods):
    """A version from a clock that ran ahead does not lock the ingest: refused below it while
    any pool may still read its snapshot (qwen's 3 s here), replaced by any valid one after. The
    window is the routing configuration's, though the ingest listener's own has no pools (its
    default 1 s: before, an older version was taken after 1 s while routing still read the
    snapshot; an audit)."""
    config = dict(CONFIG, scoring={"stale_after_ms": 300})
    config["pools"] = [dict(p) for p in CONFIG["pools"]]
    config["pools"][1]["scoring"] = {"stale_after_ms": 3_000}
    e = Envoy("filter", pools_of(pods), config, envoy_args=("--file-flush-interval-msec", "100"))
    try:
        runaway = fresh(pods, [{"waiting": 4}, {"waiting": 0}, {"waiting": 4}])
        runaway["version"] = 2**64 - 1
        assert e.push(runaway)[0] == 204
        assert served_by(e.chat("llama-3-8b")) == "llama-1"
        later = fresh(pods, [{"waiting": 4}, {"waiting": 4}, {"waiting": 0}])
        later["version"] = 1
        s, _, body, _ = e.push(later)
        assert s == 400 and f"not newer than the current version {2**64 - 1}" in body["error"]["message"]
        time.sleep(1.5)  # past llama's 300 ms and the ingest listener's 1 s, not qwen's 3 s
        assert e.push(later)[0] == 400
        time.sleep(2.0)
        assert e.push(later)[0] == 204
        assert served_by(e.chat("llama-3-8b")) == "llama-2"
        # From there versions increase from the new one.
        assert e.push(later)[0] == 400
        later["version"] = 2
        assert e.push(later)[0] == 204
        deadline = time.time() + 5
        while "versions went back" not in e.log() and time.time() < deadline:
            time.sleep(0.1)
        assert "replaced the stale snapshot of version 18446744073709551615" in e.log()
    finally:
        e.stop()


@pytest.mark.parametrize("change, message", [
    # Two pools Envoy's stats would count as one.
    ({"pools": [{"name": "llama.8b", "models": ["m"]}, {"name": "llama_8b", "models": ["n"]}]},
     'pools[1].name: "llama_8b" and "llama.8b" have the same stat name'),
    # A pool name Envoy refuses in the x-gateway-pool header (its requests would all get 503).
    ({"pools": [{"name": "p\nx", "models": ["m"]}]}, 'pools[0].name: "p\\nx" has a control character'),
    # A models_path answering an inference path.
    ({"models_path": "/v1"}, 'models_path: "/v1/chat/completions" is "/v1" or under it'),
    # Adapter names the pods' metrics cannot carry: vLLM joins running adapters with commas,
    # and sidecar-metrics splits there and trims (a pod running `sql,v2` read as `sql` and `v2`).
    ({"pools": [{"name": "llama", "models": ["m"], "adapters": ["sql", "sql,v2"]}]},
     'pools[0].adapters: "sql,v2" has a comma'),
    ({"pools": [{"name": "llama", "models": ["m"], "adapters": [" padded "]}]},
     'pools[0].adapters: " padded " starts or ends with whitespace'),
], ids=["stat-names", "control-character", "models-path", "adapter-comma", "adapter-whitespace"])
def test_envoy_refuses_a_configuration_that_would_misroute_or_miscount(pods, change, message):
    """Each was accepted before (an audit): Envoy now refuses to start with the configuration,
    and its log names the field."""
    config = dict(CONFIG, **change)
    with pytest.raises(RuntimeError) as refused:
        Envoy("filter", pools_of(pods), config, ready_timeout=10).stop()
    assert message in str(refused.value), str(refused.value)[-1500:]


def test_before_any_snapshot_its_age_grows_and_the_ingest_counters_read_zero(pods):
    """Before the first push the snapshot-age gauge says how long the gateway has gone without
    one (the module's read 0, "fresh"; proxy-wasm's had no series), so GpurouteSnapshotStale
    fires for a gateway that never got a snapshot. The ingest's refusal counters exist at 0, so
    a first refusal is an increase Prometheus sees (proxy-wasm's appeared at 1, and an alert on
    one bad push never fired). Both from audits, 2026-12-07."""
    e = Envoy("filter", pools_of(pods), CONFIG)
    try:
        with urllib.request.urlopen(f"http://{e.admin}/stats/prometheus", timeout=5) as r:
            text = r.read().decode()
        reasons = set(re.findall(r'^envoy_gpuroute_snapshot_rejected\{[^}]*gpuroute_reason="(\w+)"[^}]*\} 0$', text, re.M))
        assert {"unauthorized", "invalid", "too_large", "forbidden", "method"} <= reasons, reasons
        age = STAT_PREFIX + "gpuroute.snapshot.age_ms"
        wait_for(lambda: e.stats().get(age, 0) >= 1500, what="the age of no snapshot to grow", timeout=10)
        assert e.push(fresh(pods, [{}, {}, {}]))[0] == 204
        wait_for(lambda: e.stats().get(age, 10**9) < 1000, what="a fresh snapshot's age", timeout=5)
    finally:
        e.stop()


def test_missing_snapshot_fails_open(pods):
    e = Envoy("filter", pools_of(pods), CONFIG)
    try:
        got = Counter(served_by(e.chat("llama-3-8b")) for _ in range(12))
        assert sum(got.values()) == 12
        assert e.stat(STAT_PREFIX + "gpuroute.fail_open.no_snapshot") == 12
    finally:
        e.stop()


def test_forged_destination_header_is_ignored_even_with_original_dst(pods):
    """ORIGINAL_DST connects wherever the header says: a client must not be able to set it."""
    canary = StubPod("canary")
    e = Envoy("filter_original_dst", pools_of(pods), CONFIG)
    try:
        assert e.push(fresh(pods, [{"waiting": 4}, {}, {"waiting": 4}]))[0] == 204
        forged = {
            "x-gateway-destination-endpoint": canary.address,
            "x-gateway-pool": "qwen",
            "x-gateway-model-name": "qwen-7b",
            "x-envoy-original-dst-host": canary.address,
        }
        for _ in range(5):
            s, h, body, _ = e.chat("llama-3-8b", headers=forged)
            assert s == 200 and h["x-served-by"] == "llama-1"
            assert body["headers"]["x-gateway-pool"] == "llama"
            assert canary.address not in body["headers"]["x-gateway-destination-endpoint"]
        # A non-inference path: the header is still stripped and nothing reaches the canary.
        e.request("GET", "/anything", headers=forged)
        assert canary.requests == []
    finally:
        e.stop()
        canary.close()


@pytest.mark.parametrize("mode", ["filter", "filter_original_dst"])
def test_a_forged_pool_header_reaches_no_pod_on_any_path(pods, mode):
    """The routes match on `x-gateway-pool`, which only the filter may set. A client's is
    removed before the route is chosen, on any path and method: a path no inference route
    takes (vLLM's own endpoints among them) gets the route table's 404, and no pod sees it.
    (The dynamic module once removed the header after Envoy had matched the route on it, and
    such requests reached the named pool's pods.)"""
    e = Envoy(mode, pools_of(pods), CONFIG)
    try:
        assert e.push(fresh(pods))[0] == 204
        before = {n: len(p.requests) for n, p in pods.items()}
        for method, path in [("GET", "/anything"), ("POST", "/v1/load_lora_adapter"), ("GET", "/metrics"),
                             ("POST", "/reset_prefix_cache"), ("DELETE", "/v1/responses/resp_x"),
                             ("POST", "/v1/chat/completions/")]:
            for name in ("x-gateway-pool", "X-Gateway-Pool"):
                headers = {name: "qwen", "x-gateway-model-name": "qwen-7b"}
                s, _, body, _ = e.request(method, path, {"lora_name": "x"} if method == "POST" else None, headers=headers)
                assert s == 404 and body["error"]["code"] == "not_found", (method, path, name, s, body)
        assert {n: len(p.requests) for n, p in pods.items()} == before
        # An inference request with the forged header still goes by its model.
        s, h, body, _ = e.chat("llama-3-8b", headers={"x-gateway-pool": "qwen"})
        assert s == 200 and h["x-served-by"].startswith("llama-") and body["headers"]["x-gateway-pool"] == "llama"
    finally:
        e.stop()


def test_original_dst_fails_open_to_a_known_pod(pods):
    e = Envoy("filter_original_dst", pools_of(pods), CONFIG)
    try:
        # No snapshot at all: ORIGINAL_DST cannot route, so the filter answers 503, counted as
        # an error and only so (both builds counted it failed open too, by its reason).
        s, _, body, _ = e.chat("llama-3-8b")
        assert s == 503 and body["error"]["code"] == "no_healthy_endpoints"
        time.sleep(0.1)  # counters batched until the tick
        outcomes = {k: v for k, v in e.stats().items() if ".pool.llama.requests." in k or ".fail_open." in k}
        assert {k.rsplit(".", 1)[1]: v for k, v in outcomes.items() if v} == {"error": 1}, outcomes
        stale = fresh(pods)
        for pool in stale["pools"]:
            for p in pool["pods"]:
                p["last_scrape_ms"] -= 60_000
        assert e.push(stale)[0] == 204
        s, h, _, _ = e.chat("llama-3-8b")
        assert s == 200 and h["x-served-by"].startswith("llama-")
        # A request that needs only its model's pool (count_tokens) gets a known pod too: there
        # is no load balancer to leave it to.
        assert e.push(fresh(pods))[0] == 204
        s, _, body, _ = e.request("POST", "/v1/messages/count_tokens",
                                  {"model": "qwen-7b", "messages": [{"role": "user", "content": "hi"}]})
        assert s == 200 and body["pod"] == "qwen-0", body
    finally:
        e.stop()


def error_of(resp):
    status, _, body, _ = resp
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return status, body["error"]


def test_openai_style_errors(envoy):
    s, err = error_of(envoy.request("POST", "/v1/chat/completions", b'{"model": "llama-3-8b", "messages": [}'))
    assert (s, err["type"], err["code"]) == (400, "invalid_request_error", "invalid_json")
    s, err = error_of(envoy.request("POST", "/v1/chat/completions", {"model": 7, "messages": []}))
    assert (s, err["param"]) == (400, "model")
    s, err = error_of(envoy.chat("gpt-4o"))
    assert (s, err["code"], err["param"]) == (404, "model_not_found", "model")
    s, err = error_of(envoy.request("POST", "/v1/chat/completions", {"messages": []}))
    assert (s, err["code"]) == (400, "missing_required_parameter")
    # A compressed body cannot be read: said so, instead of "invalid JSON".
    import gzip
    packed = gzip.compress(json.dumps({"model": "llama-3-8b", "messages": []}).encode())
    s, err = error_of(envoy.request("POST", "/v1/chat/completions", packed, {"content-encoding": "gzip"}))
    assert (s, err["code"]) == (415, "unsupported_content_encoding") and "gzip" in err["message"]
    s, _, _, _ = envoy.request("POST", "/v1/chat/completions", {"model": "qwen-7b", "messages": []},
                               {"content-encoding": "identity"})
    assert s == 200
    # Declared too large: answered from the headers alone, before any body byte is read.
    host, port = envoy.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (4 * 1024 * 1024 + 10))
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"


def test_other_methods_on_an_inference_path_get_405(envoy):
    """An inference path takes POST only. Anything else (a `GET /v1/chat/completions` listing
    stored completions, a CORS preflight with no CORS filter before this one) gets 405 with
    `allow: POST`, in the path's API's shape, as vLLM answers it. Before, it passed the filter
    unrouted and the route table answered 503 "the routing filter is not running; retry", which
    SDKs retried and operators took for an outage."""
    before = envoy.stat(STAT_PREFIX + "gpuroute.rejected.method_not_allowed")
    for method in ("GET", "PUT", "DELETE", "OPTIONS", "PATCH"):
        s, h, body, _ = envoy.request(method, "/v1/chat/completions", b"{}" if method in ("PUT", "PATCH") else None)
        assert (s, h.get("allow")) == (405, "POST"), (method, s, body)
        assert (body["error"]["code"], body["error"]["type"]) == ("method_not_allowed", "invalid_request_error")
    s, h, body, _ = envoy.request("GET", "/v1/messages?beta=true")
    assert (s, h.get("allow"), body["type"], body["error"]["type"]) == (405, "POST", "error", "invalid_request_error")
    assert envoy.stat(STAT_PREFIX + "gpuroute.rejected.method_not_allowed") - before == 6
    # A path that is not an inference path keeps the route table's answer.
    assert envoy.request("GET", "/v1/responses/resp_1")[0] == 404


def test_a_byte_order_mark_before_the_json_is_routed(envoy, pods):
    """Some Windows tools write JSON files with a UTF-8 byte-order mark; vLLM accepts such a
    body (Python's json.loads on bytes), so the gateway routes it instead of answering 400."""
    assert envoy.push(fresh(pods))[0] == 204
    body = b"\xef\xbb\xbf" + json.dumps({"model": "qwen-7b", "messages": [{"role": "user", "content": "hi"}]}).encode()
    s, h, _, _ = envoy.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    assert (s, h.get("x-served-by")) == (200, "qwen-0"), (s, h)


def anthropic_error_of(resp):
    status, h, body, _ = resp
    assert h.get("content-type") == "application/json", h
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return status, body["error"]


def declared_too_large(envoy, path):
    """The first bytes of the answer to a request whose content-length is over the limit, sent
    without its body."""
    host, port = envoy.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (path.encode(), 4 * 1024 * 1024 + 10))
        return sock.recv(65536)


def test_anthropic_messages_api_is_routed_and_answered_in_its_shape(envoy, pods):
    """`/v1/messages`, Anthropic's Messages API (vLLM, SGLang and llama.cpp serve it), is an
    inference path by default: routed by `model` like the OpenAI paths, and the gateway's own
    errors come in Anthropic's shape (`{"type":"error","error":{"type","message"}}`), with the
    status Anthropic's SDKs map to their exceptions."""
    assert envoy.push(fresh(pods))[0] == 204
    user = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    ask = lambda model, **extra: dict({"model": model, "max_tokens": 16, "system": "be brief", "messages": user}, **extra)
    for _ in range(3):
        s, _, body, _ = envoy.request("POST", "/v1/messages", ask("qwen-7b"))
        assert s == 200 and body["pod"] == "qwen-0", body
        assert body["path"] == "/v1/messages" and body["headers"]["x-gateway-pool"] == "qwen"
    # An adapter goes to its base model's pool; an alias is rewritten in the body.
    s, _, body, _ = envoy.request("POST", "/v1/messages", ask("sql-lora", stream=True))
    assert s == 200 and body["pod"].startswith("llama-"), body
    assert body["headers"]["x-gateway-base-model-name"] == "llama-3-8b"
    s, _, body, _ = envoy.request("POST", "/v1/messages", ask("llama"))
    assert s == 200 and json.loads(body["body"])["model"] == "llama-3-8b"

    s, err = anthropic_error_of(envoy.request("POST", "/v1/messages", b'{"model": "llama-3-8b", "messages": [}'))
    assert (s, err["type"]) == (400, "invalid_request_error") and "JSON" in err["message"], err
    s, err = anthropic_error_of(envoy.request("POST", "/v1/messages", ask(7)))
    assert (s, err["type"]) == (400, "invalid_request_error") and "model" in err["message"], err
    s, err = anthropic_error_of(envoy.request("POST", "/v1/messages", ask("claude-9")))
    assert (s, err["type"]) == (404, "not_found_error") and "claude-9" in err["message"], err
    import gzip
    packed = gzip.compress(json.dumps(ask("llama-3-8b")).encode())
    s, err = anthropic_error_of(envoy.request("POST", "/v1/messages", packed, {"content-encoding": "gzip"}))
    assert (s, err["type"]) == (415, "invalid_request_error") and "gzip" in err["message"], err
    data = declared_too_large(envoy, "/v1/messages")
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    err = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert err["type"] == "error" and err["error"]["type"] == "request_too_large", err
    # The OpenAI paths keep OpenAI's shape.
    assert error_of(envoy.chat("claude-9"))[1]["code"] == "model_not_found"


def test_the_route_tables_inference_paths_are_the_filters(envoy):
    """The shipped route tables list the filter's default inference paths (`render.py` reads the
    file the filter compiles in, for the 503 routes): on each, the filter itself reads the body,
    so a malformed one gets its 400 in the path's API's shape rather than passing through to the
    route table."""
    from harness import render
    for path in render.INFERENCE_PATHS:
        s, h, body, _ = envoy.request("POST", path, b"{")
        assert s == 400, (path, s, body)
        if render.is_messages_path(path):
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (path, body)
        else:
            assert body["error"]["code"] == "invalid_json", (path, body)


def test_count_tokens_is_routed_to_its_models_pool_and_not_counted_as_load(envoy, pods):
    """`/v1/messages/count_tokens` needs a pod that serves the model (its tokenizer), not GPU
    capacity: routed to the model's pool with the pod left to Envoy's load balancer (no
    destination header), counted as `routed`, never as load; errors in Anthropic's shape."""
    assert envoy.push(fresh(pods))[0] == 204
    routed = STAT_PREFIX + "gpuroute.pool.llama.requests.routed"
    picked = STAT_PREFIX + "gpuroute.pool.llama.requests.picked"
    before = (envoy.stat(routed), envoy.stat(picked))
    ask = {"model": "llama", "system": "be brief", "messages": [{"role": "user", "content": "hello"}]}
    served = Counter()
    for _ in range(6):
        s, _, body, _ = envoy.request("POST", "/v1/messages/count_tokens", ask)
        assert s == 200 and body["path"] == "/v1/messages/count_tokens", body
        assert body["headers"]["x-gateway-pool"] == "llama"
        assert "x-gateway-destination-endpoint" not in body["headers"], body["headers"]
        assert json.loads(body["body"])["model"] == "llama-3-8b"  # the alias, rewritten
        served[body["pod"]] += 1
    assert set(served) <= {"llama-0", "llama-1", "llama-2"}, served
    assert (envoy.stat(routed), envoy.stat(picked)) == (before[0] + 6, before[1])
    s, err = anthropic_error_of(envoy.request("POST", "/v1/messages/count_tokens", dict(ask, model="claude-9")))
    assert (s, err["type"]) == (404, "not_found_error"), err


def test_rerank_and_score_requests_are_routed_by_model_to_the_least_loaded_pod(envoy, pods):
    """vLLM's rerank and score APIs (Jina's `/v1/rerank`, Cohere's `/v2/rerank`, `/v1/score`) are
    default inference paths: each body goes to its model's pool, the alias rewritten, and to the
    idle pod of the pool; the others are busy."""
    busy = {"waiting": 30, "running": 40, "kv_cache_usage": 0.9}
    assert envoy.push(fresh(pods, llama=[busy, {}, busy]))[0] == 204
    asks = [
        ("/v1/rerank", {"model": "llama", "query": "What is a panda?", "documents": ["hi", "a bear"], "top_n": 1}),
        ("/v2/rerank", {"model": "llama", "query": "What is a panda?", "documents": ["hi", "a bear"]}),
        ("/v1/score", {"model": "llama", "text_1": "What is a panda?", "text_2": ["hi", "a bear"]}),
    ]
    for path, ask in asks:
        for _ in range(3):
            s, h, body, _ = envoy.request("POST", path, ask)
            assert (s, body["pod"], body["path"]) == (200, "llama-1", path), (path, h.get("x-gateway-debug"))
            assert json.loads(body["body"]) == dict(ask, model="llama-3-8b")
    s, err = error_of(envoy.request("POST", "/v1/rerank", dict(asks[0][1], model="bge-9")))
    assert (s, err["code"]) == (404, "model_not_found"), err


def test_vllms_own_paths_are_routed_by_model(envoy, pods):
    """The paths vLLM serves outside `/v1` are default inference paths too. Rerank, score,
    classification and pooling go to the idle pod of their model's pool, the alias rewritten;
    `/tokenize` and `/detokenize` need only the model's tokenizer: the pool, the pod left to
    Envoy, counted as `routed`, never as load."""
    busy = {"waiting": 30, "running": 40, "kv_cache_usage": 0.9}
    assert envoy.push(fresh(pods, llama=[busy, {}, busy]))[0] == 204
    picked = [
        ("/rerank", {"model": "llama", "query": "What is a panda?", "documents": ["hi", "a bear"]}),
        ("/score", {"model": "llama", "text_1": "What is a panda?", "text_2": "a bear"}),
        ("/classify", {"model": "llama", "input": ["loved it", "hated it"]}),
        ("/v1/classify", {"model": "llama", "input": "loved it"}),
        ("/pooling", {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}),
    ]
    for path, ask in picked:
        for _ in range(3):
            s, h, body, _ = envoy.request("POST", path, ask)
            assert (s, body["pod"], body["path"]) == (200, "llama-1", path), (path, h.get("x-gateway-debug"))
            assert body["headers"]["x-gateway-destination-endpoint"].startswith(pods["llama-1"].address)
            assert json.loads(body["body"]) == dict(ask, model="llama-3-8b")
    routed = STAT_PREFIX + "gpuroute.pool.llama.requests.routed"
    counts = STAT_PREFIX + "gpuroute.pool.llama.requests.picked"
    before = (envoy.stat(routed), envoy.stat(counts))
    text = "Tokenized, never generated from. " * 40
    tokenized = [
        ("/tokenize", {"model": "llama", "prompt": text}),
        ("/tokenize", {"model": "llama", "messages": [{"role": "user", "content": text}]}),
        ("/detokenize", {"model": "llama", "tokens": [128000, 9906, 1917]}),
    ]
    served = Counter()
    for path, ask in tokenized * 3:
        s, _, body, _ = envoy.request("POST", path, ask)
        assert (s, body["path"]) == (200, path), body
        assert body["headers"]["x-gateway-pool"] == "llama"
        assert "x-gateway-destination-endpoint" not in body["headers"], body["headers"]
        assert json.loads(body["body"]) == dict(ask, model="llama-3-8b")
        served[body["pod"]] += 1
    assert set(served) <= {"llama-0", "llama-1", "llama-2"}, served
    assert (envoy.stat(routed), envoy.stat(counts)) == (before[0] + 9, before[1])
    for path in ("/tokenize", "/classify"):
        s, err = error_of(envoy.request("POST", path, {"model": "bge-9", "input": "x"}))
        assert (s, err["code"]) == (404, "model_not_found"), (path, err)
    s, err = error_of(envoy.request("POST", "/tokenize", {"model": 7, "prompt": "x"}))
    assert (s, err["code"], err["param"]) == (400, "invalid_type", "model"), err


def test_a_conversation_keeps_its_pod_across_the_openai_and_anthropic_apis(envoy, pods):
    """The engines apply one chat template to both APIs, so a conversation's cached prefix on a
    pod serves it whichever API the client uses: a Messages request whose `system` and first
    turn are a chat conversation's goes to that conversation's pod. (If `system` were not read,
    the Messages prompt would share no leading block with the chat one, and most of the eight
    conversations would land elsewhere.)"""
    assert envoy.push(fresh(pods))[0] == 204
    pods_used = set()
    for i in range(8):
        system = f"You are assistant {i} of a shipping company; answer in numbered steps. " * 3
        first = f"Conversation {i}: where is parcel {1000 + i}? It left the hub on Tuesday."
        s, _, chat, _ = envoy.request("POST", "/v1/chat/completions", {
            "model": "llama-3-8b",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": first}],
        })
        assert s == 200, chat
        s, _, msg, _ = envoy.request("POST", "/v1/messages", {
            "model": "llama-3-8b", "max_tokens": 64, "system": system,
            "messages": [{"role": "user", "content": first},
                         {"role": "assistant", "content": "It is at the Rotterdam depot."},
                         {"role": "user", "content": "When will it arrive?"}],
        })
        assert s == 200, msg
        assert msg["pod"] == chat["pod"], (i, chat["pod"], msg["pod"])
        pods_used.add(chat["pod"])
    # Conversations still spread over the pool.
    assert len(pods_used) >= 2, pods_used


def test_missing_model_goes_to_the_default_pool_when_one_is_configured(pods):
    """`default_pool` set: a request without `model` is routed to that pool (and named as its
    first model for the route), instead of the 400 the shared fixture's configuration gives;
    a model that exists is routed as before and an unknown one is still 404."""
    e = Envoy("filter", pools_of(pods), dict(CONFIG, default_pool="qwen"))
    try:
        assert e.push(fresh(pods))[0] == 204
        s, _, body, _ = e.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert s == 200 and body["pod"] == "qwen-0", body
        assert body["headers"]["x-gateway-pool"] == "qwen"
        assert body["headers"]["x-gateway-model-name"] == "qwen-7b"
        assert served_by(e.chat("llama-3-8b")).startswith("llama-")
        assert error_of(e.chat("gpt-4o"))[0] == 404
    finally:
        e.stop()


def test_oversize_body_without_content_length_is_413(envoy):
    """Chunked upload: the limit is enforced while buffering, not only from content-length."""
    host, port = envoy.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"y" * 65536
        try:
            for _ in range(80):  # 5 MiB
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"request_too_large" in data


def test_models_list(envoy):
    s, h, body, _ = envoy.request("GET", "/v1/models")
    assert s == 200 and h["content-type"] == "application/json"
    assert body["object"] == "list"
    ids = {m["id"]: m for m in body["data"]}
    assert set(ids) == {"llama-3-8b", "llama", "sql-lora", "chat-lora", "qwen-7b"}
    assert ids["sql-lora"]["parent"] == "llama-3-8b"
    # Anthropic's page and model fields, in the same body.
    assert (body["has_more"], body["first_id"], body["last_id"]) == (False, "llama-3-8b", "qwen-7b")
    assert {(m["type"], m["display_name"]) for m in body["data"]} == {("model", i) for i in ids}
    # A query (Anthropic's SDK pages with one) lists the same.
    assert envoy.request("GET", "/v1/models?limit=20")[2] == body
    # One model: its object in the list, for each of them; an unknown one is 404 in the shape
    # of the API that asked (Anthropic's SDKs send anthropic-version).
    for i, m in ids.items():
        s, _, one, _ = envoy.request("GET", f"/v1/models/{i}")
        assert (s, one) == (200, m)
    s, _, err, _ = envoy.request("GET", "/v1/models/gpt-9")
    assert (s, err["error"]["code"], err["error"]["type"]) == (404, "model_not_found", "invalid_request_error")
    s, _, err, _ = envoy.request("GET", "/v1/models/gpt-9", headers={"anthropic-version": "2023-06-01"})
    assert (s, err["type"], err["error"]["type"]) == (404, "error", "not_found_error")
    # Other methods under the path are not the filter's (the route table's catch-all answers).
    assert envoy.request("POST", "/v1/models/llama", {})[0] == 404
    assert envoy.stat(STAT_PREFIX + "gpuroute.models_list") >= 2 + len(ids) + 2


def test_ingest_rejects_bad_token_and_bad_snapshot_and_keeps_the_old_one(envoy, pods):
    good = fresh(pods, [{"waiting": 4}, {"waiting": 4}, {"waiting": 0}])
    assert envoy.push(good)[0] == 204
    assert served_by(envoy.chat("llama-3-8b")) == "llama-2"
    other = fresh(pods, [{"waiting": 0}, {"waiting": 4}, {"waiting": 4}])
    s, _, body, _ = envoy.push(other, token="wrong-token")
    assert s == 401 and body["error"]["code"] == "invalid_token"
    s, _, body, _ = envoy.push(None, raw=b'{"schema": 1, "version": "x"}')
    assert s == 400 and "version" in body["error"]["message"]
    bad = json.loads(json.dumps(other))
    bad["pools"][0]["pods"][0]["kv_cache_usage"] = 7
    s, _, body, _ = envoy.push(bad)
    assert s == 400 and "kv_cache_usage" in body["error"]["message"]
    # A pod Envoy would not find among its hosts (the port written as 0PORT), which would also
    # pass as a second pod beside the same one written plainly.
    respelled = json.loads(json.dumps(other))
    ip, port = respelled["pools"][0]["pods"][0]["address"].rsplit(":", 1)
    respelled["pools"][0]["pods"][0]["address"] = f"{ip}:0{port}"
    s, _, body, _ = envoy.push(respelled)
    assert s == 400 and f"is not in the standard form Envoy writes: {ip}:{port}" in body["error"]["message"]
    older = json.loads(json.dumps(other))
    older["version"] = good["version"] - 1
    s, _, body, _ = envoy.push(older)
    assert s == 400 and "not newer" in body["error"]["message"]
    # Still routing by the good snapshot.
    assert Counter(served_by(envoy.chat("llama-3-8b")) for _ in range(5)) == {"llama-2": 5}
    assert envoy.stat(STAT_PREFIX + "gpuroute.snapshot.rejected.unauthorized") >= 1
    assert envoy.stat(STAT_PREFIX + "gpuroute.snapshot.rejected.invalid") >= 4


def test_ingest_path_is_not_reachable_from_the_traffic_listener_without_loopback(envoy):
    # The traffic listener's plugin has no ingest configured: the path is just unrouted.
    s, _, body, _ = envoy.request("POST", "/gpuroute/v1/snapshot", b"{}", {"authorization": "Bearer " + TOKEN})
    assert s == 404


def test_envoy_keeps_serving_after_1000_malformed_requests(envoy, pods):
    assert envoy.push(fresh(pods))[0] == 204
    host, port = envoy.listen.rsplit(":", 1)
    bodies = [
        b"{", b"[]", b"null", b'{"model":', b'{"model":{"a":1}}', b'{"model":"llama-3-8b","messages":"x"}',
        b'\xff\xfe\x00garbage', b'{"model":"llama-3-8b","model":"qwen-7b"}', b'{"model":"' + b"A" * 5000 + b'"}',
        b'{"model":"llama-3-8b","messages":[{"role":"user","content":[{"type":"image_url"},1,null]}]}',
    ]
    statuses = Counter()
    for i in range(1000):
        body = bodies[i % len(bodies)]
        s, _, _, _ = envoy.request("POST", "/v1/chat/completions", body, {"x-gateway-priority": "not-a-number"})
        statuses[s] += 1
    assert envoy.alive()
    assert set(statuses) <= {200, 400, 404}, statuses
    assert statuses[400] >= 700
    # 100,000 levels of nesting: a recursive parser without a depth limit would exhaust the VM's
    # stack (a trap takes the VM down like a panic). Closed, it is valid JSON the gateway does not
    # read a prompt from (routed; the pod judges the messages); unclosed, invalid.
    deep = b'{"model":"llama-3-8b","messages":' + b"[" * 100_000
    for _ in range(3):
        assert envoy.request("POST", "/v1/chat/completions", deep + b"]" * 100_000 + b"}")[0] == 200
        s, err = error_of(envoy.request("POST", "/v1/chat/completions", deep))
        assert (s, err["code"]) == (400, "invalid_json")
    # Hostile header bytes do not take the VM down either.
    with socket.create_connection((host, int(port)), timeout=5) as s:
        body = b'{"model":"llama-3-8b","messages":[]}'
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-gateway-priority: \xff\xfe\r\n"
            b"authorization: Bearer \x80\x81\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert s.recv(100).startswith(b"HTTP/1.1 200")
    # The filter still decides and still answers bad bodies itself, and its VM never failed (a
    # failed VM is replaced: see test_a_failed_vm_is_reloaded).
    s, _, body, _ = envoy.chat("llama-3-8b")
    assert s == 200 and body["headers"].get("x-gateway-pool") == "llama", body
    assert envoy.request("POST", "/v1/chat/completions", b"{")[0] == 400
    if RUNTIME == "wasm":
        for stat in ("vm_reload", "vm_reload_backoff", "vm_reload_success", "vm_reload_failure"):
            assert envoy.stat(f"wasm.gpuroute.{stat}") == 0, stat


@pytest.mark.skipif(RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module runs natively, with no VM to fail")
def test_a_failed_vm_is_reloaded(pods):
    """A worker whose VM fails is not left without the filter. The filter has no panic path, so a
    test module stands in for it (the floor's `trap` build: sets `x-gateway-pool: llama` and a
    llama pod, traps when the body holds "TRAP") under the shipped configuration (render.py's `failure_policy`). While
    Envoy backs off, the worker answers 503, which OpenAI's SDKs retry; then a new VM routes
    again. Never the route table's 404: with FAIL_OPEN the worker served without the filter for
    good, so no request there carried a pool header again."""
    e = Envoy("filter", pools_of(pods), trap_config(pods), wasm=TRAP_WASM)
    try:
        assert served_by(e.chat("llama-3-8b")).startswith("llama-")
        assert e.chat("llama-3-8b", "TRAP")[0] == 503
        statuses = []
        deadline = time.time() + 10
        while time.time() < deadline:
            statuses.append(e.chat("llama-3-8b")[0])
            if statuses[-1] == 200:
                break
            time.sleep(0.1)
        assert statuses[0] == 503 and statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        assert e.stat("wasm.gpuroute.vm_reload_success") >= 1
        assert served_by(e.chat("llama-3-8b")).startswith("llama-")
    finally:
        e.stop()


@pytest.mark.skipif(RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module runs natively, with no VM to fail")
def test_a_worker_without_the_filter_answers_inference_requests_with_a_retryable_503(pods):
    """When the filter is not running on a worker and Envoy does not stand in (a VM that failed
    to start: V8 did so under valgrind at 12-14 workers, and FAIL_RELOAD did not reload it),
    inference requests reach the route table without a pool header. The
    shipped route table answers them with an OpenAI-style 503, which the SDKs retry, instead of
    the catch-all 404 that tells the client to use an inference path. Here the test module's
    trap, under FAIL_OPEN, leaves the worker without the filter (the worker then serves as one
    whose VM never started), so that every inference path and both APIs' shapes are checked on
    one worker; the next test makes a real failed start."""

    def fail_open(config):
        for listener in config["static_resources"]["listeners"]:
            for chain in listener["filter_chains"]:
                for f in chain["filters"]:
                    for hf in f["typed_config"]["http_filters"]:
                        if hf["name"] == "envoy.filters.http.wasm":
                            hf["typed_config"]["config"]["failure_policy"] = "FAIL_OPEN"

    e = Envoy("filter", pools_of(pods), trap_config(pods), wasm=TRAP_WASM, patch=fail_open)
    try:
        assert served_by(e.chat("llama-3-8b")).startswith("llama-")
        assert e.chat("llama-3-8b", "TRAP")[0] in (500, 503)
        for path in ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]:
            s, h, body, _ = e.request("POST", path, {"model": "llama-3-8b", "prompt": "hi", "input": "hi"})
            assert s == 503, (path, s, body)
            assert h.get("content-type") == "application/json", h
            assert body["error"]["code"] == "routing_unavailable", body
            assert body["error"]["type"] == "service_unavailable_error", body
        # The Messages API's path in Anthropic's shape.
        s, err = anthropic_error_of(e.request("POST", "/v1/messages", {"model": "llama-3-8b", "messages": []}))
        assert (s, err["type"]) == (503, "overloaded_error") and "retry" in err["message"], err
        # Everything else still gets the catch-all.
        s, _, body, _ = e.request("GET", "/health")
        assert s == 404 and body["error"]["code"] == "not_found"
    finally:
        e.stop()


def address_space_peak(e):
    """The most address space Envoy's process has held, bytes (VmPeak)."""
    with open(f"/proc/{e.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmPeak:"))


def prometheus_gauges(e, *names):
    """The unlabelled gauges `names` as /stats/prometheus serves them (what Prometheus scrapes)."""
    with urllib.request.urlopen(f"http://{e.admin}/stats/prometheus", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition("{} ")
        if name in names:
            values[name] = float(value)
    return [values.get(n) for n in names]


# Runs Envoy with its address space limited (RLIMIT_AS, as `ulimit -v` or systemd's LimitAS
# set it), then execs it in place (same pid).
ADDRESS_SPACE_LIMIT = ("import os, resource, sys; n = int(sys.argv[1]); "
                       "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execv(sys.argv[2], sys.argv[2:])")


@pytest.mark.skipif(RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module runs natively, with no VM to fail")
def test_a_worker_whose_vm_never_started_answers_503_and_the_vm_gauge_shows_it(pods):
    """A Wasm VM that fails to start is not started again: its worker serves without the
    filter. V8 reserves ~9 GB of address space per VM, so an address-space limit makes it
    happen at will: measured here, the limit leaves room for the main thread's two VMs and two
    workers' of four. Inference requests reaching those two workers get the route table's 503
    `routing_unavailable`, the others are routed; nothing reloads the missing VMs; and the
    gauges `GpurouteWorkerWithoutFilter` compares (deploy/monitoring/) tell: fewer VMs than
    `envoy_server_concurrency` + 2, where a healthy Envoy has exactly that many."""
    active, concurrency = "envoy_wasm_envoy_wasm_runtime_v8_active", "envoy_server_concurrency"
    peaks = {}
    for workers in (1, 2):
        e = Envoy("filter", pools_of(pods), CONFIG, concurrency=workers)
        try:
            assert served_by(e.chat("llama-3-8b")).startswith("llama-")
            # The alert's quiet case, as Envoy exports it: the workers' VMs and the main thread's two.
            assert prometheus_gauges(e, active, concurrency) == [workers + 2, workers]
            peaks[workers] = address_space_peak(e)
        finally:
            e.stop()
    per_vm = peaks[2] - peaks[1]
    assert per_vm > 1 << 30, peaks  # V8's reservation, with its guard regions
    limit = peaks[2] + per_vm // 2
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=4,
              wrap=[sys.executable, "-c", ADDRESS_SPACE_LIMIT, str(limit)])
    try:
        vms, workers = prometheus_gauges(e, active, concurrency)
        assert workers == 4 and 3 <= vms < workers + 2, (vms, workers)

        def answers():
            got = Counter()
            for _ in range(40):
                # A new connection each: the kernel gives each to one of the workers.
                s, h, body, _ = e.request("POST", "/v1/chat/completions", {"model": "llama-3-8b", "messages": []},
                                          headers={"connection": "close"})
                if s == 200:
                    got["routed" if h.get("x-served-by", "").startswith("llama-") else "other"] += 1
                else:
                    got[(s, body.get("error", {}).get("code") if isinstance(body, dict) else body)] += 1
            return got

        first = answers()
        assert set(first) == {"routed", (503, "routing_unavailable")}, first
        time.sleep(2)
        # Not started again: still two kinds of worker, and no reload.
        assert set(answers()) == {"routed", (503, "routing_unavailable")}
        assert e.stat("wasm.gpuroute.vm_reload") == 0
        assert prometheus_gauges(e, active)[0] == vms
    finally:
        e.stop()
    # Envoy writes its log file out at exit at the latest.
    assert "Failed to create new Wasm instance" in e.log()


def test_burst_within_one_snapshot_spreads(pods):
    """No thundering herd: a burst inside one scrape interval does not pile onto the pod that
    looked best at the last scrape, because requests in flight count against their pod."""
    slow = {n: StubPod(n, delay_s=1.0) for n in ["s0", "s1", "s2"]}
    e = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in slow.values()]}], CONFIG, concurrency=2)
    try:
        snap = snapshot({"llama": [
            {"address": slow["s0"].address, "running": 0},
            {"address": slow["s1"].address, "running": 6},
            {"address": slow["s2"].address, "running": 6},
        ]})
        assert e.push(snap)[0] == 204
        with concurrent.futures.ThreadPoolExecutor(30) as ex:
            got = Counter(ex.map(lambda _: served_by(e.chat("llama-3-8b", "burst")), range(30)))
        assert len(got) == 3 and max(got.values()) <= 15, got
    finally:
        e.stop()
        for p in slow.values():
            p.close()


def connection_per_worker(e, workers):
    """One keep-alive connection to each of Envoy's `workers` worker threads (the kernel picks a
    connection's worker; Envoy's per-worker accept counters say which it picked), by worker."""
    host, port = e.listen.rsplit(":", 1)
    conns, spare = {}, []
    try:
        for _ in range(200):
            before = e.worker_connections()
            c = http.client.HTTPConnection(host, int(port), timeout=10)
            c.connect()
            deadline = time.time() + 5
            while (after := e.worker_connections()) == before and time.time() < deadline:
                time.sleep(0.01)
            worker = next((k for k, v in after.items() if v != before.get(k, 0)), None)
            if worker is None:
                c.close()
                break
            if worker in conns:
                spare.append(c)
            else:
                conns[worker] = c
            if len(conns) == workers:
                return conns
        for c in conns.values():
            c.close()
        raise AssertionError(f"connections did not reach every worker: {e.worker_connections()}")
    finally:
        for c in spare:
            c.close()


def test_a_request_that_ended_on_one_worker_no_longer_counts_on_the_other(pods):
    """A request's end reaches the other workers at once when its worker has none left in
    flight, not at that worker's next tick: a worker that went quiet has nothing later to
    publish it with. Before, the other worker counted the finished request on its pod for up to
    a tick and sent the next request (in production, often the next turn of a conversation that
    pod holds) elsewhere. The tick is made 60 s long here, so the end can reach the other worker
    only with the request's own end. Each worker routes a request first, so each knows the
    other (a worker joins the exchange with its first routed request). Then the requests
    alternate between the two workers on keep-alive connections, each after the one before was
    answered; the snapshot makes pod 0 the best by a margin that one request in flight there
    outweighs."""
    addrs = [pods[f"llama-{i}"].address for i in range(3)]
    config = dict(CONFIG, tick_ms=60_000, idle_tick_ms=60_000)
    e = Envoy("filter", pools_of(pods), config, concurrency=2)
    conns = {}
    try:
        assert e.push(snapshot({"llama": [
            {"address": addrs[0], "running": 2},
            {"address": addrs[1], "running": 3},
            {"address": addrs[2], "running": 3},
        ]}))[0] == 204
        conns = connection_per_worker(e, 2)
        served = []
        for i in range(14):
            c = list(conns.values())[i % 2]
            body = json.dumps({"model": "llama-3-8b", "messages": [{"role": "user", "content": f"question {i}"}]})
            c.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            assert r.status == 200
            served.append((r.getheader("x-served-by"), r.getheader("x-gateway-debug")))
        # The first two joined the exchange, one on each worker.
        assert [s for s, _ in served[2:]] == ["llama-0"] * 12, served
    finally:
        for c in conns.values():
            c.close()
        e.stop()


def test_a_quiet_workers_requests_in_prefill_count_on_the_other_worker_as_snapshots_come(pods):
    """Worker B has one streamed request queued at pod X and routes nothing more; snapshots come
    every 100 ms, as sidecar-metrics pushes them. Worker A must count that request on X for as
    long as it is queued. Before, B's tick slowed to `idle_tick_ms` (320 ms) once it routed
    nothing, its table fell more than a snapshot behind between its ticks, and A left it out
    half the time (an audit: 61 of 123 probes scored X as idle, 31 were sent there); and A's
    first request after its own idle spell left it out too, A having skipped B's version."""
    a, b = StubPod("quiet-a"), StubPod("quiet-b")
    # Debug header on; the other options at their defaults (tick 20 ms, idle tick 320 ms).
    config = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True,
              "scoring": {"stale_after_ms": 60_000}}
    e = Envoy("filter", [{"name": "llama", "endpoints": [a.address, b.address]}], config, concurrency=2)
    pusher, conns = None, {}
    try:
        pusher = Pusher([e], {"llama": [{"address": a.address}, {"address": b.address}]}, interval_s=0.1)
        conns = connection_per_worker(e, 2)
        worker_a, worker_b = conns.values()

        def chat(c, content, stream=False):
            body = {"model": "llama-3-8b", "stream": stream, "messages": [{"role": "user", "content": content}]}
            c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})

        for c in conns.values():  # each worker joins the exchange with a routed request
            chat(c, "warm")
            r = c.getresponse()
            r.read()
        # B's streamed request: both pods hold it, then the one it went to keeps holding.
        for p in (a, b):
            p.hold = threading.Event()
        before = {p: len(p.requests) for p in (a, b)}
        chat(worker_b, "a long prompt on worker B", stream=True)
        deadline = time.time() + 10
        while all(len(p.requests) == before[p] for p in (a, b)) and time.time() < deadline:
            time.sleep(0.01)
        x, y = (a, b) if len(a.requests) > before[a] else (b, a)
        y.hold.set()
        time.sleep(1.5)  # B routes nothing: its tick slows down (before, to 320 ms)
        blind = []
        for i in range(40):
            chat(worker_a, f"probe {i}")
            try:
                r = worker_a.getresponse()
            except TimeoutError:  # sent to X, which holds it
                blind.append((x.name, "no answer: X holds it"))
                break
            r.read()
            debug = r.getheader("x-gateway-debug")
            queue = {addr: float(q) for addr, q in re.findall(r"(127\.0\.0\.1:\d+) total=[-\d.]+ queue=([-\d.]+)", debug)}
            if r.getheader("x-served-by") != y.name or not queue[x.address] < queue[y.address]:
                blind.append((r.getheader("x-served-by"), debug))
            time.sleep(0.05)
        assert not blind, f"{len(blind)} of 40 probes did not count B's request on {x.name}: {blind[:3]}"
    finally:
        for p in (a, b):
            if p.hold is not None:
                p.hold.set()
        if pusher:
            pusher.stop()
        for c in conns.values():
            c.close()
        e.stop()
        a.close()
        b.close()


def test_requests_in_flight_under_the_old_configuration_count_under_the_new(tmp_path):
    """A change of the filter's configuration (an LDS update) while a request is in flight at
    pod X: the new configuration counts it on X for as long as it runs (the old filter chain
    drains meanwhile; 30 s here). The dynamic module kept a table per configuration before, so
    the new one sent the next request to X as if it were idle (an audit)."""
    a, b = StubPod("change-a"), StubPod("change-b")
    lds = LdsListener(tmp_path / "lds")
    config = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True,
              "scoring": {"stale_after_ms": 60_000}}
    e = Envoy("filter", [{"name": "llama", "endpoints": [a.address, b.address]}], config,
              workdir=tmp_path / "envoy", patch=lds.patch,
              envoy_args=["--drain-time-s", "30", "--drain-strategy", "immediate"])
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert e.push(snapshot({"llama": [{"address": a.address}, {"address": b.address}]}))[0] == 204
        for p in (a, b):
            p.hold = threading.Event()
        ex.submit(e.chat, "llama-3-8b", "a long one", timeout=120)
        deadline = time.time() + 10
        while not (a.requests or b.requests) and time.time() < deadline:
            time.sleep(0.01)
        x, y = (a, b) if a.requests else (b, a)
        y.hold.set()

        def probe():
            try:
                s, h, _, _ = e.chat("llama-3-8b", "probe", timeout=5)
            except TimeoutError:
                raise AssertionError(f"a probe went to {x.name}, which holds it: its request was not counted") from None
            queue = dict(re.findall(r"(127\.0\.0\.1:\d+) total=[-\d.]+ queue=([-\d.]+)", h["x-gateway-debug"]))
            return s, h["x-served-by"], float(queue[x.address]), float(queue[y.address])

        status, served, qx, qy = probe()
        assert (status, served) == (200, y.name) and qx < qy
        lds.change(e, timeout_s=10, tick_ms=21)
        for _ in range(5):
            status, served, qx, qy = probe()
            assert (status, served) == (200, y.name) and qx < qy, (served, qx, qy)
    finally:
        for p in (a, b):
            if p.hold is not None:
                p.hold.set()
        ex.shutdown(wait=True)
        e.stop()
        a.close()
        b.close()


@contextlib.contextmanager
def one_slow_pod_gateway(config, workers):
    """A gateway of `workers` worker threads in front of one pod that can hold requests, with a
    snapshot pushed that shows the pod idle: yields (envoy, pod, executor) and tears them down,
    releasing whatever the pod still holds."""
    slow = StubPod("slow-0")
    e = Envoy("filter", [{"name": "llama", "endpoints": [slow.address]}], config, concurrency=workers)
    ex = concurrent.futures.ThreadPoolExecutor(8)  # six held, and the probe
    try:
        assert e.push(snapshot({"llama": [{"address": slow.address, "waiting": 0, "running": 0}]}))[0] == 204
        yield e, slow, ex
    finally:
        if slow.hold is not None:
            slow.hold.set()
        ex.shutdown(wait=True)
        e.stop()
        slow.close()


def hold_six(e, slow, ex, gap_s=0.0):
    """Six requests on six connections, `gap_s` apart, that `slow` holds until `slow.hold` is
    set; returns their futures once all six have reached the pod."""
    slow.hold = threading.Event()
    held = []
    for i in range(6):
        held.append(ex.submit(e.chat, "llama-3-8b", f"held {i}", timeout=120))
        if gap_s:
            time.sleep(gap_s)
    deadline = time.time() + 30
    while len(slow.requests) < 6 and time.time() < deadline:
        time.sleep(0.02)
    assert len(slow.requests) == 6, "the held requests did not all reach the pod"
    return held


def route_on_every_worker(e, workers):
    """Quick requests on new connections until each of Envoy's `workers` has routed one (the
    kernel picks the worker of each connection)."""
    per_worker = e.worker_connections
    for _ in range(200):
        if sum(1 for n in per_worker().values() if n > 0) >= workers:
            return
        assert e.chat("llama-3-8b", "warm")[0] == 200
    raise AssertionError(f"not every worker routed: {per_worker()}")


def probe_sheddable(e, slow, ex, probed, what):
    """Sends sheddable probes while `slow` holds requests that saturate its pool, until `probed`
    workers have answered at least three each (the kernel picks the worker of each connection):
    every probe must be refused (429). A probe routed to the pod instead ends the loop and fails
    the test with `what`. A routed probe is held too, so it is not waited for: it only has to
    reach the pod, which a refused one never does."""
    per_worker = e.worker_connections
    before = per_worker()
    statuses, hit = [], []
    deadline = time.time() + 60
    while len(statuses) < 80 and time.time() < deadline:
        probe = ex.submit(e.chat, "llama-3-8b", "probe", headers={"x-gateway-priority": "-1"}, timeout=120)
        while not probe.done() and not any(r["body"].find('"probe"') >= 0 for r in slow.requests):
            time.sleep(0.002)
        statuses.append(probe.result()[0] if probe.done() else "routed to the pod")
        hit = [w for w, n in per_worker().items() if n - before.get(w, 0) >= 3]
        if statuses[-1] != 429 or (len(hit) >= probed and len(statuses) >= 8):
            break
    assert statuses == [429] * len(statuses), f"{what}: {statuses}"
    assert len(hit) >= probed, f"the probes did not reach {probed} workers: {per_worker()} vs {before}"


@pytest.mark.parametrize("tick_ms,workers,peer_reads", [(None, 2, None), (600_000, 2, None), (None, 4, 1)],
                         ids=["default_tick", "no_tick", "four_workers_one_read"])
def test_in_flight_requests_count_across_worker_threads(tick_ms, workers, peer_reads):
    """Each worker counts its own requests at once and sees the other workers' through shared
    data. Six slow requests are held in flight on six connections, which the kernel spreads over
    Envoy's workers: whatever the split, one worker holds fewer than five of them itself.
    The snapshot says the pod's queue is empty, so only the gateway's own count can saturate it
    (queue_threshold 5). Sheddable probes on fresh connections must then get 429 on both workers;
    a worker blind to the other's requests would see fewer than five and route its probes.

    `no_tick`: the tick never runs during the test, so the workers learn of each other through
    the exchange on the request path alone. The worker that routed first took its id before the
    other had one; unless it re-reads the registry when it exchanges, it never reads the other's
    table. With the registry read on the tick only this fails unless the kernel puts five or
    six of the six connections on the worker that routed first (6 in 32). The held requests are sent 10 ms apart: a worker
    publishes its table at most once per `shared_refresh_ms`, and what it defers goes out with
    its next request or its tick, which never comes here.

    `four_workers_one_read`: four workers, and an exchange on the request path reads one other
    worker's table (`shared_peer_reads` 1), in turn. Every worker routes a quick request first,
    so each has read the others' (then empty) tables before the held requests start, and a
    worker's view of them comes from its exchanges and its ticks. A probe's exchange then reads
    one of three; the worker must still count the held requests of the other two, from what it
    read before: its ticks read the tables its exchanges did not reach since the tick before (a
    build whose tick read none of them routed probes here)."""
    # No re-push during the test (a new snapshot takes the held requests as reported), and a
    # snapshot that stays fresh however slowly this machine runs the test.
    config = dict(CONFIG, scoring={"stale_after_ms": 300_000})
    if tick_ms is not None:
        config["tick_ms"] = tick_ms
    if peer_reads is not None:
        config["shared_peer_reads"] = peer_reads
    with one_slow_pod_gateway(config, workers) as (e, slow, ex):
        if peer_reads is not None:
            # Every worker routes once (a quick answer: nothing stays in flight), then the ticks
            # that follow leave each worker's view of the others up to date and empty.
            route_on_every_worker(e, workers)
            time.sleep(0.2)
            slow.requests.clear()
        # The pod holds every request until the probes are done: they stay in flight however
        # long this takes (no fixed delay for a loaded machine to outrun).
        held = hold_six(e, slow, ex, gap_s=0.01 if tick_ms is not None else 0.0)
        assert not any(f.done() for f in held)
        # The design's bound, which the probes must not race: what a worker defers goes out
        # with its next tick, and the tables a worker's exchanges did not reach are read on its
        # tick, so within three ticks (60 ms) every worker counts every held request. Before
        # this wait the probes raced it, and lost now and then ([429, 200]).
        time.sleep(0.3)
        probe_sheddable(e, slow, ex, min(workers, 3), "a worker did not count the others' requests")
        slow.hold.set()
        assert all(f.result()[0] == 200 for f in held)


@pytest.mark.skipif(RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module's ticker wakes Envoy only when it has metrics")
def test_an_idle_worker_ticks_less_often_until_its_next_request(pods):
    """With nothing to exchange (no request routed, none finished) for five ticks, a worker's
    tick period doubles up to `idle_tick_ms`, so Envoy stops calling into an idle VM 50 times a
    second; its next routed request restores `tick_ms` (counted in `gpuroute.idle_wakes`). A
    request right after another finds the tick at `tick_ms` already. One worker, so every
    request reaches the same one."""
    wakes = f"{STAT_PREFIX}gpuroute.idle_wakes"
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 300_000}, idle_tick_ms=160))
    try:
        assert e.push(fresh(pods))[0] == 204
        assert e.chat("llama-3-8b", "first")[0] == 200  # a new worker ticks at tick_ms
        assert e.stats("idle_wakes").get(wakes, 0) == 0
        time.sleep(0.8)  # 5 quiet ticks (100 ms), then 40 + 80 + 160 ms
        assert e.chat("llama-3-8b", "after idling")[0] == 200
        assert e.chat("llama-3-8b", "right after")[0] == 200
        assert e.stats("idle_wakes").get(wakes, 0) == 1
        time.sleep(0.8)
        assert e.chat("llama-3-8b", "after idling again")[0] == 200
        assert e.stats("idle_wakes").get(wakes, 0) == 2
    finally:
        e.stop()


@pytest.mark.skipif(RUNTIME != "wasm", reason="proxy-wasm only: the dynamic module's ticker wakes Envoy only when it has metrics")
def test_a_woken_worker_ticks_at_tick_ms_again(pods):
    """The request that wakes a worker sets the tick period from its HTTP context, which Envoy
    applies to the worker's root context: the pick it counts (batched until the next tick)
    reaches Envoy's stats within a few ticks of 20 ms, not after the rest of a 1.3-2 s idle
    period. Three idle spells: a tick left slow would come within 300 ms by chance in about one
    spell in four."""
    picked = f"{STAT_PREFIX}gpuroute.pool.llama.requests.picked"
    e = Envoy("filter", pools_of(pods), dict(CONFIG, scoring={"stale_after_ms": 300_000}, idle_tick_ms=2000))
    try:
        assert e.push(fresh(pods))[0] == 204
        for spell in range(3):
            time.sleep(3.0)  # five quiet ticks, then 40 + 80 + ... + 640 ms: at least 1,280 now
            before = e.stats("requests.picked").get(picked, 0)
            assert e.chat("llama-3-8b", f"after spell {spell}")[0] == 200
            t0 = time.time()
            while e.stats("requests.picked").get(picked, 0) == before and time.time() - t0 < 5:
                time.sleep(0.005)
            waited = time.time() - t0
            assert waited < 0.3, f"the pick reached Envoy {waited:.3f} s after the waking request"
    finally:
        e.stop()


@pytest.mark.parametrize("workers,peer_reads,idle_ms", [(2, None, 160), (4, 1, 2560)], ids=["two_workers", "four_workers_one_read"])
def test_a_worker_back_from_idling_counts_the_others_requests(workers, peer_reads, idle_ms):
    """A worker whose tick slowed while it idled, and whose last look at the other workers'
    in-flight tables is from before they took requests that stay in flight, counts those
    requests on its next request: waking, it runs the tick's exchange first. Sheddable probes
    are refused on every worker probed, as in the test above.

    `four_workers_one_read`: the idle workers' ticks have slowed to 1.3-2.6 s when the held
    requests arrive, the probes follow once the workers holding them have published (0.3 s),
    and an exchange on the request path reads one of three other workers' tables; without the
    catch-up on waking, a probe could read the wrong one. (A build without it failed this in two
    of six runs: which worker each connection lands on decides it.) The dynamic module has one
    engine, which counts every request."""
    config = dict(CONFIG, scoring={"stale_after_ms": 300_000}, idle_tick_ms=idle_ms)
    if peer_reads is not None:
        config["shared_peer_reads"] = peer_reads
    with one_slow_pod_gateway(config, workers) as (e, slow, ex):
        # Every worker routes once, then idles long enough for its tick to reach the limit.
        route_on_every_worker(e, workers)
        time.sleep(0.8 if idle_ms <= 160 else 3.0)

        slow.requests.clear()
        held = hold_six(e, slow, ex)
        # The workers that took the held requests publish what they deferred with their next
        # tick (at tick_ms again: they routed), within three ticks; the probes must not race
        # that (as in the test above). The workers that took none are still at 1.3-2.6 s.
        time.sleep(0.8 if workers == 2 else 0.3)
        probe_sheddable(e, slow, ex, min(workers, 3), "a worker back from idling did not count the held requests")
        slow.hold.set()
        assert all(f.result()[0] == 200 for f in held)


def test_non_inference_paths_pass_through_untouched(envoy, pods):
    s, _, body, _ = envoy.request("GET", "/health")
    # No pool header was set, so the route table's catch-all answers.
    assert s == 404 and body["error"]["code"] == "not_found"


def test_sheddable_requests_get_429_when_every_pod_is_saturated(envoy, pods):
    saturated = [{"waiting": 9, "kv_cache_usage": 0.9}] * 3
    assert envoy.push(fresh(pods, saturated))[0] == 204
    s, h, body, _ = envoy.chat("llama-3-8b", headers={"x-gateway-priority": "-1"})
    assert s == 429 and body["error"]["type"] == "rate_limit_error"
    # With debug_header, the 429 says which pool shed it, in both builds (the dynamic module's
    # local reply had no debug header until 2026-12-07: Envoy skips the module's own
    # response_headers hook for a reply it sends).
    assert h.get("x-gateway-debug") == "pool=llama", h
    # Normal priority is still served, by the least bad pod.
    s, h, _, _ = envoy.chat("llama-3-8b")
    assert s == 200 and h["x-served-by"].startswith("llama-")
    # With one pod not saturated, a sheddable request is served too.
    saturated = [{"waiting": 9}, {"waiting": 0}, {"waiting": 9}]
    assert envoy.push(fresh(pods, saturated))[0] == 204
    s, h, _, _ = envoy.chat("llama-3-8b", headers={"x-gateway-priority": "-5"})
    assert s == 200 and h["x-served-by"] == "llama-1"
    assert envoy.stat(STAT_PREFIX + "gpuroute.pool.llama.requests.shed") >= 1


@pytest.mark.skipif(RUNTIME != "dynamic", reason="the dynamic-module build only")
def test_dynamic_module_abi_is_this_envoys(pods):
    """The module declares Envoy 1.40's ABI version: Envoy loads it without the "deprecated ABI"
    warning (an Envoy upgrade that changes the ABI fails here first)."""
    e = Envoy("filter", pools_of(pods), CONFIG)
    try:
        assert e.chat("qwen-7b")[0] == 200
    finally:
        e.stop()
    log = e.log()
    assert "ABI version" not in log, log[-2000:]


@pytest.mark.skipif(RUNTIME != "wasm", reason="the proxy-wasm build only (the module has one engine, no worker ids)")
def test_worker_ids_come_back_when_envoy_drops_a_configuration(pods, tmp_path):
    """Every change of the filter's configuration makes Envoy create a new plugin instance per
    worker and delete the old ones once drained. Each instance that routes takes a worker id; a
    deleted one must give it back (and empty its published tables), or every exchange keeps
    reading the dead workers' keys and the registry grows with each change. The gateway's
    listener comes from a file (LDS), rewritten four times with a different `tick_ms`; after each
    change requests on fresh connections reach both workers. The `gpuroute.workers` gauge (live
    ids in the registry) must stay at Envoy's two workers, and routing must keep working."""
    lds = LdsListener(tmp_path / "lds")
    e = Envoy("filter", pools_of(pods), CONFIG, concurrency=2, workdir=tmp_path / "envoy", patch=lds.patch,
              envoy_args=lds.envoy_args)
    try:
        def route_on_fresh_connections():
            # The kernel spreads fresh connections over both workers.
            for i in range(16):
                s, h, _, _ = e.chat("llama-3-8b", f"reload {i}")
                assert s == 200 and h["x-served-by"].startswith("llama-"), (s, h)

        def live_workers():
            time.sleep(0.1)  # the gauge is set on the tick (20 ms)
            return e.stats(r"gpuroute\.workers$").get(STAT_PREFIX + "gpuroute.workers")

        def routed_by_two_live_workers():
            # The old instances go once their filter chain has drained (1 s here); routing on
            # fresh connections until both new workers have taken an id.
            deadline = time.time() + 10
            route_on_fresh_connections()
            while time.time() < deadline and live_workers() != 2:
                route_on_fresh_connections()
            return live_workers()

        assert e.push(fresh(pods))[0] == 204
        assert routed_by_two_live_workers() == 2
        for k in range(1, 5):
            lds.change(e, timeout_s=10, tick_ms=20 + k)
            live = routed_by_two_live_workers()
            assert live == 2, f"worker ids not given back after change {k}: {live} live"
        time.sleep(1.5)  # every old instance has drained and gone
        assert routed_by_two_live_workers() == 2
        assert e.alive()
        assert "gpuroute" not in e.log(), e.log()[-2000:]
    finally:
        e.stop()
