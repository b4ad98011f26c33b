"""The answers Envoy itself generates on the traffic listener, in the API's error shape.

The filter answers bad requests itself (test_filter.py, test_sdks.py). Envoy still answers a few
failures on its own: a body that overflows its buffer before the filter has seen it pass
`max_body_bytes`, a pool none of whose pods can take the request, a pod that times out, a
request it cannot read or does not take (a protocol error, HTTP/1.0, headers too large). The
shipped configurations map those answers (`local_reply_config`, `envoy/render.py`) to the same
shape the filter uses on that path, so an SDK reads them like any other error of the API.
"""

import json
import socket

import anthropic
import openai
import pytest

from harness import Envoy, free_port, snapshot  # puts envoy/ on the path
from check_configs import read_answer  # noqa: E402
from stubpod import StubPod

CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}, {"name": "gone", "models": ["gone-1"]}]}
OPENAI_KEYS = {"message", "type", "param", "code"}
HI = [{"role": "user", "content": "hi"}]


def dead_address():
    """A loopback port nothing listens on (picked free, then left closed)."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def gateway():
    pod = StubPod("llama-0")
    dead = dead_address()
    e = Envoy("filter", [{"name": "llama", "endpoints": [pod.address]}, {"name": "gone", "endpoints": [dead]}], CONFIG)
    assert e.push(snapshot({"llama": [{"address": pod.address}], "gone": [{"address": dead}]}))[0] == 204
    e.pod = pod
    yield e
    e.stop()
    pod.close()


def chunked(envoy, path, total, chunk=64 * 1024):
    """Sends a chunked body of `total` bytes (or until Envoy closes) and returns the status line,
    the headers (lower-case names) and the body of the answer."""
    host, port = envoy.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n" % path.encode())
        piece = b"y" * chunk
        sent = 0
        try:
            while sent < total:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_answer(s)


def too_large(envoy):
    """Envoy's count of requests it answered 413 itself (its buffer overflowed)."""
    return envoy.stats("downstream_rq_too_large").get("http.openai.downstream_rq_too_large", 0)


def test_envoys_own_413_is_the_filters_413(small_buffer_gateway):
    """Envoy answers 413 itself when one read takes its buffer past its limit before the filter
    has seen the body pass `max_body_bytes`: with a buffer limit under `max_body_bytes` that is
    every oversize body, so Envoy's own counter proves who answered. The answer is the filter's
    413, in OpenAI's shape, and in Anthropic's on the Messages API (its query string included)."""
    e = small_buffer_gateway
    before = too_large(e)
    status, headers, body = chunked(e, "/v1/chat/completions", 1024 * 1024)
    assert status.startswith("HTTP/1.1 413"), status
    assert headers["content-type"] == "application/json", headers
    err = json.loads(body)["error"]
    assert set(err) == OPENAI_KEYS, err
    assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
    assert err["message"] == "request body exceeds the gateway limit of 4194304 bytes"

    status, headers, body = chunked(e, "/v1/messages?beta=true", 1024 * 1024)
    assert status.startswith("HTTP/1.1 413"), status
    doc = json.loads(body)
    assert doc["type"] == "error" and doc["error"]["type"] == "request_too_large", doc
    after = too_large(e)
    assert after - before == 2, (before, after)


@pytest.fixture(scope="module")
def small_buffer_gateway():
    """A gateway whose listener buffers 256 KiB, under the filter's 4 MiB `max_body_bytes`."""
    pod = StubPod("llama-0")

    def small_buffer(config):
        for listener in config["static_resources"]["listeners"]:
            if listener["name"] == "openai":
                listener["per_connection_buffer_limit_bytes"] = 256 * 1024

    e = Envoy("filter", [{"name": "llama", "endpoints": [pod.address]}], {"pools": CONFIG["pools"][:1]}, patch=small_buffer)
    yield e
    e.stop()
    pod.close()


def test_oversize_bodies_get_the_apis_413_whatever_the_read_size(gateway):
    """With the shipped buffer limit either the filter or Envoy answers an oversize chunked body,
    depending on how much one read from the socket takes; the answer is the same."""
    for chunk in (64 * 1024, 1024 * 1024, 4 * 1024 * 1024):
        status, headers, body = chunked(gateway, "/v1/completions", 12 * 1024 * 1024, chunk)
        assert status.startswith("HTTP/1.1 413"), (chunk, status)
        assert headers["content-type"] == "application/json", (chunk, headers)
        assert json.loads(body)["error"]["code"] == "request_too_large", (chunk, body)


def test_a_pool_no_pod_can_take_answers_503_in_the_apis_shape(gateway):
    """Every pod of the pool refuses connections: Envoy's 503 ("upstream connect error ...")
    comes back as a retryable 503 in the API's shape, Envoy's reason in the message."""
    s, h, body, _ = gateway.chat("gone-1")
    assert s == 503 and h["content-type"] == "application/json", (s, h, body)
    err = body["error"]
    assert set(err) == OPENAI_KEYS, err
    assert (err["type"], err["code"]) == ("service_unavailable_error", "upstream_unavailable")
    assert err["message"].startswith("no pod of the pool could take the request: upstream connect error"), err

    s, h, body, _ = gateway.request("POST", "/v1/messages", {"model": "gone-1", "max_tokens": 8, "messages": HI})
    assert s == 503 and h["content-type"] == "application/json", (s, h, body)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == "overloaded_error"

    # The pool that has a pod still serves; the filter's own errors keep their bodies.
    assert gateway.chat("llama-3-8b")[0] == 200
    s, _, body, _ = gateway.chat("gpt-9")
    assert (s, body["error"]["code"]) == (404, "model_not_found")


def test_envoys_507_while_retrying_is_a_503_in_the_apis_shape():
    """Envoy's router answers 507 "exceeded request buffer limit while retrying upstream" when a
    request's first attempt failed and its body outgrew the retry buffer before the retry: an
    audio upload that streams on to a pod that refused it (`test_a_dead_pod_an_upload_was_sent_to`
    meets it when the refusal comes early; how often depends on the machine's timing). It comes
    back as the retryable 503 of a pool no pod could take, in the API's shape. The race is not
    forced here: a route answers Envoy's 507 directly, through the same local reply mappers."""
    pod = StubPod("llama-0")
    reason = "exceeded request buffer limit while retrying upstream"

    def answer_507(config):
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        routes.insert(0, {"match": {"prefix": "/retrying"},
                          "direct_response": {"status": 507, "body": {"inline_string": reason}}})

    e = Envoy("filter", [{"name": "llama", "endpoints": [pod.address]}], {"pools": CONFIG["pools"][:1]},
              patch=answer_507)
    try:
        s, h, body, raw = e.request("POST", "/retrying/v1/audio/transcriptions", b"x")
        assert s == 503 and h["content-type"] == "application/json", (s, h, raw)
        err = body["error"]
        assert set(err) == OPENAI_KEYS, err
        assert (err["type"], err["code"]) == ("service_unavailable_error", "upstream_unavailable")
        assert err["message"] == f"no pod of the pool could take the request: {reason}", err
        s, h, body, raw = e.request("POST", "/retrying/v1/messages", b"x")
        assert s == 503 and body["type"] == "error" and body["error"]["type"] == "overloaded_error", (s, raw)
    finally:
        e.stop()
        pod.close()


def test_sdks_read_envoys_503(gateway):
    base = f"http://{gateway.listen}"
    oai = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="gone-1", messages=HI)
    assert info.value.status_code == 503 and info.value.code == "upstream_unavailable", repr(info.value)
    assert "no pod of the pool" in info.value.message

    ant = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        ant.messages.create(model="gone-1", max_tokens=8, messages=HI)
    assert info.value.status_code == 503, repr(info.value)
    assert info.value.body["error"]["type"] == "overloaded_error", info.value.body


def test_a_pod_that_times_out_answers_504_in_the_apis_shape():
    """A route timeout (none by default: streams run long; one a user sets) that fires comes back
    as a 504 in the API's shape."""
    slow = StubPod("slow-0", delay_s=3.0)
    e = Envoy("filter", [{"name": "llama", "endpoints": [slow.address]}], {"pools": CONFIG["pools"][:1]},
              extra={"route_timeout_s": 1})
    try:
        assert e.push(snapshot({"llama": [{"address": slow.address}]}))[0] == 204
        s, h, body, _ = e.chat("llama-3-8b")
        assert s == 504 and h["content-type"] == "application/json", (s, h, body)
        err = body["error"]
        assert set(err) == OPENAI_KEYS, err
        assert (err["type"], err["code"]) == ("timeout_error", "upstream_timeout")
        s, h, body, _ = e.request("POST", "/v1/messages", {"model": "llama-3-8b", "max_tokens": 8, "messages": HI})
        assert s == 504 and body["type"] == "error" and body["error"]["type"] == "api_error", (s, body)
    finally:
        e.stop()
        slow.close()


def raw(envoy, data):
    """Sends `data` as it is on a new connection: (status line, headers, body) of the answer."""
    host, port = envoy.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # Envoy answered and closed before the rest (headers too large)
        return read_answer(s)


def test_requests_envoy_refuses_itself_are_answered_in_the_apis_shape(gateway):
    """Envoy's HTTP codec refuses some requests before any filter sees them. Each keeps Envoy's
    status, now with a JSON body in OpenAI's shape naming Envoy's reason, not `text/plain`; the
    filter's own 400s (which share the status) are left as they are. (Anthropic's shape needs
    the path, which Envoy may not have read from such a request: OpenAI's then.)"""
    body = json.dumps({"model": "llama-3-8b", "messages": HI}).encode()
    post = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    cases = [
        # HTTP/1.0, which Envoy does not take by default (a proxy in front speaking it).
        (b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
         426, "low_version"),
        (post + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400, "http1.content_length_and_chunked"),
        (post + b"transfer-encoding: chunked\r\n\r\nZZ\r\n", 400, "http1.codec_error"),
        (post + b"transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, "http1.invalid_transfer_encoding"),
        (post + b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n", 431, "http1.headers_too_large"),
        (b"POST /v1/chat/completions#x HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n", 400, "path_normalization_failed"),
    ]
    for data, status, details in cases:
        line, headers, answer = raw(gateway, data)
        assert line.split(" ")[1] == str(status), (details, line, answer[:200])
        assert headers.get("content-type") == "application/json", (details, headers)
        err = json.loads(answer)["error"]
        assert set(err) == OPENAI_KEYS and err["code"] == "malformed_request", (details, err)
        assert details in err["message"] and err["type"] == "invalid_request_error", (details, err)
    # The filter's own 400, same status: untouched.
    line, headers, answer = raw(gateway, post + b"content-length: 9\r\n\r\n{\"model\":")
    assert line.split(" ")[1] == "400" and json.loads(answer)["error"]["code"] == "invalid_json", answer
    # The catch-all 404 is labelled JSON too.
    line, headers, answer = raw(gateway, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    assert line.split(" ")[1] == "404" and headers.get("content-type") == "application/json", (line, headers)
    assert json.loads(answer)["error"]["code"] == "not_found"
    # And Envoy serves on.
    assert gateway.chat("llama-3-8b")[0] == 200
