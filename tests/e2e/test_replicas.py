"""The prefix-record exchange between gateway replicas (`ingest.prefix_path`), through real
Envoys with the built filter: what an Envoy gives (`GET`), what it takes (`POST`), and what it
refuses. The relay itself (sidecar-metrics between two replicas) is measured in
test_affinity.py.
"""

import socket
import struct
import time

import pytest

from harness import STAT_PREFIX, TOKEN, Envoy, Pusher, wait_for
from stubpod import serving

PREFIX = "/gpuroute/v1/prefix"
CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}], "debug_header": True}
SYSTEM = "You are the support assistant of a bicycle shop; answer in two sentences at most. " * 3


def records(raw):
    """(seq, pod, anchors) of each record of a GPX1 body."""
    assert raw[:4] == b"GPX1", raw[:16]
    out, i = [], 4
    while i < len(raw):
        seq, pod, n = struct.unpack_from("<QQB", raw, i)
        i += 17 + 8 * n
        out.append((seq, pod, n))
    assert i == len(raw)
    return out


def ask(gw, cursor="", token=TOKEN):
    return gw.request("GET", PREFIX, None,
                      {"authorization": f"Bearer {token}", "x-gpuroute-cursor": cursor}, addr=gw.ingest)


def give(gw, body, token=TOKEN):
    return gw.request("POST", PREFIX, body,
                      {"authorization": f"Bearer {token}", "content-type": "application/octet-stream"},
                      addr=gw.ingest)


def turn(gw, user, answer=None, follow=None):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    if follow:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow}]
    s, h, _, _ = gw.request("POST", "/v1/chat/completions", {"model": "llama-3-8b", "messages": messages})
    assert s == 200
    return h


def prefix_scores(h):
    """Each candidate's prefix score from the debug header (0 where it has none)."""
    out = {}
    for part in h.get("x-gateway-debug", "").split("; ")[2:]:
        if part.startswith("left-out="):
            continue
        addr, _, rest = part.partition(" ")
        score = [kv.split("=")[1] for kv in rest.split() if kv.startswith("prefix=")]
        out[addr] = float(score[0]) if score else 0.0
    return out


@pytest.fixture(scope="module")
def pods():
    with serving([f"pod-{i}" for i in range(4)]) as pods:
        yield list(pods.values())


def gateway(pods, loads=None, config=None):
    gw = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}],
               dict(CONFIG, **(config or {})), concurrency=2)
    loads = loads or [{}] * len(pods)
    pusher = Pusher([gw], {"llama": [{"address": p.address, **l} for p, l in zip(pods, loads)]})
    return gw, pusher


def test_an_envoy_gives_each_routing_decision_once(pods):
    gw, pusher = gateway(pods)
    try:
        s, h, _, raw = ask(gw)
        assert s == 200 and h["content-type"] == "application/octet-stream"
        assert records(raw) == []
        cursor = h["x-gpuroute-cursor"]
        for i in range(6):
            turn(gw, f"Customer {i} asks: is the blue touring bike in stock in size 56?")
        got, deadline = [], time.time() + 3
        while len(got) < 6 and time.time() < deadline:
            time.sleep(0.06)
            s, h, _, raw = ask(gw, cursor)
            assert s == 200
            got += records(raw)
            cursor = h["x-gpuroute-cursor"]
        assert len(got) == 6, got
        assert all(n > 0 for _, _, n in got)
        # Asked again with the cursor: nothing new. Without one: everything held, again.
        time.sleep(0.15)
        assert records(ask(gw, cursor)[3]) == []
        assert len(records(ask(gw)[3])) == 6
        assert gw.stat(STAT_PREFIX + "gpuroute.prefix.exported") >= 12
    finally:
        pusher.stop()
        gw.stop()


def test_a_replica_learns_where_another_sent_a_conversation(pods):
    """Replica A routes a conversation's first turn while pod-0 is the only idle pod, so it goes
    there whatever its home. B (every pod equally loaded) is given A's records; C, the same as B,
    is not. On the follow-up turn B scores pod-0 as holding the conversation's prefix; C does
    not (at most the rendezvous home's 0.3)."""
    busy = {"waiting": 6, "running": 30, "kv_cache_usage": 0.8}
    a, pa = gateway(pods, [{}] + [busy] * 3)
    b, pb = gateway(pods)
    c, pc = gateway(pods)
    try:
        cursor = ask(a)[1]["x-gpuroute-cursor"]
        first = "I bought a frame last week and the bottom bracket creaks on every climb."
        h = turn(a, first)
        assert "picked=" + pods[0].address in h["x-gateway-debug"], h["x-gateway-debug"]
        got, deadline = b"", time.time() + 3
        while time.time() < deadline:
            time.sleep(0.06)
            s, h, _, raw = ask(a, cursor)
            if records(raw):
                got = raw
                break
        assert len(records(got)) == 1
        assert give(b, got)[0] == 204
        assert b.stat(STAT_PREFIX + "gpuroute.prefix.imported") == 1
        follow = ("Please re-grease it.", "Done; it still creaks. What next?")
        sb = prefix_scores(turn(b, first, *follow))
        sc = prefix_scores(turn(c, first, *follow))
        print(f"\nprefix scores of the follow-up: with A's records {sb}, without {sc}")
        assert sb[pods[0].address] > 0.3, sb
        assert sc.get(pods[0].address, 0.0) <= 0.3, sc
    finally:
        for p in (pa, pb, pc):
            p.stop()
        for g in (a, b, c):
            g.stop()


def test_a_replica_keeps_a_stored_response_however_many_prompts_follow(pods):
    """Replica A serves a Responses API answer; B learns its id from A's records, then routes 150
    unique prompts with a prefix index of 64 entries, which each prompt adds several to. The turn
    continuing the response still goes to the pod that holds it, the busiest, and so does the
    response's `GET`: ids have a table of their own (`response_entries`), which prompts do not
    push them out of. (When ids lived in the prefix index, the prompts flushed this one.)"""
    small = {"prefix": {"index_entries": 64}}
    a, pa = gateway(pods, config=small)
    b = pb = None
    try:
        cursor = ask(a)[1]["x-gpuroute-cursor"]
        s, h, first, _ = a.request("POST", "/v1/responses", {"model": "llama-3-8b", "input": "remember 42"})
        assert s == 200 and first["id"].startswith("resp_"), first
        held = next(p for p in pods if p.name == h["x-served-by"])
        # The answer's id is one record of one key; the request's routing decision another.
        got, deadline = b"GPX1", time.time() + 3
        while time.time() < deadline and not any(n == 1 for _, _, n in records(got)):
            time.sleep(0.06)
            s, hh, _, raw = ask(a, cursor)
            got += raw[4:]
            cursor = hh["x-gpuroute-cursor"]
        assert any(n == 1 for _, _, n in records(got)), records(got)
        busy = {"waiting": 6, "running": 30, "kv_cache_usage": 0.7}
        b, pb = gateway(pods, [busy if p is held else {} for p in pods], config=small)
        assert give(b, got)[0] == 204
        for i in range(150):
            s, _, _, _ = b.request("POST", "/v1/completions",
                                   {"model": "llama-3-8b", "prompt": f"unrelated request {i}: " * 24})
            assert s == 200
        turn = {"model": "llama-3-8b", "previous_response_id": first["id"], "input": "what was it?"}
        for _ in range(4):
            s, h, _, _ = b.request("POST", "/v1/responses", turn)
            assert (s, h["x-served-by"]) == (200, held.name), h
            assert h["x-gateway-debug"].startswith("previous-response; pool=llama"), h["x-gateway-debug"]
        s, h, body, _ = b.request("GET", f"/v1/responses/{first['id']}")
        assert (s, h.get("x-served-by")) == (200, held.name), (s, body)
        # Without the record, B routes the turn by load: not to the busiest pod.
        c, pc = gateway(pods, [busy if p is held else {} for p in pods], config=small)
        try:
            assert c.request("POST", "/v1/responses", turn)[1]["x-served-by"] != held.name
        finally:
            pc.stop()
            c.stop()
    finally:
        for p in (pa, pb):
            if p is not None:
                p.stop()
        for g in (a, b):
            if g is not None:
                g.stop()


def test_the_exchange_refuses_what_it_cannot_use_and_keeps_serving(pods):
    gw, pusher = gateway(pods)
    try:
        assert ask(gw, token="wrong-token-123")[0] == 401
        assert give(gw, b"GPX1", token="wrong-token-123")[0] == 401
        s, h, err, _ = gw.request("PUT", PREFIX, b"", {"authorization": f"Bearer {TOKEN}"}, addr=gw.ingest)
        assert s == 405 and err["error"]["code"] == "method_not_allowed" and h["allow"] == "GET, POST"
        for bad in (b"", b'{"records": []}', b"GPX1" + b"\x01" * 20, b"GPX1" + bytes(17) + b"\x00"):
            s, _, err, _ = give(gw, bad)
            assert s == 400 and err["error"]["code"] == "invalid_prefix_records", (bad, s, err)
        # Over the size limit (8 MiB by default), declared: refused before the body is read.
        host, port = gw.ingest.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nauthorization: Bearer %s\r\n"
                         b"content-length: %d\r\n\r\n" % (PREFIX.encode(), TOKEN.encode(), 9 * 1024 * 1024))
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413") and b"prefix_records_too_large" in answer, answer[:300]
        # An empty batch is fine; a cursor that is garbage asks for everything.
        assert give(gw, b"GPX1")[0] == 204
        assert ask(gw, "x:y,,1")[0] == 200
        assert gw.stat(STAT_PREFIX + "gpuroute.prefix.rejected.invalid") == 4
        assert gw.stat(STAT_PREFIX + "gpuroute.prefix.rejected.unauthorized") == 2
        assert gw.stat(STAT_PREFIX + "gpuroute.prefix.rejected.too_large") == 1
        # Not on the traffic listener's clients' terms: the exchange answers only loopback
        # peers with the token, and routing goes on.
        assert turn(gw, "Still serving?")
    finally:
        pusher.stop()
        gw.stop()


def relaying_replicas(members, concurrency=1, tls=False):
    """Gateway replicas as deployed: one Envoy per list of pods in `members`, each with its own
    sidecar-metrics scraping those pods, the sidecars each other's peers (two replicas); with
    `tls`, over mutual TLS (`prefix.tls`, testdata/tls/'s peer certificate)."""
    from harness import ROOT, Sidecar, free_port

    gws = [Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in m]}], CONFIG, concurrency=concurrency)
           for m in members]
    ports = [free_port(), free_port()]
    scheme = "https" if tls else "http"
    files = ROOT / "testdata" / "tls"

    def prefix(i):
        p = {"listen": f"127.0.0.1:{ports[i]}", "peers": [f"{scheme}://127.0.0.1:{ports[1 - i]}"]}
        if tls:
            p["tls"] = {"ca_file": str(files / "ca.pem"), "cert_file": str(files / "peer.pem"),
                        "key_file": str(files / "peer.key"), "server_name": "gpuroute-peers"}
        return p

    scs = [Sidecar({"llama": [p.address for p in members[i]]}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"],
                   interval_ms=100, extra={"prefix": prefix(i)})
           for i, gw in enumerate(gws)]
    return gws, scs


def relay_up(a, scs):
    """Waits for the sidecars to be ready, then registers replica A's worker with a first
    request and gives the relay time to ask it."""
    deadline = time.time() + 10
    while not all(sc.ready() for sc in scs) and time.time() < deadline:
        time.sleep(0.05)
    turn(a, "warm-up: a first request registers A's worker")
    time.sleep(0.5)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "mutual-tls"])
def test_a_decision_reaches_the_other_replica_through_the_relay(pods, tls):
    """Two replicas as deployed, each Envoy with its own sidecar-metrics, the sidecars each
    other's peers (plain HTTP, or mutual TLS: `prefix.tls`). Measured (printed with -s): the
    time from a request routed on A until B's Envoy has taken its record
    (`gpuroute.prefix.imported`). The path: A's worker writes its records for the exchange (at
    most every 50 ms), A's sidecar asks (every 50 ms) and posts to B's sidecar, which posts to
    B's Envoy; B's workers then apply it on their next tick (`tick_ms`, 20 ms)."""
    import statistics

    gws, scs = relaying_replicas([pods, pods], tls=tls)
    a, b = gws
    name = STAT_PREFIX + "gpuroute.prefix.imported"
    try:
        relay_up(a, scs)
        waits = []
        for i in range(20):
            before = b.stats(name).get(name, 0)
            t0 = time.time()
            turn(a, f"Customer {i} asks whether the frame bag fits a 52 cm gravel frame.")
            while b.stats(name).get(name, 0) == before and time.time() - t0 < 3:
                time.sleep(0.003)
            waits.append((time.time() - t0) * 1000)
            time.sleep(0.13)  # out of step with the 50 ms periods
        waits.sort()
        p50, p90 = statistics.median(waits), waits[int(0.9 * len(waits)) - 1]
        print(f"\nrelay ({'mutual TLS' if tls else 'plain'}): routed on A -> taken by B's Envoy, ms: "
              f"p50 {p50:.0f}, p90 {p90:.0f}, max {waits[-1]:.0f}")
        # Two 50 ms periods in series, plus two HTTP hops on loopback; 3 s means never.
        assert waits[-1] < 1000, waits
        assert p50 < 250, waits
    finally:
        for sc in scs:
            sc.stop()
        for gw in gws:
            gw.stop()


def test_a_replicas_decisions_still_reach_the_other_after_its_envoy_restarts(pods):
    """Replica A's Envoy restarts while its sidecar-metrics keeps running (the Envoy container
    of the pod restarts alone). The sidecar's cursor into A's decisions is from before the
    restart, and the new Envoy numbers its decisions from the start again (the dynamic module
    from 1, the proxy-wasm workers from their generation's base): the relay reads an exporter
    whose records all number below the cursor from its start. Before, A's decisions after the
    restart were skipped until A had routed as many as before it (a relay audit: 0 of 10 with
    the dynamic module)."""
    gws, scs = relaying_replicas([pods, pods])
    a, b = gws
    name = STAT_PREFIX + "gpuroute.prefix.imported"

    def relayed(n, question, timeout=3.0):
        before = b.stats(name).get(name, 0)
        for i in range(n):
            turn(a, f"{question} ({i})")
        t0 = time.time()
        while b.stats(name).get(name, 0) < before + n and time.time() - t0 < timeout:
            time.sleep(0.05)
        return b.stats(name).get(name, 0) - before

    try:
        relay_up(a, scs)
        assert relayed(30, "Before the restart: does the frame bag fit a 52 cm gravel frame?") == 30
        listen, admin, ingest = a.listen, a.admin, a.ingest
        a.stop()
        a = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG,
                  listen=listen, admin=admin, ingest=ingest)
        gws[0] = a
        # The sidecar pushes the new Envoy a snapshot and asks it for its decisions meanwhile.
        deadline = time.time() + 10
        while not a.stats(STAT_PREFIX + "gpuroute.snapshot.accepted").get(
                STAT_PREFIX + "gpuroute.snapshot.accepted", 0) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert relayed(10, "After the restart: which chain fits an eleven-speed cassette?") == 10
    finally:
        for sc in scs:
            sc.stop()
        for gw in gws:
            gw.stop()


def test_a_restarted_envoys_decisions_past_the_relays_old_cursor_reach_the_other(pods):
    """As above, but the restarted Envoy routes more decisions than the relay's old cursor
    counts before the relay reads them: its records then number past that cursor, and only the
    cursor's epoch, the Envoy process that wrote it, tells the Envoy the cursor is not its own.
    Asked here as the relay asks (a GET with the cursor, again every 60 ms with the one it
    answered), so no timing decides what is asked when. Twice: 40 decisions before the first
    ask after the restart (the proxy-wasm workers keep theirs; the dynamic module keeps an
    outgoing log only from that ask on), then 40 more between two asks. Before epochs, only the
    records past the old cursor came, which counted 30: 50 of 80 with proxy-wasm (10 of the first
    40), 10 of 40 with the module (of the second)."""
    from harness import RUNTIME

    gw, pusher = gateway(pods)

    def drain(cursor, want, timeout=3.0):
        got, deadline = [], time.time() + timeout
        while time.time() < deadline:
            s, h, _, raw = ask(gw, cursor)
            assert s == 200
            got += records(raw)
            cursor = h["x-gpuroute-cursor"]
            if len(got) >= want:
                time.sleep(0.3)  # and nothing more comes
                s, h, _, raw = ask(gw, cursor)
                got += records(raw)
                return got, h["x-gpuroute-cursor"]
            time.sleep(0.06)
        return got, cursor

    def route(n, when):
        for i in range(n):
            turn(gw, f"{when}: which chain fits an eleven-speed cassette? ({i})")

    try:
        # Asked first, as a relay beside it would have (the module logs from then on).
        cursor = ask(gw)[1]["x-gpuroute-cursor"]
        route(30, "Before the restart")
        got, cursor = drain(cursor, 30)
        assert len(got) == 30
        listen, admin, ingest = gw.listen, gw.admin, gw.ingest
        gw.stop()
        # The Pusher goes on pushing to the same address, now the new Envoy's.
        gw = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG,
                   concurrency=2, listen=listen, admin=admin, ingest=ingest)
        wait_for(lambda: gw.stats().get(STAT_PREFIX + "gpuroute.snapshot.accepted", 0) > 0,
                 timeout=10, what="a snapshot in the new Envoy")
        route(40, "Before the relay's first ask")
        first, cursor = drain(cursor, 40, timeout=1.5)
        route(40, "Between two asks")
        second, _ = drain(cursor, 40)
        want = (0, 40) if RUNTIME == "dynamic" else (40, 40)
        assert (len(first), len(second)) == want
    finally:
        pusher.stop()
        gw.stop()


LOAD = "/gpuroute/v1/load"


def load_counts(raw):
    """{pool: sorted list of (requests, tokens) per pod} of a GPL1 body (`ingest.load_path`)."""
    assert raw[:4] == b"GPL1", raw[:16]
    (pools,), i, out = struct.unpack_from("<I", raw, 4), 8, {}
    for _ in range(pools):
        (n,) = struct.unpack_from("<H", raw, i)
        name, i = raw[i + 2:i + 2 + n].decode(), i + 2 + n
        (count,), i = struct.unpack_from("<I", raw, i), i + 4
        pods = []
        for _ in range(count):
            _key, requests, tokens = struct.unpack_from("<QII", raw, i)
            pods.append((requests, tokens))
            i += 16
        out[name] = sorted(pods)
    assert i == len(raw)
    return out


def ask_load(gw, token=TOKEN):
    return gw.request("GET", LOAD, None, {"authorization": f"Bearer {token}"}, addr=gw.ingest)


def give_load(gw, body, replica="replica-a", token=TOKEN):
    headers = {"authorization": f"Bearer {token}", "content-type": "application/octet-stream"}
    if replica is not None:
        headers["x-gpuroute-replica"] = replica
    return gw.request("POST", LOAD, body, headers, addr=gw.ingest)


EMPTY_COUNTS = b"GPL1\x00\x00\x00\x00"


def bundle(entries):
    """Several replicas' counts in one body (GPB1), as sidecar-metrics bundles them:
    `entries` are (replica name, GPL1 body) pairs."""
    out = b"GPB1" + struct.pack("<H", len(entries))
    for name, body in entries:
        out += struct.pack("<B", len(name)) + name.encode() + struct.pack("<I", len(body)) + body
    return out


def streamed(gw, text, timeout=30):
    body = {"model": "llama-3-8b", "stream": True, "messages": [{"role": "user", "content": text}]}
    return gw.request("POST", "/v1/chat/completions", body, timeout=timeout)


def queue_scores(h):
    """Each candidate's queue score from the debug header (1.0: nothing queued or prefilling
    there as far as the gateway knows)."""
    out = {}
    for part in h.get("x-gateway-debug", "").split("; ")[2:]:
        addr, _, rest = part.partition(" ")
        for kv in rest.split():
            if kv.startswith("queue="):
                out[addr] = float(kv.split("=")[1])
    return out


def until_nothing_counted(gw, question, timeout_s=5):
    """Sends `question` (numbered) through `gw` until a decision's breakdown shows no queue or
    prefill on any pod; returns the breakdowns seen, the last one clear (or fails after
    `timeout_s`)."""
    seen, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        s, h, _, _ = gw.chat("llama-3-8b", f"{question} ({len(seen)})")
        assert s == 200
        seen.append(queue_scores(h))
        if seen[-1] and all(q == 1.0 for q in seen[-1].values()):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"still counting load after {timeout_s} s: {seen[-3:]}")


def start_held_prefills(gw, pods, hold, question, n=9):
    """Sends `n` streamed chat requests through `gw` from threads; `pods` hold each before its
    first byte until `hold` is set, so each stays in prefill on the gateway's view. Returns the
    threads once every request reached its pod."""
    import threading

    for p in pods:
        p.hold = hold
    before = sum(len(p.requests) for p in pods)
    threads = []
    for i in range(n):
        t = threading.Thread(target=streamed, args=(gw, f"{question} ({i})? " * 4), daemon=True)
        t.start()
        threads.append(t)
    deadline = time.time() + 10
    while sum(len(p.requests) for p in pods) < before + n and time.time() < deadline:
        time.sleep(0.02)
    assert sum(len(p.requests) for p in pods) == before + n, [len(p.requests) for p in pods]
    return threads


def published_prefills(gw, n, timeout=5):
    """`GET ingest.load_path` of `gw` once its answer counts `n` requests in prefill (every
    worker's table published: a worker that published within `shared_refresh_ms` publishes
    again with its next request or tick, later on a loaded host), or at `timeout`: (status, raw
    answer, the counts)."""
    deadline = time.time() + timeout
    while True:
        s, _, _, raw = ask_load(gw)
        counts = load_counts(raw) if s == 200 else {}
        if sum(r for r, _ in counts.get("llama", [])) == n or time.time() > deadline:
            return s, raw, counts
        time.sleep(0.02)


def test_a_replica_routes_around_the_prefills_another_replica_started(pods):
    """Replica A, whose pool is pods 0-2, sends nine streamed requests that the pods hold before
    their first byte: in prefill on A's view. A's `GET ingest.load_path` gives them, per pod;
    posted to replica B (pods 0-3, every pod idle in its snapshot), B sends four new prompts to
    the one pod without them, pod-3. Once the post is older than `ingest.load_ttl_ms` it is
    forgotten: B counts nothing on any pod again."""
    import threading

    a, pa = gateway(pods[:3])
    b, pb = gateway(pods)
    hold = threading.Event()
    threads = []
    try:
        s, h, _, raw = ask_load(a)
        assert s == 200 and h["content-type"] == "application/octet-stream"
        assert load_counts(raw) == {}, "nothing in flight yet"
        threads = start_held_prefills(a, pods[:3], hold, "Does the rear rack fit a bike with disc brakes")
        s, raw, counts = published_prefills(a, 9)
        print(f"\nA's requests in prefill per pod: {counts}")
        assert s == 200 and sum(r for r, _ in counts["llama"]) == 9, counts
        assert all(t > 0 for _, t in counts["llama"]), "their prompt tokens travel with them"
        assert a.stat(STAT_PREFIX + "gpuroute.replica_load.exported") >= 2

        assert give_load(b, raw)[0] == 204
        assert b.stat(STAT_PREFIX + "gpuroute.replica_load.imported") == 1
        # Posted again every 5 ms, as the relay does, now in a bundle with another replica's
        # (empty) counts, as a sidecar with several peers posts them: each entry counts on its
        # own. B's workers take the counts in on their next tick (`tick_ms`), and from then on at
        # every exchange.
        both = bundle([("replica-a", raw), ("replica-c", EMPTY_COUNTS)])
        assert give_load(b, both, replica=None)[0] == 204
        assert b.stat(STAT_PREFIX + "gpuroute.replica_load.imported") == 3
        posting = threading.Event()

        def post():
            while not posting.wait(0.005):
                give_load(b, both, replica=None)

        poster = threading.Thread(target=post, daemon=True)
        poster.start()
        time.sleep(0.2)
        served = []
        for i in range(4):
            s, h, _, _ = b.chat("llama-3-8b", f"A new question {i} about saddle heights and knee pain.", timeout=5)
            assert s == 200
            served.append(h["x-served-by"])
        posting.set()
        poster.join()
        print(f"B's picks with A's prefills known: {served}")
        assert served == [pods[3].name] * 4, served
    finally:
        hold.set()
        for p in pods[:3]:
            p.hold = None
        for t in threads:
            t.join(timeout=30)
        pa.stop()
        a.stop()
    try:
        # The post is older than the ttl (50 ms): B counts nothing on any pod again.
        time.sleep(0.2)
        seen = until_nothing_counted(b, "Another question about tubeless tyres")
        print(f"B's queue scores once the post expired: {seen[-1]} (after {len(seen)} requests)")
        assert len(seen) == 1, seen
    finally:
        pb.stop()
        b.stop()


def test_the_load_exchange_refuses_what_it_cannot_use_and_keeps_serving(pods):
    gw, pusher = gateway(pods)
    try:
        assert ask_load(gw, token="wrong-token-123")[0] == 401
        assert give_load(gw, b"GPL1\x00\x00\x00\x00", token="wrong-token-123")[0] == 401
        s, h, err, _ = gw.request("PUT", LOAD, b"", {"authorization": f"Bearer {TOKEN}"}, addr=gw.ingest)
        assert s == 405 and err["error"]["code"] == "method_not_allowed" and h["allow"] == "GET, POST"
        bad_bodies = (b"", b"GPX1\x00\x00\x00\x00", b"GPL1\x01\x00\x00\x00", b"GPL1\x00\x00\x00\x00\x00")
        for bad in bad_bodies:
            s, _, err, _ = give_load(gw, bad)
            assert s == 400 and err["error"]["code"] == "invalid_replica_load", (bad, s, err)
        for replica in (None, "", "has space", "x" * 129):
            s, _, err, _ = give_load(gw, EMPTY_COUNTS, replica=replica)
            assert s == 400 and err["error"]["code"] == "invalid_replica_load", (replica, s, err)
            assert "x-gpuroute-replica" in err["error"]["message"]
        # A bundle is taken or refused whole: one bad entry, and none of it counts.
        good = ("replica-b", EMPTY_COUNTS)
        bad_bundles = (bundle([good, ("has space", EMPTY_COUNTS)]), bundle([good, ("replica-c", b"GPL1")]),
                       bundle([good]) + b"\x00", bundle([good])[:-1], b"GPB1" + struct.pack("<H", 257))
        for bad in bad_bundles:
            s, _, err, _ = give_load(gw, bad, replica=None)
            assert s == 400 and err["error"]["code"] == "invalid_replica_load", (bad, s, err)
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.imported") == 0
        assert give_load(gw, bundle([good, ("replica-c", EMPTY_COUNTS)]), replica=None)[0] == 204
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.imported") == 2
        host, port = gw.ingest.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nauthorization: Bearer %s\r\nx-gpuroute-replica: r\r\n"
                         b"content-length: %d\r\n\r\n" % (LOAD.encode(), TOKEN.encode(), 9 * 1024 * 1024))
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413") and b"replica_load_too_large" in answer, answer[:300]
        assert give_load(gw, EMPTY_COUNTS)[0] == 204
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.rejected.invalid") == len(bad_bodies) + 4 + len(bad_bundles)
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.rejected.unauthorized") == 2
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.rejected.too_large") == 1
        assert turn(gw, "Still serving?")
    finally:
        pusher.stop()
        gw.stop()


def test_through_the_relay_a_replica_routes_around_another_replicas_prefills(pods):
    """Two replicas as deployed: each Envoy with its own sidecar-metrics, the sidecars each
    other's peers, relaying every 5 ms (`prefix.load_interval_ms`) what each Envoy has in
    prefill. A (pods 0-2) starts nine streamed requests that the pods hold before their first
    byte; B (pods 0-3, all idle as its own aggregator scrapes them) then sends four new prompts
    to pod-3, the one pod A is not prefilling on. Once A's requests are answered its counts are
    zero, relayed as such, and B counts nothing on any pod again."""
    import threading

    (a, b), scs = relaying_replicas([pods[:3], pods], concurrency=2)
    hold = threading.Event()
    threads = []
    try:
        deadline = time.time() + 10
        while not all(sc.ready() for sc in scs) and time.time() < deadline:
            time.sleep(0.05)
        assert all(sc.ready() for sc in scs)
        threads = start_held_prefills(a, pods[:3], hold, "Which chain fits an eleven-speed cassette")
        assert sum(r for r, _ in published_prefills(a, 9)[2].get("llama", [])) == 9
        time.sleep(0.1)  # a few relay rounds, and B's workers' next exchange
        served = [b.chat("llama-3-8b", f"New question {i}: how tight should a stem bolt be?", timeout=5)[1]
                  ["x-served-by"] for i in range(4)]
        relayed = scs[0].metric('gpuroute_sidecar_replica_load_relayed_total{direction="out"}')
        taken = b.stat(STAT_PREFIX + "gpuroute.replica_load.imported")
        print(f"\nB's picks while A prefills on pods 0-2: {served}; A's counts relayed {relayed} times, "
              f"taken by B {taken} times")
        assert served == [pods[3].name] * 4, served
        hold.set()
        for t in threads:
            t.join(timeout=30)
        # A's counts are zero now, relayed as such (or, if that post is lost, expired within
        # `ingest.load_ttl_ms`): B counts nothing on any pod again.
        time.sleep(0.1)
        seen = until_nothing_counted(b, "Another question about brake pads")
        print(f"B's queue scores once A's requests were answered: {seen[-1]} (after {len(seen)} requests)")
    finally:
        hold.set()
        for p in pods[:3]:
            p.hold = None
        for sc in scs:
            sc.stop()
        for gw in (a, b):
            gw.stop()


def test_a_sidecar_hands_its_envoy_at_most_six_posts_of_peers_counts_an_interval(pods):
    """One replica as deployed (an Envoy and its sidecar-metrics) and eight other replicas'
    sidecars, played by this test, posting their counts to the sidecar's `POST /v1/load`. The
    sidecar posts its Envoy the peers' counts as they come, but at most six posts in any
    `prefix.load_interval_ms` (1 s here): the first six replicas' counts go at once, the next
    two wait until the first post is an interval old and go together, in one bundle, and the
    Envoy takes each replica's entry. Counts the filter would refuse are refused at the
    sidecar, not bundled."""
    import threading
    import urllib.error
    import urllib.request

    from harness import Sidecar, free_port

    gw = Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG)
    listen = f"127.0.0.1:{free_port()}"
    sc = Sidecar({"llama": [p.address for p in pods]}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"],
                 interval_ms=100,
                 extra={"prefix": {"listen": listen, "peers": [f"http://127.0.0.1:{free_port()}"],
                                   "load_interval_ms": 1000}})

    def post(replica, body=EMPTY_COUNTS):
        req = urllib.request.Request(f"http://{listen}/v1/load", data=body, method="POST",
                                     headers={"authorization": f"Bearer {TOKEN}", "x-gpuroute-replica": replica})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        time.sleep(1)  # the sidecar's own first reads and pushes are done
        assert post("replica-x", b"GPL1 not counts") == 400
        t0 = time.time()
        took = []
        for r in range(1, 7):
            assert post(f"replica-{r}") == 204
            took.append(time.time() - t0)
        statuses = []
        posters = [threading.Thread(target=lambda r=r: statuses.append(post(r))) for r in ("replica-7", "replica-8")]
        for t in posters:
            t.start()
        for t in posters:
            t.join()
        together = time.time() - t0
        print(f"\nsix replicas' counts taken after {', '.join(f'{t * 1000:.1f}' for t in took)} ms, the next two's "
              f"after {together * 1000:.1f} ms")
        assert took[-1] < 0.5 and statuses == [204, 204] and together >= 0.9, (took, statuses, together)
        # The Envoy took eight replicas' counts; the last two came in one bundle.
        assert gw.stat(STAT_PREFIX + "gpuroute.replica_load.imported") == 8
        assert sc.metric("gpuroute_sidecar_replica_load_bundled_total") == 2
        assert sc.metric('gpuroute_sidecar_replica_load_relayed_total{direction="in"}') == 8
    finally:
        sc.stop()
        gw.stop()
