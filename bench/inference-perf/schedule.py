#!/usr/bin/env python3
"""Write a scenario's request schedule as an Azure-format CSV both load generators replay.

  schedule.py SCENARIO OUT.csv [--duration-s D] [--rate R] [--seed N]

The cross-check must give inference-perf and the project's loadgen the *same* offered
load. Both replay an Azure public-dataset CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`):
inference-perf with `load.type: trace_replay` + `data.type: random` + `data.trace`, loadgen
as a `{"kind": "trace", "speedup": 1}` workload. This script makes that CSV from a Poisson
scenario (mixed-gpu, uniform-steady, ...) by porting loadgen's own generator
(bench/src/rng.rs SplitMix64 and bench/src/workload.rs `build_poisson`): same seed, same
arrival stream (derive(seed, 1)), same length stream (derive(seed, 2)) drawing
(ContextTokens, GeneratedTokens) pairs from random rows of `lengths_from_trace`. So the CSV
holds exactly the requests `loadgen --workload SCENARIO` sends (checked: mixed-gpu gives
1,577 requests, mean prompt 1,130.5 and output 217.5 tokens, as `loadgen --dry-run`
prints), shifted so the first request is at 0 (a trace replay starts at its first row).
"""

import argparse
import csv
import datetime as dt
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
M64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & M64

    @classmethod
    def derive(cls, seed, key):
        return cls(mix64(seed ^ mix64((key + GOLDEN_GAMMA) & M64)))

    def next_u64(self):
        self.state = (self.state + GOLDEN_GAMMA) & M64
        return mix64(self.state)

    def next_f64(self):
        return (self.next_u64() >> 11) / float(1 << 53)

    def exponential(self, rate):
        return -math.log(1.0 - self.next_f64()) / rate

    def below(self, n):
        return (self.next_u64() * n) >> 64


def read_azure_lengths(path):
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in rows]


def read_azure_rows(path):
    """[(offset_s, ContextTokens, GeneratedTokens)] of an Azure-format CSV, offsets from its first row."""
    with open(path, newline="") as f:
        rows = [(dt.datetime.strptime(r["TIMESTAMP"].strip()[:26], "%Y-%m-%d %H:%M:%S.%f"), int(r["ContextTokens"]),
                 int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return [((t - rows[0][0]).total_seconds(), p, o) for t, p, o in rows]


def poisson_schedule(workload, base_dir, duration=None, rate=None, seed=None):
    """[(at_s, prompt_tokens, max_tokens)], as loadgen's build_poisson makes them."""
    if workload.get("kind") != "poisson" or "lengths_from_trace" not in workload:
        raise SystemExit("only Poisson scenarios with lengths_from_trace are supported")
    if workload.get("token_scale", 1.0) != 1.0 or workload.get("shared_prefix") or workload.get("max_requests"):
        raise SystemExit("token_scale, shared_prefix and max_requests are not ported")
    rate = rate or workload["rate_per_s"]
    duration = duration or workload["duration_s"]
    seed = workload.get("seed", 1) if seed is None else seed
    trace = Path(workload["lengths_from_trace"])
    for cand in (trace, base_dir / trace, ROOT / trace):
        if cand.exists():
            trace = cand
            break
    rows = read_azure_lengths(trace)
    arrivals, lengths = SplitMix64.derive(seed, 1), SplitMix64.derive(seed, 2)
    cap = workload.get("max_output_tokens")
    out = []
    t = arrivals.exponential(rate)
    while t <= duration:
        p, o = rows[lengths.below(len(rows))]
        o = max(o, 1)
        if cap:
            o = min(o, max(cap, 1))
        out.append((t, max(p, 1), o))
        t += arrivals.exponential(rate)
    return out


# The lead-in request: 1 prompt token, 2 output tokens (inference-perf reports no TTFT for a
# one-token response), `lead_in_s` before the schedule's first request.
LEAD_IN_ROW = (1, 2)


def write_csv(schedule, path, lead_in_s=0.0):
    """Azure format, microsecond timestamps (inference-perf's resolution). The first request is at
    0; with `lead_in_s`, a tiny lead-in request is at 0 and the schedule starts lead_in_s later.

    Why a lead-in: inference-perf builds every prompt in its worker processes (random vocabulary
    tokens, re-tokenized until the length is exact: ~4 ms per 1,155-token prompt here) as soon
    as the requests are queued, one second before the first send time, on the same event loop
    that sends and times the requests. The whole schedule is queued at once, so for the first
    seconds its timestamps wait behind prompt building (measured against sse-stub: first 5 s of
    mixed-gpu, TTFT +12.6 ms at the median and p99 188 ms where the server answers in 50 ms).
    A trace replay starts at its first row, so a row lead_in_s earlier gives it that time. Both
    tools replay the same file, so both send the lead-in request; the runner leaves it out of its
    own statistics (row 0)."""
    t0 = schedule[0][0]
    base = dt.datetime(2024, 1, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ([(0.0, *LEAD_IN_ROW)] if lead_in_s > 0 else []) + [(lead_in_s + at - t0, p, o) for at, p, o in schedule]
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for at, p, o in rows:
            ts = base + dt.timedelta(microseconds=round(at * 1e6))
            f.write(f"{ts.strftime('%Y-%m-%d %H:%M:%S.%f')},{p},{o}\n")


def describe(schedule):
    n = len(schedule)
    span = schedule[-1][0] - schedule[0][0]
    return {"requests": n, "span_s": round(span, 3), "mean_prompt_tokens": round(sum(s[1] for s in schedule) / n, 1),
            "mean_output_tokens": round(sum(s[2] for s in schedule) / n, 1),
            "offered_rate_per_s": round((n - 1) / span, 2) if span > 0 else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", help="name (bench/scenarios/NAME.json) or file")
    ap.add_argument("out")
    ap.add_argument("--duration-s", type=float)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--lead-in-s", type=float, default=0.0, help="a tiny request this long before the schedule")
    args = ap.parse_args()
    f = ROOT / "bench" / "scenarios" / f"{args.scenario}.json"
    if not f.exists():
        f = Path(args.scenario)
    sc = json.loads(f.read_text())
    sched = poisson_schedule(sc["workload"], f.parent, args.duration_s, args.rate, args.seed)
    write_csv(sched, Path(args.out), args.lead_in_s)
    json.dump(describe(sched), sys.stdout)
    print()


if __name__ == "__main__":
    main()
