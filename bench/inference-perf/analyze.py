#!/usr/bin/env python3
"""Request-by-request comparison of one inference-perf run and one loadgen run of the same schedule.

  analyze.py RUN_DIR_INFERENCE_PERF RUN_DIR_LOADGEN SCHEDULE.csv [--bins 4]

(run dirs as scripts/inference_perf.py leaves them: target/bench/inference-perf/runs/SCENARIO/ROUTER/TOOL-N).
Both tools replayed the same CSV, so request i of one is request i of the other. loadgen records
carry the row index (`id`); inference-perf's per-request report does not, so its records are
ranked by send time (`start_time`) and the match is checked against the server-reported
`completion_tokens`, which must equal the row's GeneratedTokens (fleet-sim generates exactly
max_tokens). The lead-in request schedule.py may put first is left out. Prints the matched
share, the paired TTFT difference (inference-perf - loadgen) quantiles, the same per time bin
of the schedule (from its first request; a client warm-up shows in the first bin), and each
tool's TTFT percentiles per bin. The pairing means something only where the same request meets
the same pod in both runs: with Envoy's round robin it does not (its rotation starts somewhere
else every run), so there only the distributions compare.
"""

import argparse
import csv
import datetime as dt
import json
from pathlib import Path


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def load_schedule(path):
    with open(path, newline="") as f:
        return [(int(r["ContextTokens"]), max(1, int(r["GeneratedTokens"]))) for r in csv.DictReader(f)]


def has_lead_in(path):
    """Row 0 is schedule.py's lead-in request (1 prompt token, 2 output tokens, >= 1 s before row 1)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[:2]
    if len(rows) < 2 or (rows[0]["ContextTokens"], rows[0]["GeneratedTokens"]) != ("1", "2"):
        return False
    t = [dt.datetime.strptime(r["TIMESTAMP"], "%Y-%m-%d %H:%M:%S.%f") for r in rows]
    return (t[1] - t[0]).total_seconds() >= 1.0


def ip_by_row(run_dir, schedule):
    per = json.loads((Path(run_dir) / "report" / "per_request_lifecycle_metrics.json").read_text())
    per.sort(key=lambda r: r["start_time"])
    t0 = per[0]["start_time"]
    rows, matched = {}, 0
    for i, r in enumerate(per[: len(schedule)]):
        usage = ((r.get("info") or {}).get("response_metrics") or {}).get("server_usage") or {}
        ok = usage.get("completion_tokens") == schedule[i][1]
        matched += ok
        ttft = (r.get("computed_metrics") or {}).get("time_to_first_token")
        rows[i] = {"ttft_ms": None if ttft is None or r.get("error") else ttft * 1e3,
                   "sent_s": r["start_time"] - t0, "matched": ok}
    return rows, matched / max(1, len(per))


def lg_by_row(run_dir):
    d = json.loads((Path(run_dir) / "results.json").read_text())
    return {r["id"]: {"ttft_ms": r["ttft_ms"] if r.get("error") is None else None, "sent_s": r["sent_ms"] / 1e3,
                      "pod": r.get("served_by")} for r in d["records"]}


def analyze(ip_dir, lg_dir, schedule_csv, bins=4):
    schedule = load_schedule(schedule_csv)
    first = 1 if has_lead_in(schedule_csv) else 0
    ip, matched = ip_by_row(ip_dir, schedule)
    lg = lg_by_row(lg_dir)
    pairs = [(i, ip[i]["ttft_ms"], lg[i]["ttft_ms"]) for i in range(first, len(schedule))
             if i in ip and i in lg and ip[i]["ttft_ms"] is not None and lg[i]["ttft_ms"] is not None
             and ip[i]["matched"]]
    diffs = [a - b for _, a, b in pairs]
    out = {"matched_share": round(matched, 4), "pairs": len(pairs),
           "paired_diff_ms": {f"p{p}": round(pct(diffs, p), 2) for p in (10, 50, 90)}, "bins": []}
    t0 = min(lg[i]["sent_s"] for i in lg if i >= first)
    span = (max(lg[i]["sent_s"] for i in lg) - t0) or 1.0
    for b in range(bins):
        lo, hi = span * b / bins, span * (b + 1) / bins
        sel = [(a, c) for i, a, c in pairs
               if lo <= lg[i]["sent_s"] - t0 < hi or (b == bins - 1 and lg[i]["sent_s"] - t0 >= hi)]
        a = [x for x, _ in sel]
        c = [y for _, y in sel]
        out["bins"].append({"from_s": round(lo, 1), "to_s": round(hi, 1), "n": len(sel),
                            "inference_perf_ms": {p: round(pct(a, q), 1) for p, q in (("p50", 50), ("p99", 99))},
                            "loadgen_ms": {p: round(pct(c, q), 1) for p, q in (("p50", 50), ("p99", 99))},
                            "paired_diff_p50_ms": round(pct([x - y for x, y in sel], 50), 2)})
    return out


def ttfts_by_row(run_dir):
    """TTFT (s, None if failed) per schedule row, from either tool's run dir."""
    run_dir = Path(run_dir)
    if (run_dir / "results.json").exists():
        recs = sorted(json.loads((run_dir / "results.json").read_text())["records"], key=lambda r: r["id"])
        return [r["ttft_ms"] / 1e3 if r.get("error") is None and r.get("ttft_ms") is not None else None for r in recs]
    per = sorted(json.loads((run_dir / "report" / "per_request_lifecycle_metrics.json").read_text()),
                 key=lambda r: r["start_time"])
    return [None if r.get("error") else (r.get("computed_metrics") or {}).get("time_to_first_token") for r in per]


def rr_phase(run_dir, pods=4, slow=2):
    """Round robin sends request i to pod (start + i) mod `pods`, `start` drawn at random when Envoy
    starts. On a fleet with `slow` slow pods, the requests of the slow pods' residues queue for
    seconds: the residues with the longest mean TTFT over the second half of the schedule name the
    phase a run had (what the runner's per-pod counters tell directly in newer runs)."""
    t = ttfts_by_row(run_dir)
    n = len(t)
    means = []
    for k in range(pods):
        xs = [t[i] for i in range(n // 2, n) if i % pods == k and t[i] is not None]
        means.append(sum(xs) / len(xs) if xs else 0.0)
    return tuple(sorted(sorted(range(pods), key=lambda k: -means[k])[:slow]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ip_dir", nargs="?")
    ap.add_argument("lg_dir", nargs="?")
    ap.add_argument("schedule", nargs="?")
    ap.add_argument("--bins", type=int, default=4)
    ap.add_argument("--rr-phase", nargs="+", metavar="RUN_DIR",
                    help="instead: each run's round-robin phase (slow residues mod 4) and TTFT p50/p90/p99")
    a = ap.parse_args()
    if a.rr_phase:
        for d in a.rr_phase:
            t = [x * 1e3 for x in ttfts_by_row(d) if x is not None]
            print(f"{d}\tslow residues {rr_phase(d)}\tTTFT p50 {pct(t, 50):.0f} p90 {pct(t, 90):.0f} "
                  f"p99 {pct(t, 99):.0f} ms")
        return
    print(json.dumps(analyze(a.ip_dir, a.lg_dir, a.schedule, a.bins), indent=1))


if __name__ == "__main__":
    main()
