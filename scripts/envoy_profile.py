#!/usr/bin/env python3
"""Where an Envoy worker's time goes, with and without the filter: `perf record` on the gateway
Envoy (one worker) under the same 16-connection 4 KB chat load as `envoy_overhead.py`, then the
split of its samples by code (Envoy's own binary, the kernel, the filter's JIT-compiled wasm)
and per request in microseconds (the worker is at 100% of a core in both configurations).

Needs `perf` (linux-perf) and permission to profile (root, or perf_event_paranoid <= 1).
Usage: scripts/envoy_profile.py [--seconds 8]
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_overhead as eo  # noqa: E402
from harness import Envoy, Pusher  # noqa: E402  (tests/e2e, put on the path by envoy_overhead)


def profile(mode, seconds, work):
    body_file = work / "chat.json"
    body_file.write_bytes(eo.chat_body())
    up = eo.Upstream()
    pools = [{"name": "llama", "endpoints": up.addresses()}]
    gw = Envoy(mode, pools, eo.CONFIG)
    pods = {"llama": [{"address": a, "running": 4, "kv_cache_usage": 0.3} for a in up.addresses()]}
    pusher = Pusher([gw], pods) if mode == "filter" else None
    data = work / f"{mode}.perf"
    try:
        eo.load([("gw", gw)], body_file, 16, 2)  # warm-up
        perf = subprocess.Popen(["perf", "record", "-F", "2000", "-p", str(gw.proc.pid), "-o", str(data),
                                 "--", "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rps = eo.load([("gw", gw)], body_file, 16, seconds)["gw"]["rps"]
        perf.wait()
    finally:
        if pusher:
            pusher.stop()
        gw.stop()
        up.stop()
    out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso", "-g", "none"],
                         capture_output=True, text=True, check=True).stdout
    shares = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(.+?)\s*$", line)
        if m:
            dso = m.group(2)
            name = "filter (JIT wasm)" if dso.startswith("[JIT]") else "kernel" if "kernel" in dso else dso
            shares[name] = shares.get(name, 0.0) + float(m.group(1))
    return rps, shares


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("perf is not installed (Debian: apt install linux-perf)")
    work = Path(tempfile.mkdtemp(prefix="gpuroute-profile-"))
    for mode in ("round_robin", "filter"):
        rps, shares = profile(mode, args.seconds, work)
        per_req = 1e6 / rps
        label = "plain Envoy" if mode == "round_robin" else "with the filter"
        print(f"{label}: {rps:.0f} req/s, {per_req:.0f} us of worker time per request")
        for name, pct in sorted(shares.items(), key=lambda kv: -kv[1]):
            if pct >= 0.5:
                print(f"  {name:20s} {pct:5.1f}%  {pct * per_req / 100:6.1f} us")


if __name__ == "__main__":
    main()
