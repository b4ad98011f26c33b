"""Small stub model-server pods for the end-to-end tests: each answers every request with a JSON
echo of what it received (method, path, headers, body) and says who served it in
`x-served-by`. They bind 127.0.0.1 on an OS-chosen port."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubPod:
    def __init__(self, name, delay_s=0.0):
        self.name = name
        self.delay_s = delay_s
        self.requests = []
        pod = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                rec = {
                    "pod": pod.name,
                    "method": self.command,
                    "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body.decode("utf-8", "replace"),
                }
                pod.requests.append(rec)
                if pod.delay_s:
                    time.sleep(pod.delay_s)
                out = json.dumps(rec).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("x-served-by", pod.name)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = _answer
            do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
