"""HTTP/2 clients. The shipped gateway listener takes HTTP/1.1 and HTTP/2 alike (the connection
manager's `AUTO` codec), and behind a TLS-terminating gateway most clients speak HTTP/2. Over
HTTP/2 a body comes in DATA frames, several requests share one connection, and a request may end
with trailers or an empty frame instead of with its last bytes: the filter must route and answer
them as it does HTTP/1.1 requests. The client here speaks HTTP/2 with prior knowledge (h2c) over
plain TCP, frame by frame."""

import json
import socket
import time

import h2.config
import h2.connection
import h2.events
import pytest

from harness import TOKEN, Envoy, snapshot
from stubpod import serving

MAX_BODY = 16_384
CONFIG = {
    "pools": [
        {"name": "llama", "models": ["llama-3-8b"], "aliases": {"llama": "llama-3-8b"}, "adapters": ["sql-lora"]},
        {"name": "qwen", "models": ["qwen-7b"]},
    ],
    "max_body_bytes": MAX_BODY,
    "debug_header": True,
}


@pytest.fixture(scope="module")
def pods():
    with serving(["llama-0", "llama-1", "llama-2", "qwen-0"]) as pods:
        yield pods


@pytest.fixture(scope="module")
def envoy(pods):
    pools = [
        {"name": "llama", "endpoints": [pods[f"llama-{i}"].address for i in range(3)]},
        {"name": "qwen", "endpoints": [pods["qwen-0"].address]},
    ]
    e = Envoy("filter", pools, CONFIG)
    yield e
    e.stop()


def push_with_best(envoy, pods, best):
    """A fresh snapshot where `best` is the only idle llama pod."""
    llama = [
        {"address": pods[f"llama-{i}"].address, "waiting": 0 if f"llama-{i}" == best else 6}
        for i in range(3)
    ]
    assert envoy.push(snapshot({"llama": llama, "qwen": [{"address": pods["qwen-0"].address}]}))[0] == 204


class H2Client:
    """One HTTP/2 connection to Envoy's gateway listener, driven frame by frame."""

    def __init__(self, addr):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.flush()
        self.streams = {}

    def flush(self):
        self.sock.sendall(self.conn.data_to_send())

    def start(self, method, path, chunks=(), headers=(), trailers=None, empty_end=False):
        """Opens a stream: its headers, then each chunk of the body as a DATA frame, the last
        carrying END_STREAM unless `empty_end` (an empty DATA frame ends it) or `trailers` (a
        HEADERS frame of them ends it). Returns the stream id."""
        sid = self.conn.get_next_available_stream_id()
        ends_on_headers = not chunks and not empty_end and trailers is None
        self.conn.send_headers(
            sid,
            [(":method", method), (":path", path), (":scheme", "http"), (":authority", "gateway"), *headers],
            end_stream=ends_on_headers,
        )
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            self.conn.send_data(sid, chunk, end_stream=last and not empty_end and trailers is None)
            self.flush()
        if empty_end:
            self.conn.send_data(sid, b"", end_stream=True)
        if trailers is not None:
            self.conn.send_headers(sid, list(trailers), end_stream=True)
        self.flush()
        self.streams[sid] = {"status": None, "headers": {}, "body": b"", "done": False, "reset": None}
        return sid

    def wait(self, sids, timeout=10):
        """Reads until every stream in `sids` ended or was reset; their records by id."""
        deadline = time.time() + timeout
        while not all(self.streams[s]["done"] for s in sids):
            if time.time() > deadline:
                raise TimeoutError({s: self.streams[s] for s in sids})
            self.sock.settimeout(max(0.05, deadline - time.time()))
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("Envoy closed the connection")
            for ev in self.conn.receive_data(data):
                rec = self.streams.get(getattr(ev, "stream_id", None))
                if isinstance(ev, h2.events.ResponseReceived):
                    rec["headers"] = dict(ev.headers)
                    rec["status"] = int(rec["headers"][":status"])
                elif isinstance(ev, h2.events.DataReceived):
                    rec["body"] += ev.data
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    rec["done"] = True
                elif isinstance(ev, h2.events.StreamReset):
                    rec["done"], rec["reset"] = True, ev.error_code
            self.flush()
        return {s: self.streams[s] for s in sids}

    def close(self):
        self.conn.close_connection()
        self.flush()
        self.sock.close()


@pytest.fixture
def client(envoy):
    c = H2Client(envoy.listen)
    yield c
    c.close()


def chat_body(model, text="hello over HTTP/2"):
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def split(body, n):
    step = -(-len(body) // n)
    return [body[i:i + step] for i in range(0, len(body), step)]


def test_streams_sharing_a_connection_are_each_routed_by_their_body(envoy, pods, client):
    push_with_best(envoy, pods, "llama-2")
    long_text = "a longer conversation turn " * 200  # ~5 KB, in many DATA frames
    requests = {
        client.start("POST", "/v1/chat/completions", split(chat_body("llama-3-8b", long_text), 7)): ("llama-2", long_text),
        client.start("POST", "/v1/chat/completions", [chat_body("qwen-7b")]): ("qwen-0", "hello over HTTP/2"),
        client.start("POST", "/v1/chat/completions", split(chat_body("sql-lora"), 3), empty_end=True): (None, None),
        # An alias's body is rewritten for the pod, here in the empty frame's callback.
        client.start("POST", "/v1/chat/completions", split(chat_body("llama"), 2), empty_end=True): ("llama-2", "hello over HTTP/2"),
    }
    got = client.wait(list(requests))
    for sid, (pod, text) in requests.items():
        r = got[sid]
        assert r["status"] == 200 and r["reset"] is None, r
        served = r["headers"]["x-served-by"]
        if pod:
            assert served == pod, r["headers"]
        else:
            assert served.startswith("llama-"), r["headers"]
        echo = json.loads(r["body"])
        # The pod received the whole body, as one request, with the filter's routing headers.
        if text:
            sent = json.loads(echo["body"])
            assert sent["messages"][0]["content"] == text
            assert sent["model"] in ("llama-3-8b", "qwen-7b"), sent["model"]
        assert echo["headers"]["x-gateway-destination-endpoint"].split(",")[0] == pods[served].address
        assert r["headers"]["x-gateway-debug"].startswith("pool=")


def test_a_request_ending_in_trailers_is_routed_rewritten_or_refused(envoy, pods, client):
    """With trailers the body's end comes with them, not with its last DATA frame: the request
    is routed then (before, it went on unrouted and Envoy's catch-all route refused it with a
    503), its body rewritten for an alias, or refused in the API's shape."""
    push_with_best(envoy, pods, "llama-1")
    trailers = [("x-client-trailer", "1")]
    routed = client.start("POST", "/v1/chat/completions", split(chat_body("llama-3-8b"), 2), trailers=trailers)
    alias = client.start("POST", "/v1/chat/completions", split(chat_body("llama"), 3), trailers=trailers)
    bad = client.start("POST", "/v1/chat/completions", [b'{"model": "llama-3-8b", '], trailers=trailers)
    got = client.wait([routed, alias, bad])
    assert got[routed]["status"] == 200 and got[routed]["headers"]["x-served-by"] == "llama-1", got[routed]
    assert got[alias]["status"] == 200 and got[alias]["headers"]["x-served-by"] == "llama-1", got[alias]
    assert json.loads(json.loads(got[alias]["body"])["body"])["model"] == "llama-3-8b"
    assert got[bad]["status"] == 400, got[bad]
    assert json.loads(got[bad]["body"])["error"]["code"] == "invalid_json"

    # A snapshot pushed over HTTP/2 with trailers is taken too: llama-0 becomes the best pod.
    llama = [{"address": pods[f"llama-{i}"].address, "waiting": 0 if i == 0 else 6} for i in range(3)]
    snap = json.dumps(snapshot({"llama": llama, "qwen": [{"address": pods["qwen-0"].address}]})).encode()
    ingest = H2Client(envoy.ingest)
    try:
        sid = ingest.start("POST", "/gpuroute/v1/snapshot", split(snap, 3), trailers=trailers,
                           headers=[("authorization", f"Bearer {TOKEN}")])
        assert ingest.wait([sid])[sid]["status"] == 204
    finally:
        ingest.close()
    sid = client.start("POST", "/v1/chat/completions", [chat_body("llama-3-8b")])
    assert client.wait([sid])[sid]["headers"]["x-served-by"] == "llama-0"


def test_errors_models_and_forged_headers_over_http2(envoy, pods, client):
    push_with_best(envoy, pods, "llama-0")
    bad = client.start("POST", "/v1/chat/completions", [b"{not json"])
    unknown = client.start("POST", "/v1/chat/completions", [chat_body("no-such-model")])
    big = client.start("POST", "/v1/chat/completions", split(chat_body("llama-3-8b", "x" * (MAX_BODY + 10)), 5))
    models = client.start("GET", "/v1/models")
    forged = client.start("POST", "/v1/chat/completions", [chat_body("llama-3-8b")],
                          headers=[("x-gateway-destination-endpoint", pods["llama-2"].address)])
    got = client.wait([bad, unknown, big, models, forged])

    def error(sid):
        return got[sid]["status"], json.loads(got[sid]["body"])["error"]

    assert error(bad)[0] == 400 and error(bad)[1]["code"] == "invalid_json", got[bad]
    assert error(unknown)[0] == 404 and error(unknown)[1]["code"] == "model_not_found", got[unknown]
    assert error(big)[0] == 413 and error(big)[1]["code"] == "request_too_large", got[big]
    assert got[models]["status"] == 200
    ids = {m["id"] for m in json.loads(got[models]["body"])["data"]}
    assert {"llama-3-8b", "sql-lora", "qwen-7b"} <= ids, ids
    assert got[forged]["status"] == 200 and got[forged]["headers"]["x-served-by"] == "llama-0", got[forged]
    # The connection still serves after the errors.
    sid = client.start("POST", "/v1/chat/completions", [chat_body("qwen-7b")])
    assert client.wait([sid])[sid]["headers"]["x-served-by"] == "qwen-0"
