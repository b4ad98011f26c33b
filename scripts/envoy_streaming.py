#!/usr/bin/env python3
"""What the filter costs on streamed responses and when the gateway is idle.

Envoy calls the filter for every response chunk (proxy-wasm cannot stop the calls after the
first one, which is the only one the filter needs), and the filter has background work: its
tick every `tick_ms` and the snapshot pushes. This measures both, on the gateway Envoy's CPU
time (user + system from /proc), plain Envoy against Envoy with the proxy-wasm filter and with
the dynamic-module build ("module", libgpuroute.so), same upstream:

  idle        gateway CPU per second with no traffic: without a snapshot, while snapshots are
              pushed every 100 ms (as sidecar-metrics does), and with a snapshot but no pushes;
  streaming   open-loop streamed chat requests (loadgen, Poisson) against 4 `sse-stub` pods
              that send one SSE chunk per token every 5 ms; gateway CPU per request for short
              (8 tokens) and long (128 tokens) streams. The slope between the two is the cost
              per chunk; a build's extra per chunk is its slope minus plain Envoy's.

At a low request rate the per-request figures include each configuration's background cost
divided by the rate, which is why the idle figures are reported beside them.

Usage: scripts/envoy_streaming.py [--rate 60] [--seconds 10] [--rounds 3]
Writes target/bench/envoy-streaming.json.
"""

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_overhead as eo  # noqa: E402
from harness import BUILDS, Envoy, Pusher, cpu_seconds, free_port, scratch  # noqa: E402  (tests/e2e, on the path via envoy_overhead)

ROOT = eo.ROOT
RELEASE = ROOT / "target" / "release"
SHORT, LONG = 8, 128




def start_stubs(n):
    procs, addrs = [], []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen([str(RELEASE / "sse-stub"), "--listen", f"127.0.0.1:{port}", "--threads", "1",
                                       "--token-interval-ms", "5", "--max-tokens", "1000"], stdout=subprocess.DEVNULL))
        addrs.append(f"127.0.0.1:{port}")
    time.sleep(0.5)
    return procs, addrs


def idle_cpu(gateways, seconds):
    """CPU milliseconds per second of each gateway over `seconds` of no traffic."""
    out = {}
    for name, gw in gateways:
        c0 = cpu_seconds(gw.proc.pid)
        time.sleep(seconds)
        out[name] = (cpu_seconds(gw.proc.pid) - c0) * 1000 / seconds
    return out


def stream_round(gw, rate, seconds, tokens, seed, work):
    out = work / f"{gw.listen.replace(':', '_')}-{tokens}-{seed}.json"
    c0 = cpu_seconds(gw.proc.pid)
    subprocess.run([str(RELEASE / "loadgen"), "--target", f"http://{gw.listen}", "--model", "llama-3-8b", "--out", str(out),
                    "--workload", f"poisson:rate={rate},duration={seconds},prompt=200,output={tokens},seed={seed}"],
                   check=True, capture_output=True)
    cpu = cpu_seconds(gw.proc.pid) - c0
    records = json.loads(out.read_text())["records"]
    ok = [r for r in records if r["status"] == 200]
    return {"cpu_us_per_request": cpu * 1e6 / max(1, len(ok)), "requests": len(records), "ok": len(ok),
            "tokens_per_request": sum(r.get("output_tokens", 0) for r in ok) / max(1, len(ok))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for binary in ("sse-stub", "loadgen"):
        if not (RELEASE / binary).exists():
            sys.exit("build first: make native")
    work = scratch("gpuroute-streaming-")
    stubs, addrs = start_stubs(4)
    pools = [{"name": "llama", "endpoints": addrs}]
    plain = Envoy("round_robin", pools, eo.CONFIG)
    filt = Envoy("filter", pools, eo.CONFIG, runtime="wasm")
    module = Envoy("filter", pools, eo.CONFIG, runtime="dynamic")
    gateways = (("plain", plain), ("filter", filt), ("module", module))
    # For the idle figures only: the filter with its tick at tick_ms throughout (idle_tick_ms 0),
    # as before idle workers slowed their tick.
    fixed = Envoy("filter", pools, dict(eo.CONFIG, idle_tick_ms=0), runtime="wasm")
    idle_gateways = (*gateways, ("filter_fixed_tick", fixed))
    ours = {name: (prefix, path) for name, (_, prefix, path) in BUILDS.items()}
    pods = {"llama": [{"address": a, "running": 4, "kv_cache_usage": 0.3} for a in addrs]}
    res = {"setup": {"upstream": "4 sse-stub pods, one SSE chunk per token every 5 ms", "rate_per_s": args.rate,
                     "seconds_per_run": args.seconds, "rounds": args.rounds, "tokens": [SHORT, LONG], "gateway_workers": 1,
                     "machine": "2 cores shared by client, gateway Envoys and upstream"},
           "idle_cpu_ms_per_s": {}, "streaming": {name: {SHORT: [], LONG: []} for name, _ in gateways}}
    pusher = None
    try:
        res["idle_cpu_ms_per_s"]["no_snapshot"] = idle_cpu(idle_gateways, 10)
        pusher = Pusher([filt, module, fixed], pods)
        res["idle_cpu_ms_per_s"]["pushes_every_100ms"] = idle_cpu(idle_gateways, 10)
        for r in range(args.rounds):
            for tokens in (SHORT, LONG):
                order = gateways if r % 2 == 0 else gateways[::-1]
                for name, gw in order:
                    row = stream_round(gw, args.rate, args.seconds, tokens, r + 1, work)
                    res["streaming"][name][tokens].append(row)
                    print(f"round {r + 1}, {tokens} tokens, {name}: {row['cpu_us_per_request']:.0f} us CPU per request "
                          f"({row['ok']}/{row['requests']} ok)", flush=True)
        pusher.stop()
        pusher = None
        res["idle_cpu_ms_per_s"]["snapshot_no_pushes"] = idle_cpu(idle_gateways, 10)
        res["picked"] = {name: gw.stat(f"{ours[name][0]}gpuroute.pool.llama.requests.picked")
                         for name, gw in gateways if name in ours}
        res["builds"] = {name: {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                         for name, (_, path) in ours.items()}
    finally:
        if pusher:
            pusher.stop()
        for _, gw in idle_gateways:
            gw.stop()
        for s in stubs:
            s.terminate()

    med = {name: {t: statistics.median(x["cpu_us_per_request"] for x in rows) for t, rows in by.items()}
           for name, by in res["streaming"].items()}
    slope = {name: (m[LONG] - m[SHORT]) / (LONG - SHORT) for name, m in med.items()}
    res["median_cpu_us_per_request"] = med
    res["cpu_us_per_chunk"] = slope
    res["extra_us_per_chunk"] = {name: slope[name] - slope["plain"] for name in ours}
    out = ROOT / "target" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "envoy-streaming.json").write_text(json.dumps(res, indent=1))
    print("\nidle gateway CPU, ms per second (plain / proxy-wasm filter / dynamic module / proxy-wasm filter "
          "with its tick at tick_ms throughout):")
    for k, v in res["idle_cpu_ms_per_s"].items():
        print(f"  {k:22s} {v['plain']:.1f} / {v['filter']:.1f} / {v['module']:.1f} / {v['filter_fixed_tick']:.1f}")
    print(f"streamed requests at {args.rate:g}/s, median gateway CPU per request (plain / filter / module):")
    for t in (SHORT, LONG):
        print(f"  {t:4d} tokens: {med['plain'][t]:.0f} / {med['filter'][t]:.0f} / {med['module'][t]:.0f} us")
    print(f"per chunk: plain {slope['plain']:.1f} us, proxy-wasm filter {slope['filter']:.1f} us "
          f"(+{res['extra_us_per_chunk']['filter']:.1f}), dynamic module {slope['module']:.1f} us "
          f"(+{res['extra_us_per_chunk']['module']:.1f})")
    for name, (_, path) in ours.items():
        print(f"{name} picks counted: {res['picked'][name]} ({path.name} sha256 {res['builds'][name]['sha256'][:12]})")
        if not res["picked"][name]:
            print(f"WARNING: the {name} build counted no picks: is it the one committed?")


if __name__ == "__main__":
    main()
