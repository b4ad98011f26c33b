"""Small stub model-server pods for the end-to-end tests: each answers every request with a JSON
echo of what it received (method, path, headers, body) and says who served it in
`x-served-by`. `GET /metrics` answers vLLM v1 exposition text whose load values the test sets
(`set_load`). They bind 127.0.0.1 (an OS-chosen port, or a given one to come back on), and serve
plain HTTP or, given `tls`, HTTPS (every path, `/metrics` too)."""

import contextlib
import email.parser
import email.policy
import hashlib
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="llama-3-8b"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="llama-3-8b"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="llama-3-8b"}} {kv}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="20000"}} 1.0
"""


def form_fields(content_type, body):
    """A multipart/form-data body's fields: text fields as text, files as (length, sha256)."""
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"content-type: " + content_type.encode() + b"\r\n\r\n" + body
    )
    fields = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        data = part.get_payload(decode=True) or b""
        if part.get_filename() is not None:
            fields[name] = {"length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        else:
            fields[name] = data.decode("utf-8", "replace")
    return fields


class _Server(ThreadingHTTPServer):
    """With `ssl_context`, each connection's TLS handshake runs in its own thread, so a client
    that fails it holds up no other."""

    daemon_threads = True
    ssl_context = None

    def finish_request(self, request, client_address):
        if self.ssl_context is not None:
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return
        super().finish_request(request, client_address)


def tls_context(cert, key, client_ca=None):
    """A server TLS context with the PEM files `cert` and `key`; with `client_ca`, clients must
    show a certificate that authority signed (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(str(client_ca))
    return ctx


class StubPod:
    def __init__(self, name, delay_s=0.0, port=0, tls=None):
        """`tls`: an `ssl.SSLContext` (`tls_context`) to serve HTTPS with."""
        self.name = name
        self.tls = tls
        self.delay_s = delay_s
        # A threading.Event, or None: while set to an Event that is not set, every request the
        # pod answers waits for it (at most 60 s), so a test holds requests in flight for as
        # long as it needs instead of for a fixed time a slow machine can outrun.
        self.hold = None
        # The same for the body alone: the headers go at once ("hold_body").
        self.hold_body = None
        self.requests = []
        self.started = []
        self.load = {"waiting": 0, "running": 0, "kv": 0.05}
        # The status of every answer (the body is the same record): a pod whose engine fails
        # while its /metrics still answer.
        self.status = 200
        self.conns = set()
        # Set by close(): a connection accepted just before it, whose handler thread had not
        # registered in `conns` yet, must not serve either.
        self.dead = False
        self.handler = self._handler_class()
        self._serve(port)

    def _handler_class(self):
        pod = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                pod.conns.add(self.connection)

            def handle(self):
                # After setup(): either close() saw this connection in `conns`, or it had
                # already set `dead` when the connection was added.
                if not pod.dead:
                    super().handle()

            def finish(self):
                pod.conns.discard(self.connection)
                super().finish()

            def _send(self, status, ctype, out, hold_body=None):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("x-served-by", pod.name)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                if hold_body is not None:
                    # The headers now, the body once the event is set (at most 60 s): a server
                    # that starts a stream at once and never sends its first token.
                    self.wfile.flush()
                    hold_body.wait(60)
                if self.path.startswith("/v1/responses"):
                    # Its first bytes apart, as a server may send them: the gateway must read a
                    # response's id across the chunks it arrives in.
                    self.wfile.write(out[:9])
                    self.wfile.flush()
                    time.sleep(0.02)
                    out = out[9:]
                self.wfile.write(out)

            def do_GET(self):
                # By path, as every model server routes it: sidecar-metrics asks for
                # `/metrics?name[]=...`, which this exposition (all of it read) ignores.
                if self.path.split("?")[0] == "/metrics":
                    return self._send(200, "text/plain; version=0.0.4", VLLM_METRICS.format(**pod.load).encode())
                self._answer()

            def _read_body(self):
                if "chunked" in self.headers.get("transfer-encoding", "").lower():
                    # An HTTP/2 client's body without a content-length reaches the pod chunked.
                    body = b""
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        body += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return body
                n = int(self.headers.get("content-length") or 0)
                return self.rfile.read(n) if n else b""

            def _answer(self):
                # Seen when its headers arrive, before its body is read: a test can tell a
                # request that reached the pod while its upload was still being sent.
                pod.started.append(self.path)
                body = self._read_body()
                # A Responses API answer starts with its id, as vLLM's does.
                rid = {"id": f"resp_{pod.name}_{len(pod.requests)}"} if self.path.startswith("/v1/responses") else {}
                rec = {
                    **rid,
                    "pod": pod.name,
                    "method": self.command,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body.decode("utf-8", "replace"),
                }
                ctype = self.headers.get("content-type", "")
                if ctype.startswith("multipart/"):
                    # A form (the audio endpoints): its text fields, and each file's length and
                    # digest, as the server's own form parser (Python's email package) reads them.
                    rec["body"] = body[:2048].decode("utf-8", "replace")
                    rec["body_length"] = len(body)
                    rec["form"] = form_fields(ctype, body)
                    rec["text"] = f"transcribed by {pod.name}"
                pod.requests.append(rec)
                hold = pod.hold
                if hold is not None:
                    hold.wait(60)
                if pod.delay_s:
                    time.sleep(pod.delay_s)
                self._send(pod.status, "application/json", json.dumps(rec).encode(), pod.hold_body)

            do_POST = _answer
            do_DELETE = _answer

        return Handler

    def _serve(self, port):
        self.server = _Server(("127.0.0.1", port), self.handler)
        self.server.ssl_context = self.tls
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def set_load(self, waiting=0, running=0, kv=0.05):
        self.load = {"waiting": waiting, "running": running, "kv": kv}

    def close(self):
        """Dies like a crashed pod: the listener and every open keep-alive connection close."""
        self.dead = True
        self.server.shutdown()
        self.server.server_close()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def restart(self):
        """Comes back on the same address after close()."""
        self.dead = False
        self._serve(int(self.address.rsplit(":", 1)[1]))


def pools_by(pods, pod_pool, names):
    """The `pools` argument of harness.Envoy for stub pods `pods` (by name): pools `names`, in that
    order, each with the addresses of the pods `pod_pool` assigns to it."""
    return [{"name": pool, "endpoints": [p.address for n, p in pods.items() if pod_pool[n] == pool]}
            for pool in names]


@contextlib.contextmanager
def serving(names):
    """Stub pods by name (a dict), all closed on leaving the block: a pytest fixture's body is
    `with serving([...]) as pods: yield pods`."""
    pods = {name: StubPod(name) for name in names}
    try:
        yield pods
    finally:
        for p in pods.values():
            p.close()
