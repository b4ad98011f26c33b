#!/usr/bin/env python3
"""The offline replay on several gateway set-ups: one filter engine, workers of one Envoy,
gateway replicas (as shipped: prefix records and requests in prefill relayed between them; and
without either relay, and with the requests in prefill relayed later).

Prints, per scenario, the filter's mean / p99 TTFT, its ratios to one engine paired workload by
workload (mean of the per-workload ratios), its prefix hit rate, and the baselines' mean TTFT
on the same gateways. bench/README.md, "Workers and gateway replicas".

    cargo build --release -p gpuroute-bench
    python3 scripts/replay_gateways.py [--workloads 8] [--scenario NAME ...]
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["mixed-gpu", "uniform-steady", "bursty", "shared-prefix", "multi-lora", "burst-pool"]
SETUPS = [
    ("one engine", []),
    ("2 workers", ["--workers", "2"]),
    ("4 workers", ["--workers", "4"]),
    ("2 replicas", ["--replicas", "2"]),
    ("3 replicas", ["--replicas", "3"]),
    ("3 replicas, prefill counts in 20 ms", ["--replicas", "3", "--load-relay-ms", "20"]),
    ("2 replicas, no prefill counts", ["--replicas", "2", "--no-load-relay"]),
    ("3 replicas, no prefill counts", ["--replicas", "3", "--no-load-relay"]),
    ("3 replicas, no prefix relay", ["--replicas", "3", "--no-prefix-relay"]),
]


def runs(binary, scenario, workloads, extra):
    out = subprocess.run(
        [str(binary), "replay", scenario, "--workloads", str(workloads), "--json",
         "--configs", "filter,round_robin,least_request", *extra],
        capture_output=True, text=True, check=True,
    ).stdout
    by = {}
    for r in json.loads(out)["runs"]:
        by.setdefault(r["config"], []).append(r)
    return by


def mean(xs):
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", type=int, default=8)
    ap.add_argument("--scenario", action="append", help="default: all six")
    ap.add_argument("--binary", default=str(ROOT / "target/release/bench-scenario"))
    a = ap.parse_args()
    if not Path(a.binary).exists():
        sys.exit(f"{a.binary}: build it first (cargo build --release -p gpuroute-bench)")
    for s in a.scenario or SCENARIOS:
        one = None
        print(f"== {s} ({a.workloads} workloads)")
        print(f"{'gateways':40} {'mean ms':>8} {'p99 ms':>8} {'vs one (mean/p99)':>18} "
              f"{'prefix':>7} {'RR mean':>8} {'LR mean':>8}")
        for name, extra in SETUPS:
            by = runs(a.binary, s, a.workloads, extra)
            f = by["filter"]
            one = one or f
            q = [r["ttft_ms"] for r in f]
            ratio_mean = mean([x["ttft_ms"]["mean"] / y["ttft_ms"]["mean"] for x, y in zip(f, one)])
            ratio_p99 = mean([x["ttft_ms"]["p99"] / y["ttft_ms"]["p99"] for x, y in zip(f, one)])
            hits = [r["prefix_hit_rate"] for r in f if r["prefix_hit_rate"] is not None]
            hit = f"{100 * mean(hits):.1f}%" if hits else "-"
            rr = mean([r["ttft_ms"]["mean"] for r in by["round_robin"]])
            lr = mean([r["ttft_ms"]["mean"] for r in by["least_request"]])
            print(f"{name:40} {mean([x['mean'] for x in q]):8.1f} {mean([x['p99'] for x in q]):8.1f} "
                  f"{ratio_mean:8.3f}/{ratio_p99:.3f}{'':3} {hit:>7} {rr:8.1f} {lr:8.1f}")
        print()


if __name__ == "__main__":
    main()
