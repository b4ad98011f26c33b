#!/usr/bin/env python3
"""Where the gateway Envoy's CPU goes per request, with and without the filter: `perf record`
(cpu-clock samples with DWARF call chains) on the gateway Envoy (one worker) under the same
16-connection 4 KB chat load as `envoy_overhead.py`, for plain Envoy, the proxy-wasm floor
(bench/wasm-floor), the floor with the three callbacks the filter has beyond it exported empty
(`make wasm` builds it) and the filter, one after the other, each measured `--reps` times.

Each sample is put in one class by the code it was taken in:
  kernel                the kernel (sockets, epoll, scheduling)
  envoy                 Envoy's binary (V8's runtime and builtins are linked into it), not
                        called from the VM: Envoy's own request path, including its side of
                        running a wasm filter (dispatching callbacks, buffering, re-routing)
  envoy, for the VM     Envoy's binary with a JIT-compiled wasm frame above it in the call
                        chain: host calls the wasm code makes (headers, body, shared data,
                        stats, the clock) and V8 builtins it calls
  wasm (JIT)            the wasm code V8 compiled (perf's /tmp/perf-PID.map)
  libc, other           the rest
A class's microseconds per request are its share of the samples times the gateway's CPU time
per request, which httpload counts from /proc over the same load (all the gateway's threads; on
this 2-core machine the gateway does not have a core to itself, so 1e6 / requests-per-second
would overstate it). perf's own overhead is in both; compare the gateways with each other, not
with `make bench-envoy`'s figures. Call chains through JIT frames unwind by frame pointer (V8
keeps them); a chain that stops early puts a host call's sample under "envoy".

Needs `perf` (linux-perf) and permission to profile the gateway (root, or
perf_event_paranoid <= 1 for the kernel's share).
The gateways take turns, `--seconds` each, `--reps` times over: this shared host's slow spells
last seconds, and in short turns they land on every gateway alike instead of on one (in 4-second
turns, two runs read the floor with the callbacks at +1 and +18 us over the floor). Even so, a
few microseconds between gateways are within the host's drift: six runs read Envoy's own path
with the filter at -3 to +14 us over the floor with the callbacks, while the filter's wasm code
read 8-10.5 us in every one. For the whole cost, `make bench-envoy` (paired quarter-second
turns) is the measure; this says where it goes.
Usage: scripts/envoy_profile.py [--seconds 1.5] [--reps 10]
Writes target/bench/envoy-profile.json (every turn's figures and the medians).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_overhead as eo  # noqa: E402
from harness import Envoy, Pusher  # noqa: E402  (tests/e2e, put on the path by envoy_overhead)

GATEWAYS = ("plain", "wasm_floor", "floor_callbacks", "filter")
CLASSES = ("kernel", "envoy", "envoy, for the VM", "wasm (JIT)", "libc", "other")


def classify(frames):
    """The class of one sample from its call chain's DSOs, innermost first."""
    frames = [d for d in frames if d != "inlined"] or ["?"]  # perf's inlined-call entries
    leaf = frames[0]
    jit = ["perf-" in d for d in frames]
    if jit[0]:
        return "wasm (JIT)"
    if "kernel" in leaf:
        return "kernel"
    if leaf.endswith("/envoy") or leaf == "[unknown]":
        return "envoy, for the VM" if any(jit[1:]) else "envoy"
    if "libc" in leaf:
        return "libc"
    return "other"


def split(data):
    """Shares (0..1) of `data`'s samples by class."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,dso"],
                         capture_output=True, text=True, check=True).stdout
    counts = dict.fromkeys(CLASSES, 0)
    for block in out.split("\n\n"):
        frames = []
        for line in block.splitlines():
            line = line.strip()
            if line:
                start = line.find("(")
                frames.append(line[start + 1:-1] if start >= 0 else "?")
        if frames:
            counts[classify(frames)] += 1
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


def profile(name, gw, body_file, seconds, work, rep):
    eo.load([(name, gw)], body_file, 16, 0.5)  # warm-up
    data = work / f"{name}-{rep}.perf"
    perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "2000", "--call-graph", "dwarf,8192",
                             "-p", str(gw.proc.pid), "-o", str(data), "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = eo.load([(name, gw)], body_file, 16, seconds, cpu=True)[name]
    perf.wait()
    return res["rps"], res["cpu_us_per_request"], split(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("perf is not installed (Debian: apt install linux-perf)")
    if not eo.FLOOR_WASM.exists() or not eo.FLOOR_CALLBACKS_WASM.exists():
        sys.exit("build first: make build")
    work = Path(tempfile.mkdtemp(prefix="gpuroute-profile-"))
    body_file = work / "chat.json"
    body_file.write_bytes(eo.chat_body())
    up = eo.Upstream()
    specs = eo.gateway_specs(up, eo.CONFIG, {}, floor_callbacks=True)
    gws = {}
    pusher = None
    results = {name: [] for name in GATEWAYS}
    try:
        for name in GATEWAYS:
            gws[name] = Envoy(**specs[name])
        pods = {"llama": [{"address": a, "running": 4, "kv_cache_usage": 0.3} for a in up.addresses()]}
        pusher = Pusher([gws["filter"]], pods)
        for rep in range(args.reps):
            for name in GATEWAYS:
                results[name].append(profile(name, gws[name], body_file, args.seconds, work, rep))
    finally:
        if pusher:
            pusher.stop()
        for gw in gws.values():
            gw.stop()
        up.stop()
    print(f"gateway CPU per request by where it was spent (us; median of {args.reps} runs of "
          f"{args.seconds:g} s each, perf attached)")
    print(f"{'':20s}" + "".join(f"{name:>16s}" for name in GATEWAYS))
    rows = {"requests/s": [statistics.median(r[0] for r in results[n]) for n in GATEWAYS],
            "CPU per request": [statistics.median(r[1] for r in results[n]) for n in GATEWAYS]}
    for c in CLASSES:
        rows[f"  {c}"] = [statistics.median(r[1] * r[2][c] for r in results[n]) for n in GATEWAYS]
    for label, values in rows.items():
        print(f"{label:20s}" + "".join(f"{v:16.1f}" if label != "requests/s" else f"{v:16.0f}" for v in values))
    out = eo.ROOT / "target" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "envoy-profile.json").write_text(json.dumps({
        "setup": {"seconds_per_turn": args.seconds, "turns": args.reps, "connections": 16, "gateway_workers": 1,
                  "sampling": "perf cpu-clock 2000 Hz, DWARF call chains", **eo.host_info()},
        "medians": {label.strip(): dict(zip(GATEWAYS, values)) for label, values in rows.items()},
        "turns": {name: [{"rps": r[0], "cpu_us_per_request": r[1], "shares": r[2]} for r in results[name]]
                  for name in GATEWAYS},
    }, indent=1))


if __name__ == "__main__":
    main()
