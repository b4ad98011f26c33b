#!/usr/bin/env python3
"""What the relay of requests in prefill between gateway replicas costs in CPU.

Two gateway replicas on this host, each a real Envoy (2 workers, the built filter) with its own
sidecar-metrics, the sidecars each other's peers, eight stub pods. Each round measures, over
`--seconds`, the CPU (/proc, user + system) of each Envoy and each sidecar with the relay off
(`prefix.load_interval_ms: 0`) and at 5 ms, alternately. With `--load N`, N client threads per
gateway send streamed chat requests back to back (the pods answer after 50 ms), so each Envoy
has requests in prefill and its counts change all the time. README, "Between gateway replicas,
the requests in prefill" and "Limitations and next work".

    make setup build
    .venv/bin/python scripts/replica_relay_cost.py [--load 2] [--rounds 2] [--seconds 10]
"""

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from harness import Envoy, Sidecar, cpu_seconds, free_port  # noqa: E402
from stubpod import serving  # noqa: E402

CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}]}




def measure(interval_ms, load, seconds):
    with serving([f"pod-{i}" for i in range(8)]) as served:
        pods = list(served.values())
        gws = [Envoy("filter", [{"name": "llama", "endpoints": [p.address for p in pods]}], CONFIG, concurrency=2)
               for _ in range(2)]
        ports = [free_port(), free_port()]
        scs = [Sidecar({"llama": [p.address for p in pods]}, [f"http://{gw.ingest}/gpuroute/v1/snapshot"],
                       interval_ms=100,
                       extra={"prefix": {"listen": f"127.0.0.1:{ports[i]}",
                                         "peers": [f"http://127.0.0.1:{ports[1 - i]}"],
                                         "load_interval_ms": interval_ms}})
               for i, gw in enumerate(gws)]
        stop, sent = threading.Event(), [0]
        try:
            time.sleep(2)
            for gw in gws:  # every worker routes, so its tables exist
                for i in range(8):
                    gw.chat("llama-3-8b", f"warm-up {i}")
            for p in pods:
                p.delay_s = 0.05

            def client(gw, k):
                i = 0
                while not stop.is_set():
                    body = {"model": "llama-3-8b", "stream": True,
                            "messages": [{"role": "user", "content": f"question {k}-{i}"}]}
                    gw.request("POST", "/v1/chat/completions", body)
                    i += 1
                    sent[0] += 1

            threads = [threading.Thread(target=client, args=(gw, k), daemon=True) for gw in gws for k in range(load)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            n0, e0, s0 = sent[0], [cpu_seconds(g.proc.pid) for g in gws], [cpu_seconds(s.proc.pid) for s in scs]
            time.sleep(seconds)
            n1, e1, s1 = sent[0], [cpu_seconds(g.proc.pid) for g in gws], [cpu_seconds(s.proc.pid) for s in scs]
            stop.set()
            for t in threads:
                t.join()
            per_s = lambda a, b: [round(1000 * (y - x) / seconds, 1) for x, y in zip(a, b)]  # noqa: E731
            return per_s(e0, e1), per_s(s0, s1), (n1 - n0) / seconds
        finally:
            stop.set()
            for s in scs:
                s.stop()
            for g in gws:
                g.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="client threads per gateway (0: idle)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    for r in range(a.rounds):
        for interval in (0, 5):
            envoy, sidecar, rate = measure(interval, a.load, a.seconds)
            print(f"round {r} load_interval_ms {interval}: Envoy CPU ms/s {envoy}, sidecar CPU ms/s {sidecar}, "
                  f"requests/s {rate:.0f}", flush=True)


if __name__ == "__main__":
    main()
