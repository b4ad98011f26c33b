#!/usr/bin/env python3
"""What one tick of the proxy-wasm filter costs, in CPU instructions (callgrind), for the worker
that serves requests and for a worker that serves none.

Runs scripts/envoy_instructions.py twice with `--serving-thread` and `--workers N`: once with the
tick left out (tick_ms 10 minutes) and once with it every `--tick-ms` (default 200 ms: long
beside the tick's own cost under valgrind, so ticks fire on time). Each run counts every
gateway's threads apart over the same requests on one worker. Then, per gateway:
  serving worker, per tick = (its instructions with ticks - without) / ticks
  idle worker, per tick    = (the other threads' instructions with ticks - without)
                             / ticks / (N - 1)
where ticks = the counted run's seconds / tick period. The serving worker exchanges with the
others on its request path (under valgrind on every request); an idle worker only on its tick,
and it also reads the serving worker's new prefix records. The main thread is among the "other
threads", with little to do on the tick (its tick does nothing but flush metrics).

Usage: scripts/envoy_tick_cost.py [--workers 8] [--tick-ms 200] [--requests 1000]
                                  [--compare-wasm NAME=PATH ...] [--only NAME ...]
Writes target/bench/envoy-tick-cost.json. Needs valgrind.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "target" / "bench" / "envoy-instructions.json"


def run(args, tick_ms):
    cmd = [sys.executable, str(ROOT / "scripts" / "envoy_instructions.py"), "--serving-thread",
           "--workers", str(args.workers), "--requests", str(args.requests)]
    for c in args.compare_wasm:
        cmd += ["--compare-wasm", c]
    for o in args.only or ["filter"] + [c.split("=", 1)[0] for c in args.compare_wasm]:
        cmd += ["--only", o]
    if tick_ms:
        cmd += ["--tick-ms", str(tick_ms)]
    subprocess.run(cmd, check=True)
    return json.loads(RESULT.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tick-ms", type=int, default=200)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--compare-wasm", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="gateways to count (default: filter and the --compare-wasm builds)")
    args = ap.parse_args()
    if args.workers < 2:
        sys.exit("--workers must be 2 or more (an idle worker is one of them)")
    without = run(args, None)
    with_tick = run(args, args.tick_ms)
    n = args.requests
    costs = {}
    for name, serving in with_tick["instructions_per_request"].items():
        if name not in without["instructions_per_request"]:
            continue
        ticks = with_tick["seconds"][name] * 1000 / args.tick_ms
        others = (with_tick["every_thread_per_request"][name] - serving
                  - (without["every_thread_per_request"][name] - without["instructions_per_request"][name]))
        costs[name] = {
            "ticks": ticks,
            "serving_worker_per_tick": (serving - without["instructions_per_request"][name]) * n / ticks,
            "idle_worker_per_tick": others * n / ticks / (args.workers - 1),
        }
    print(f"\n{args.workers} Envoy workers, tick every {args.tick_ms} ms, {n} requests on one worker: "
          "instructions per tick (callgrind)")
    print(f"  {'gateway':14} {'ticks':>6} {'serving worker':>15} {'idle worker':>12}")
    for name, c in costs.items():
        print(f"  {name:14} {c['ticks']:6.0f} {c['serving_worker_per_tick']:15,.0f} {c['idle_worker_per_tick']:12,.0f}")
    out = ROOT / "target" / "bench" / "envoy-tick-cost.json"
    out.write_text(json.dumps({"workers": args.workers, "tick_ms": args.tick_ms, "requests": n,
                               "per_tick": costs, "without_tick": without, "with_tick": with_tick}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
