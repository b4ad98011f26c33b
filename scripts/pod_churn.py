#!/usr/bin/env python3
"""A gateway in front of a fleet whose pods keep being replaced: does Envoy's memory level off?

One real Envoy (the built filter, or with `--runtime dynamic` the module) routes for one pool
whose pods are all new in every snapshot, as in a fleet that autoscales and rolls out without
end. Each generation pushes a snapshot of `--pods` pods at addresses never used before, then
sends `--requests` chat requests at once, each picked one of those pods. The addresses are made
up (on loopback, where nothing listens): Envoy's connection to the picked one is refused, and its
retry goes to the one stub pod that serves. Only the filter's state and stats keep them. Every `--every` generations it prints Envoy's resident
memory (/proc VmRSS), the number of per-pod pick counters Envoy shows, and the requests per
second of the stretch, and the size of one Prometheus scrape of Envoy (`/stats/prometheus`).

Each `--max-pod-stats` value is one run, in turn, on a fresh Envoy (`none`: the largest limit the
filter takes, 1,048,576, far beyond the pods a run picks):
with the default (4,096) the per-pod counters stop growing at the limit, and later pods' picks are
counted as pod `other`; without a limit Envoy keeps a counter, and Prometheus a series, for
every pod ever picked. What else the filter keeps per pod (in-flight tables, prefix records,
adapter homes) follows the snapshot and must not grow either: the memory column says whether
anything does.

    make setup build
    .venv/bin/python scripts/pod_churn.py [--generations 3000] [--pods 8] [--requests 8]
        [--max-pod-stats 4096 --max-pod-stats none] [--runtime wasm|dynamic]
"""

import argparse
import concurrent.futures
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from harness import Envoy, snapshot  # noqa: E402
from stubpod import StubPod  # noqa: E402

POOL = "churn"


def address(k):
    """The k-th made-up pod address: 127.a.b.c, port 8000 (loopback; nothing is sent there)."""
    return f"127.{1 + k // 62_500 % 250}.{k // 250 % 250}.{1 + k % 250}:8000"


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pick_counters(gw):
    """Per-pod pick counters Envoy shows, and whether `other` is among them."""
    names = [n for n in gw.stats("gpuroute") if n.endswith(".picks") or ".gpuroute_endpoint." in n]
    return len(names), any(n.endswith(".other.picks") or n.endswith(".gpuroute_endpoint.other") for n in names)


def scrape_kb(gw):
    with urllib.request.urlopen(f"http://{gw.admin}/stats/prometheus", timeout=30) as r:
        return len(r.read()) / 1024


def run(limit, args, pod):
    config = {"pools": [{"name": POOL, "models": ["m"]}], "scoring": {"stale_after_ms": 600_000}}
    config["max_pod_stats"] = 1 << 20 if limit == "none" else int(limit)
    gw = Envoy("filter", [{"name": POOL, "endpoints": [pod.address]}], config, runtime=args.runtime)
    rows = []
    clients = concurrent.futures.ThreadPoolExecutor(max_workers=args.requests)
    try:
        t0, sent0 = time.time(), 0
        sent = 0
        for g in range(args.generations + 1):
            pods = [{"address": address(g * args.pods + i)} for i in range(args.pods)]
            status = gw.push(snapshot({POOL: pods}))[0]
            if status != 204:
                raise SystemExit(f"generation {g}: push answered {status}")
            # The same prompts every generation: the prefix index (which fills up to its own
            # bound, `prefix.index_entries`, with new prompts) keeps a few entries whose pods
            # change, so what grows is what the filter keeps per pod.
            answers = clients.map(lambda r: gw.chat("m", f"request {r}")[0], range(args.requests))
            if any(status != 200 for status in answers):
                raise SystemExit(f"generation {g}: a request was not served")
            sent += args.requests
            if g % args.every == 0:
                time.sleep(0.1)  # the filter's batched counts reach Envoy (tick_ms, 20 ms)
                counters, other = pick_counters(gw)
                now = time.time()
                rps = (sent - sent0) / (now - t0) if g else float("nan")
                rows.append((g, g * args.pods + args.pods, rss_mb(gw.proc.pid), counters, other, rps, scrape_kb(gw)))
                print(f"  max_pod_stats {limit:>5}  generation {g:>6}  pods seen {rows[-1][1]:>7}  "
                      f"Envoy RSS {rows[-1][2]:7.1f} MB  per-pod counters {counters:>6}"
                      f"{' (+other)' if other else ''}  scrape {rows[-1][6]:7.0f} KB  {rps:6.1f} requests/s",
                      flush=True)
                t0, sent0 = time.time(), sent
        if not gw.alive():
            raise SystemExit("Envoy exited")
    finally:
        clients.shutdown()
        gw.stop()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=3000)
    ap.add_argument("--pods", type=int, default=8, help="pods per snapshot, all new each generation")
    ap.add_argument("--requests", type=int, default=8, help="requests per generation, sent at once")
    ap.add_argument("--every", type=int, default=500, help="print every this many generations")
    ap.add_argument("--max-pod-stats", action="append", help="a limit, or `none` (default: 4096 and none)")
    ap.add_argument("--runtime", choices=["wasm", "dynamic"], default="wasm")
    args = ap.parse_args()
    limits = args.max_pod_stats or ["4096", "none"]
    print(f"{args.runtime}: {args.generations} generations of {args.pods} new pods, "
          f"{args.requests} requests each, one Envoy worker")
    pod = StubPod("served")
    try:
        results = {limit: run(limit, args, pod) for limit in limits}
    finally:
        pod.close()
    print("\nlimit   RSS first row -> last (MB), per-pod counters and scrape size at the end")
    for limit, rows in results.items():
        first, last = rows[0], rows[-1]
        print(f"{limit:>5}   {first[2]:7.1f} -> {last[2]:7.1f}  ({last[2] - first[2]:+.1f}), {last[3]} counters"
              f"{' (+other)' if last[4] else ''}, {last[6]:.0f} KB")


if __name__ == "__main__":
    main()
