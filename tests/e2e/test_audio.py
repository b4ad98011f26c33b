"""Audio uploads (`/v1/audio/transcriptions`, `/v1/audio/translations`) through a real Envoy with
the filter: `multipart/form-data` bodies routed by their `model` field, the pod picked by load,
an alias rewritten in the form, and an upload whose `model` comes first streamed on to the pod
(not buffered, whatever its size). Stub pods read each form with Python's own parser."""

import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import warnings

import openai
import pytest

from harness import STAT_PREFIX, Envoy, render, snapshot
from stubpod import serving

# A small body limit, so that uploads past it are cheap to send.
MAX_BODY = 256 * 1024
CONFIG = {
    "pools": [
        {"name": "asr", "models": ["whisper-large-v3"], "aliases": {"whisper": "whisper-large-v3"}},
        {"name": "llama", "models": ["llama-3-8b"]},
    ],
    "max_body_bytes": MAX_BODY,
    "debug_header": True,
}
TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def pods():
    with serving(["asr-0", "asr-1", "llama-0"]) as pods:
        yield pods


@pytest.fixture(scope="module")
def gateway(pods):
    e = Envoy(
        "filter",
        [
            {"name": "asr", "endpoints": [pods["asr-0"].address, pods["asr-1"].address]},
            {"name": "llama", "endpoints": [pods["llama-0"].address]},
        ],
        CONFIG,
    )
    yield e
    e.stop()


def push(gateway, pods, busy):
    """A fresh snapshot where the pod named `busy` has a deep queue and the others are idle."""
    def pod(name):
        load = {"waiting": 40, "running": 60, "kv_cache_usage": 0.9} if name == busy else {}
        return dict({"address": pods[name].address}, **load)

    s = gateway.push(snapshot({"asr": [pod("asr-0"), pod("asr-1")], "llama": [pod("llama-0")]}))
    assert s[0] == 204, s


def form(items, boundary="gpuroute-test-boundary"):
    """A multipart/form-data body of `items` in the order given: ("field", name, value) and
    ("file", name, filename, bytes); and its content type."""
    out = b""
    for item in items:
        if item[0] == "field":
            _, name, value = item
            out += (f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"\r\n\r\n'
                    f"{value}\r\n").encode()
        else:
            _, name, filename, data = item
            out += (f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"; '
                    f'filename="{filename}"\r\ncontent-type: audio/wav\r\n\r\n').encode()
            out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def upload(gateway, body, ctype, path=TRANSCRIBE, chunked=False):
    """Posts a form; (status, headers, JSON body). `chunked`: in 64 KiB chunks, without a
    content-length."""
    if not chunked:
        return gateway.request("POST", path, body, {"content-type": ctype}, timeout=30)[:3]
    host, port = gateway.listen.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    pieces = (body[i:i + 64 * 1024] for i in range(0, len(body), 64 * 1024))
    conn.request("POST", path, body=pieces, encode_chunked=True,
                 headers={"content-type": ctype, "transfer-encoding": "chunked"})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(raw)


def audio(n):
    # Random bytes: CR, LF and dashes included, as in real audio.
    return os.urandom(n)


def sha(b):
    return hashlib.sha256(b).hexdigest()


def test_sdk_uploads_go_to_the_least_loaded_pod_of_the_models_pool_with_the_alias_rewritten(gateway, pods):
    """OpenAI's Python SDK (fields first, then the file): transcription and translation go to
    the idle pod of the whisper pool, the pod reads the real model name and the whole file; the
    load moved, they follow it."""
    client = openai.OpenAI(base_url=f"http://{gateway.listen}/v1", api_key="x", max_retries=0)
    clip = audio(100_000)
    for busy, idle in (("asr-0", "asr-1"), ("asr-1", "asr-0")):
        push(gateway, pods, busy)
        for call in (client.audio.transcriptions, client.audio.translations):
            with warnings.catch_warnings():
                # This SDK marks its translations call deprecated; vLLM still serves the path.
                warnings.simplefilter("ignore", DeprecationWarning)
                got = call.create(model="whisper", file=("clip.wav", clip, "audio/wav"), response_format="json")
            # The stub pods answer each upload with the pod's name as its text.
            assert got.text == f"transcribed by {idle}", got
            rec = pods[idle].requests[-1]
            assert rec["form"]["model"] == "whisper-large-v3", rec["form"]
            assert rec["form"]["file"] == {"length": len(clip), "sha256": sha(clip)}
            assert rec["form"]["response_format"] == "json"
    # Counted as the pool's picks.
    assert gateway.stat(STAT_PREFIX + "gpuroute.pool.asr.requests.picked") >= 4


def test_a_file_before_the_model_is_buffered_and_routed_whole(gateway, pods):
    """curl's `-F file=@clip.wav -F model=whisper` order: the body is read to its end, then
    routed; the rewritten alias changes the length, which the pod's parser must still accept."""
    push(gateway, pods, "asr-0")
    clip = audio(50_000)
    for chunked in (False, True):
        body, ctype = form([("file", "file", "clip.wav", clip), ("field", "model", "whisper"),
                            ("field", "language", "en")])
        s, h, rec = upload(gateway, body, ctype, chunked=chunked)
        assert (s, h["x-served-by"]) == (200, "asr-1"), (s, rec)
        assert rec["form"] == {"file": {"length": len(clip), "sha256": sha(clip)},
                               "model": "whisper-large-v3", "language": "en"}, rec["form"]
        assert rec["body_length"] == len(body) + len("-large-v3")


def test_an_upload_past_the_body_limit_streams_when_its_model_comes_first(gateway, pods):
    """The filter routes a form at its file's head when `model` came before it, and the upload
    streams on: 12 times `max_body_bytes` (and past Envoy's own buffer limit, 1 MiB above it)
    reaches the pod whole, with or without a content-length. With the file first, the same
    upload gets the API's 413, which says what to change."""
    push(gateway, pods, "asr-1")
    clip = audio(12 * MAX_BODY)
    for chunked in (False, True):
        body, ctype = form([("field", "model", "whisper"), ("field", "stream", "false"),
                            ("file", "file", "long.wav", clip)])
        s, h, rec = upload(gateway, body, ctype, chunked=chunked)
        assert (s, h.get("x-served-by")) == (200, "asr-0"), (s, str(rec)[:300])
        assert rec["form"]["file"] == {"length": len(clip), "sha256": sha(clip)}
        assert rec["form"]["model"] == "whisper-large-v3"
        if not chunked:
            assert int(rec["headers"]["content-length"]) == len(body) + len("-large-v3")

    body, ctype = form([("file", "file", "long.wav", clip), ("field", "model", "whisper")])
    s, _, err = upload(gateway, body, ctype)
    # The filter's 413 or, when one read overflowed Envoy's buffer first, Envoy's own mapped to
    # the same body (`local_reply_config`): either way the message says what to change.
    assert s == 413, (s, err)
    assert err["error"] == {"message": render.form_too_large_message(MAX_BODY), "type": "invalid_request_error",
                            "param": None, "code": "request_too_large"}, err


def test_an_upload_reaches_its_pod_before_the_client_has_sent_all_of_it(gateway, pods):
    """Routed at the file's head: the pod has the request while the client is still sending the
    file (a filter that buffered to the end would hold it until the last byte)."""
    push(gateway, pods, "asr-1")
    clip = audio(200_000)
    body, ctype = form([("field", "model", "whisper"), ("file", "file", "slow.wav", clip)])
    first = body.index(b"audio/wav\r\n\r\n") + 13 + 1000
    before = len(pods["asr-0"].started)
    host, port = gateway.listen.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall((f"POST {TRANSCRIBE} HTTP/1.1\r\nhost: gw\r\ncontent-type: {ctype}\r\n"
                   f"content-length: {len(body)}\r\n\r\n").encode() + body[:first])
        deadline = time.time() + 10
        while len(pods["asr-0"].started) == before:
            assert time.time() < deadline, "the pod did not get the request before its end"
            time.sleep(0.02)
        c.sendall(body[first:])
        answer = b""
        while b'"text"' not in answer:
            chunk = c.recv(65536)
            assert chunk, answer[:300]
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert pods["asr-0"].requests[-1]["form"]["file"]["sha256"] == sha(clip)


def test_bad_forms_get_the_apis_errors_and_nothing_reaches_a_pod(gateway, pods):
    push(gateway, pods, "asr-1")
    served = sum(len(p.requests) for p in pods.values())
    clip = audio(2000)
    two_models, ctype = form([("field", "model", "whisper"), ("field", "model", "llama-3-8b"),
                              ("file", "file", "a.wav", clip)])
    no_model, _ = form([("file", "file", "a.wav", clip)])
    unknown, _ = form([("field", "model", "whisper-9"), ("file", "file", "a.wav", clip)])
    unclosed = no_model[:-30]
    cases = [
        (two_models, ctype, 400, "invalid_form"),
        (no_model, ctype, 400, "missing_required_parameter"),
        (unknown, ctype, 404, "model_not_found"),
        (unclosed, ctype, 400, "invalid_form"),
        (no_model, "multipart/form-data", 400, "invalid_form"),
        (b"", ctype, 400, "invalid_form"),
        # Two boundaries: the gateway and the pod's parser could each take another one (vLLM's
        # takes the last), and read another form, and model, from the same bytes.
        (no_model, f"{ctype}; boundary=other", 400, "invalid_form"),
    ]
    before = gateway.stat(STAT_PREFIX + "gpuroute.rejected.invalid_form")
    for body, ct, status, code in cases:
        s, _, err = upload(gateway, body, ct)
        assert (s, err["error"]["code"]) == (status, code), (ct, body[:80], err)
    assert gateway.stat(STAT_PREFIX + "gpuroute.rejected.invalid_form") - before == 5
    assert sum(len(p.requests) for p in pods.values()) == served
    # And Envoy serves on.
    ok, ctype = form([("field", "model", "whisper"), ("file", "file", "a.wav", clip)])
    assert upload(gateway, ok, ctype)[0] == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_curl_uploads_in_either_order_over_http1_and_http2(gateway, pods, tmp_path):
    """curl as OpenAI's documentation writes it (`-F file=@... -F model=...`: the file first,
    buffered) and with `model` first (streamed), over HTTP/1.1, where curl asks `Expect:
    100-continue` before a large body, and over HTTP/2 (h2c with prior knowledge)."""
    push(gateway, pods, "asr-1")
    small, large = tmp_path / "small.wav", tmp_path / "large.wav"
    small.write_bytes(audio(100_000))
    large.write_bytes(audio(5 * MAX_BODY))
    url = f"http://{gateway.listen}{TRANSCRIBE}"
    orders = [(small, ["-F", f"file=@{small}", "-F", "model=whisper"]),
              (large, ["-F", "model=whisper", "-F", f"file=@{large}"])]
    for http in ("--http1.1", "--http2-prior-knowledge"):
        for sent, fields in orders:
            heads, answer = tmp_path / "headers.txt", tmp_path / "answer.json"
            status = subprocess.run(["curl", "-sS", http, "-D", str(heads), "-o", str(answer), "-w", "%{http_code}",
                                     url, *fields], capture_output=True, timeout=60, check=True).stdout
            assert status == b"200", (http, sent.name, status, answer.read_bytes()[:300])
            assert "x-served-by: asr-0" in heads.read_text().lower(), heads.read_text()
            rec = json.loads(answer.read_bytes())
            assert rec["form"]["model"] == "whisper-large-v3"
            assert rec["form"]["file"]["sha256"] == sha(sent.read_bytes()), (http, sent.name)


def test_a_dead_pod_an_upload_was_sent_to():
    """The picked pod refuses the connection (dead since the last snapshot): an upload Envoy still
    holds whole is retried on the next pod of the destination header. One that has streamed on
    past Envoy's buffer limit by the time the refusal comes cannot be (Envoy keeps a body for
    retries only up to it: seen in every run here, though it depends on how much Envoy had read)
    and gets Envoy's 503 in the API's shape, which SDKs retry. Envoy serves on."""
    with serving(["dead-0", "live-1"]) as mine:
        g = Envoy("filter", [{"name": "asr", "endpoints": [mine["dead-0"].address, mine["live-1"].address]}],
                  dict(CONFIG, pools=CONFIG["pools"][:1]))
        try:
            # live-1 a little busier, so dead-0 is picked first; not saturated, so it follows
            # dead-0 in the destination header.
            snap = snapshot({"asr": [{"address": mine["dead-0"].address},
                                     {"address": mine["live-1"].address, "waiting": 2, "running": 4}]})
            assert g.push(snap)[0] == 204
            mine["dead-0"].close()
            small, ctype = form([("field", "model", "whisper"), ("file", "file", "a.wav", audio(100_000))])
            large, _ = form([("field", "model", "whisper"), ("file", "file", "b.wav", audio(12 * MAX_BODY))])
            for body, statuses in ((small, {200}), (large, {503, 200}), (small, {200})):
                s, h, answer = upload(g, body, ctype)
                assert s in statuses, (s, str(answer)[:300])
                if s == 200:
                    assert h["x-served-by"] == "live-1" and answer["form"]["model"] == "whisper-large-v3"
                    assert answer["body_length"] == len(body) + len("-large-v3")
                else:
                    assert answer["error"]["code"] == "upstream_unavailable", answer
        finally:
            g.stop()
