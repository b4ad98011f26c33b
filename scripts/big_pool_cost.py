#!/usr/bin/env python3
"""CPU per request through Envoy for one large pool: this .wasm against another build, by wall
clock.

One pool of N pods: the 8 upstream ports (`envoy_overhead.Upstream`, equally loaded) and N - 8
unhealthy addresses, never picked, so scoring is the same at every N and what grows with N is
the work on the pool's tables (the in-flight tables the workers exchange, their alignment with
the snapshot). Each run: a fresh Envoy with `--workers` workers and the filter build, one
snapshot, `httpload` with 2 connections per worker for `--seconds` after a warm-up, the gateway
Envoy's CPU from /proc. The builds alternate, `--rounds` times per pool size. A shared machine's
noise is the spread between rounds of one build; compare builds within a round.

Usage: scripts/big_pool_cost.py --base OTHER.wasm [--pods 8 1000 10000] [--rounds 2]
                                [--workers 4] [--seconds 5]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "scripts"))
import harness  # noqa: E402
from envoy_overhead import Upstream  # noqa: E402

WASM = ROOT / "target" / "wasm32-wasip1" / "wasm-release" / "gpuroute_filter.wasm"
HTTPLOAD = ROOT / "target" / "release" / "httpload"


def run(n, wasm, workers, seconds):
    """(requests/s, CPU us per request, errors) of one run."""
    up = Upstream()
    addrs = up.addresses()
    env = harness.Envoy("filter", [{"name": "p", "endpoints": addrs}],
                        {"pools": [{"name": "p", "models": ["m"]}], "scoring": {"stale_after_ms": 600_000}},
                        concurrency=workers, runtime="wasm", wasm=wasm)
    try:
        pods = [{"address": a, "running": 4, "kv_cache_usage": 0.3} for a in addrs]
        pods += [{"address": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:8000", "healthy": False}
                 for i in range(n - len(addrs))]
        answer = env.push(harness.snapshot({"p": pods}))
        if answer[0] != 204:
            raise RuntimeError(f"snapshot of {n} pods refused: {answer[:3]}")
        body = harness.work_dir("body-") / "b.json"
        body.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 100}]}))
        r = subprocess.run([str(HTTPLOAD), "--addr", env.listen, "--pid", str(env.proc.pid), "--body-file", str(body),
                            "--connections", str(2 * workers), "--duration-s", str(seconds), "--warmup", "50"],
                           capture_output=True, text=True, check=True)
        t = json.loads(r.stdout)["targets"][0]
        return t["rps"], t["cpu_us_per_request"], t["errors"]
    finally:
        env.stop()
        up.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, required=True, help="the other build's .wasm")
    ap.add_argument("--pods", type=int, nargs="+", default=[8, 1000, 10_000])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=5)
    args = ap.parse_args()
    for path in (args.base, WASM, HTTPLOAD):
        if not path.is_file():
            sys.exit(f"missing {path} (make build)")
    harness.scratch("gpuroute-big-pool-")
    for n in args.pods:
        for rnd in range(args.rounds):
            for name, wasm in (("base", args.base), ("this", WASM)):
                rps, cpu, errors = run(max(n, 8), wasm, args.workers, args.seconds)
                print(f"pods {n:6}  {name:4}  round {rnd}: {rps:7.0f} requests/s, {cpu:5.0f} us CPU a request"
                      f"{f', {errors} errors' if errors else ''}", flush=True)


if __name__ == "__main__":
    main()
