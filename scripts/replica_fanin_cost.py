#!/usr/bin/env python3
"""What other gateway replicas' requests in prefill cost the replica that takes them, by count.

One gateway replica on this host: a real Envoy (2 workers, the built filter) and its
sidecar-metrics, eight stub pods. `target/release/relay-peers` plays the other replicas'
sidecars: each of `--peers` N posts its counts (a new body every time, as a busy replica's are)
every 5 ms to the sidecar's `POST /v1/load`, as the load relay does. Each step measures, over
`--seconds`, the CPU (/proc, user + system) of the Envoy, of the sidecar and of the posting
process, how many posts the Envoy took (`gpuroute.replica_load.imported`: its counts of
other replicas' entries) and answered (the ingest listener's requests, its own counts read and
snapshots pushed included), and the peers' posts' latency (`post_ms`: a sidecar answers once
its Envoy took the counts, so this is how long they took to get there). With `--direct` the
peers post straight to the Envoy's `ingest.load_path` instead, to price one post in the Envoy
alone. `--base-wasm` and `--base-sidecar` add another build (an older filter and
sidecar-metrics), measured in turn with this tree's, `--rounds` times each. README, "Between
gateway replicas, the requests in prefill".

    make setup build && cargo build --release -p gpuroute-bench
    .venv/bin/python scripts/replica_fanin_cost.py [--peers 1,3,7,15] [--seconds 10] [--direct]
        [--base-wasm F --base-sidecar F] [--rounds 1]
"""

import argparse
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import harness  # noqa: E402
from harness import STAT_PREFIX, TOKEN, Envoy, Sidecar, cpu_seconds, free_port  # noqa: E402
from stubpod import serving  # noqa: E402

CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}]}
PEERS = ROOT / "target" / "release" / "relay-peers"




def ingest_requests(gw):
    """Requests the Envoy's ingest listener has answered (its HTTP connection manager's count)."""
    with urllib.request.urlopen(f"http://{gw.admin}/stats?filter=^http.gpuroute_ingest.downstream_rq_total$", timeout=2) as r:
        text = r.read().decode()
    return int(text.split(":")[1]) if ":" in text else 0


def step(gw, sc, target, pods, peers, seconds):
    imported0, answered0 = gw.stat(STAT_PREFIX + "gpuroute.replica_load.imported") or 0, ingest_requests(gw)
    e0, s0 = cpu_seconds(gw.proc.pid), cpu_seconds(sc.proc.pid)
    poster = subprocess.Popen([str(PEERS), "--target", target, "--token", TOKEN, "--peers", str(peers),
                               "--seconds", str(seconds), "--pods", ",".join(pods)], stdout=subprocess.PIPE)
    out = poster.stdout.read()
    _, status, usage = os.wait4(poster.pid, 0)
    if status != 0:
        raise RuntimeError(f"relay-peers failed ({status})")
    posted = json.loads(out)
    e1, s1 = cpu_seconds(gw.proc.pid), cpu_seconds(sc.proc.pid)
    secs = posted["seconds"]
    imported = (gw.stat(STAT_PREFIX + "gpuroute.replica_load.imported") or 0) - imported0
    return {
        "peers": peers,
        "posted_per_s": round(posted["taken_per_s"]),
        "refused_or_failed": posted["refused"] + posted["failed"],
        "post_ms": posted["latency_ms"],
        "envoy_posts_per_s": round((ingest_requests(gw) - answered0) / secs),
        "envoy_imported_per_s": round(imported / secs),
        "envoy_cpu_ms_per_s": round(1000 * (e1 - e0) / secs, 1),
        "sidecar_cpu_ms_per_s": round(1000 * (s1 - s0) / secs, 1),
        "poster_cpu_ms_per_s": round(1000 * (usage.ru_utime + usage.ru_stime) / secs, 1),
    }


class Sink(http.server.BaseHTTPRequestHandler):
    """A peer that takes whatever it is posted: the sidecar relays its own idle Envoy's counts
    there (a body saying nothing is in prefill, once), and its load relay needs a peer to run."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def run(build, wasm, sidecar, peer_counts, seconds, direct):
    """Steps through `peer_counts` on one gateway of this build (`wasm`, `sidecar`: None for this
    tree's), printing one JSON line per step."""
    own_sidecar = harness.SIDECAR
    if sidecar:
        harness.SIDECAR = Path(sidecar)
    with serving([f"pod-{i}" for i in range(8)]) as served:
        pods = [p.address for p in served.values()]
        gw = Envoy("filter", [{"name": "llama", "endpoints": pods}], CONFIG, concurrency=2, wasm=wasm)
        sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        listen = f"127.0.0.1:{free_port()}"
        sc = Sidecar({"llama": pods}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"], interval_ms=100,
                     extra={"prefix": {"listen": listen, "peers": [f"http://127.0.0.1:{sink.server_port}"]}})
        try:
            time.sleep(2)
            for i in range(8):  # every worker routes, so its tables exist
                gw.chat("llama-3-8b", f"warm-up {i}")
            target = (f"http://{gw.ingest}/gpuroute/v1/load" if direct else f"http://{listen}/v1/load")
            for peers in peer_counts:
                print(json.dumps({"build": build, **step(gw, sc, target, pods, peers, seconds)}), flush=True)
        finally:
            sc.stop()
            gw.stop()
            sink.shutdown()
            harness.SIDECAR = own_sidecar


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="1,3,7,15", help="peer counts to step through, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--direct", action="store_true", help="post to the Envoy, not to the sidecar")
    ap.add_argument("--base-wasm", help="another build's filter (.wasm), measured in turn with this tree's")
    ap.add_argument("--base-sidecar", help="another build's sidecar-metrics binary (with --base-wasm)")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    if not PEERS.exists():
        sys.exit(f"{PEERS} is missing: cargo build --release -p gpuroute-bench")
    builds = [("head", None, None)]
    if a.base_wasm or a.base_sidecar:
        builds.append(("base", a.base_wasm, a.base_sidecar))
    peer_counts = [int(p) for p in a.peers.split(",")]
    print(f"posting to the {'Envoy' if a.direct else 'sidecar'}, {a.seconds:g} s a step", flush=True)
    for r in range(a.rounds):
        for build, wasm, sidecar in (builds if r % 2 == 0 else builds[::-1]):
            run(build, wasm, sidecar, peer_counts, a.seconds, a.direct)


if __name__ == "__main__":
    main()
