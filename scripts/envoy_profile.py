#!/usr/bin/env python3
"""Where the gateway Envoy's CPU goes per request, with and without the filter: `perf record`
(cpu-clock samples with DWARF call chains) on the gateway Envoys (one worker each) under the same
16-connection 4 KB chat load as `envoy_overhead.py`, for plain Envoy, the proxy-wasm floor
(bench/wasm-floor), the floor with the three callbacks the filter has beyond it exported empty
(`make wasm` builds it) and the filter. The gateways are loaded in turns of a quarter second,
interleaved as `make bench-envoy` does (httpload `--slot-ms`), with one perf attached to all of
them; each gateway's samples are told apart by its process id. Each round gives every gateway
its figures; the report takes medians over rounds, and pairs the filter with the floor with
the callbacks round by round. Profiled one after the other instead, in 1.5- or 4-second turns,
six runs read Envoy's own path with the filter at -3 to +14 us over that floor: the host's drift.

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
keeps them); a chain that stops early (as it may in V8's builtins, the stubs between Envoy and
the wasm code) puts that sample under "envoy".

Experiments add gateways to the same rounds, each paired round by round with its reference:
  --compare-floor NAME=JSON    the floor's `experiments` build with these configuration keys
                               changed (`floor_spin`: VM time without memory traffic or host
                               calls; `floor_touch`: VM time writing across 1 MiB; `floor_code`:
                               VM time in many distinct functions), paired with the floor
  --compare-config NAME=JSON   the filter with these configuration keys changed, paired with
                               the filter
  --compare-wasm NAME=PATH     another build of the filter (its configuration), paired with
                               the filter
--keep DIR keeps each round's perf data there (`perf script -i DIR/round-0.perf -F pid,ip,sym,dso`
gives each sample with its process id; the gateways' process ids are in the report's JSON).

Needs `perf` (linux-perf) and permission to profile the gateway (root, or
perf_event_paranoid <= 1 for the kernel's share).
Usage: scripts/envoy_profile.py [--seconds 2] [--rounds 5] [--compare-floor NAME=JSON]...
                                [--compare-config NAME=JSON]...
                                [--compare-wasm NAME=PATH]... [--keep DIR]
Writes target/bench/envoy-profile.json (every round's figures and the medians).
"""

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_overhead as eo  # noqa: E402
from harness import Envoy, Pusher, scratch  # noqa: E402  (tests/e2e, put on the path by envoy_overhead)

GATEWAYS = ("plain", "wasm_floor", "floor_callbacks", "filter")
# The floor built with its `experiments` feature (`make wasm`): `--compare-floor` loads it.
FLOOR_EXPERIMENTS_WASM = eo.FLOOR_WASM.parents[2] / "wasm-floor-experiments" / "wasm32-wasip1" / "wasm-release" / eo.FLOOR_WASM.name
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
    """{pid: shares (0..1) of that process's samples by class} of `data`'s samples."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,ip,dso"],
                         capture_output=True, text=True, check=True).stdout
    return split_text(out)


def split_text(out):
    """`split` of `perf script -F pid,ip,dso`'s text: a blank line between samples, each a line
    with its process id, then its call chain innermost first, a frame per line as `ip (dso)`."""
    counts = {}
    for block in out.split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines or not lines[0].split()[0].isdigit():
            continue
        pid = int(lines[0].split()[0])
        frames = []
        for line in lines[1:]:
            start = line.find("(")
            frames.append(line[start + 1:-1] if start >= 0 else "?")
        if frames:
            c = counts.setdefault(pid, dict.fromkeys(CLASSES, 0))
            c[classify(frames)] += 1
    return {pid: {k: v / (sum(c.values()) or 1) for k, v in c.items()} for pid, c in counts.items()}


def experiment_specs(specs, floors, configs, builds=None):
    """`specs` (the four gateways) with the experiments added: {name: spec} in run order, and
    the pairs to report as [(gateway, its reference)], the filter over the floor with the
    callbacks first. `floors` and `configs` are {name: configuration changes} of the floor and
    the filter, `builds` {name: .wasm path} of other builds of the filter."""
    out = {name: specs[name] for name in GATEWAYS}
    pairs = [("filter", "floor_callbacks")]
    # A floor experiment runs the floor's experiments build; a configuration, the filter's own.
    for changes, ref, build in ((floors, "wasm_floor", {"wasm": FLOOR_EXPERIMENTS_WASM}), (configs, "filter", {})):
        for name, keys in changes.items():
            base = specs[ref]
            out[name] = dict(base, **build, filter_config=dict(base["filter_config"], **keys))
            pairs.append((name, ref))
    for name, path in (builds or {}).items():
        out[name] = dict(specs["filter"], wasm=path)
        pairs.append((name, "filter"))
    return out, pairs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0, help="measured seconds per gateway and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-floor", action="append", default=[], metavar="NAME=JSON",
                    help="also the floor with these configuration keys changed, paired with the floor")
    ap.add_argument("--compare-config", action="append", default=[], metavar="NAME=JSON",
                    help="also the filter with these configuration keys changed, paired with the filter")
    ap.add_argument("--compare-wasm", action="append", default=[], metavar="NAME=PATH",
                    help="also this build of the filter, paired with the filter")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="keep each round's perf data in DIR")
    args = ap.parse_args()
    floors = eo.compare_configs(args.compare_floor, GATEWAYS)
    configs = eo.compare_configs(args.compare_config, GATEWAYS + tuple(floors))
    builds = eo.compare_builds(args.compare_wasm, {*GATEWAYS, *floors, *configs})
    if not shutil.which("perf"):
        sys.exit("perf is not installed (Debian: apt install linux-perf)")
    needed = (eo.FLOOR_WASM, eo.FLOOR_CALLBACKS_WASM, *((FLOOR_EXPERIMENTS_WASM,) if floors else ()))
    if not all(w.exists() for w in needed):
        sys.exit("build first: make build")
    work = scratch("gpuroute-profile-")
    body_file = work / "chat.json"
    body_file.write_bytes(eo.chat_body())
    up = eo.Upstream()
    specs, pairs = experiment_specs(eo.gateway_specs(up, eo.CONFIG, {}, floor_callbacks=True), floors, configs,
                                    builds)
    names = list(specs)
    gws = {}
    pusher = None
    rounds = {name: [] for name in names}
    shares = []
    try:
        for name in names:
            gws[name] = Envoy(**specs[name])
        pusher = Pusher([gws["filter"], *(gws[n] for n in (*configs, *builds))], eo.pod_snapshot(up))
        order = list(gws.items())
        eo.load(order, body_file, 16, 0.5)  # warm-up
        pids = ",".join(str(gw.proc.pid) for gw in gws.values())
        for r in range(args.rounds):
            data = work / f"round-{r}.perf"
            # One perf over every gateway: each is loaded only in its own turns, so a process's
            # samples are its turns' (and its timers', a few per second).
            perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1000", "--call-graph", "dwarf,8192",
                                     "-p", pids, "-o", str(data)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # perf attached
            res = eo.load(order if r % 2 == 0 else order[::-1], body_file, 16, args.seconds, cpu=True)
            perf.send_signal(signal.SIGINT)
            perf.wait()
            by_pid = split(data)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.move(data, args.keep / data.name)
            else:
                data.unlink()
            shares.append({name: by_pid.get(gw.proc.pid, dict.fromkeys(CLASSES, 0.0)) for name, gw in gws.items()})
            for name in names:
                rounds[name].append((res[name]["rps"], res[name]["cpu_us_per_request"]))
            print(f"round {r + 1}: " + ", ".join(f"{n} {rounds[n][-1][1]:.1f} us" for n in names), flush=True)
    finally:
        if pusher:
            pusher.stop()
        for gw in gws.values():
            gw.stop()
        up.stop()
    print(f"\ngateway CPU per request by where it was spent (us; median of {args.rounds} rounds, each "
          f"gateway {args.seconds:g} s per round in {eo.SLOT_MS} ms turns, perf attached to all)")
    print(f"{'':20s}" + "".join(f"{name:>16s}" for name in names))
    rows = {"requests/s": [statistics.median(x[0] for x in rounds[n]) for n in names],
            "CPU per request": [statistics.median(x[1] for x in rounds[n]) for n in names]}

    def us(name, r, c):
        """Gateway `name`'s microseconds per request in class `c` in round `r`."""
        return rounds[name][r][1] * shares[r][name][c]

    for c in CLASSES:
        rows[f"  {c}"] = [statistics.median(us(n, r, c) for r in range(args.rounds)) for n in names]
    for label, values in rows.items():
        print(f"{label:20s}" + "".join(f"{v:16.1f}" if label != "requests/s" else f"{v:16.0f}" for v in values))
    # Paired per round: each gateway over its reference, by class.
    paired = {}
    for a, b in pairs:
        diffs = {c: sorted(us(a, r, c) - us(b, r, c) for r in range(args.rounds)) for c in CLASSES}
        diffs["in all"] = sorted(rounds[a][r][1] - rounds[b][r][1] for r in range(args.rounds))
        paired[f"{a} over {b}"] = {c: {"median": statistics.median(d), "min": d[0], "max": d[-1]}
                                   for c, d in diffs.items()}
        print(f"{a} over {b}, us per request, per round (median, range): "
              + "; ".join(f"{c} {statistics.median(d):+.1f} ({d[0]:+.1f} to {d[-1]:+.1f})" for c, d in diffs.items()
                          if c in ("in all", "envoy", "envoy, for the VM", "wasm (JIT)", "kernel")))
    out = eo.ROOT / "target" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "envoy-profile.json").write_text(json.dumps({
        "setup": {"seconds_per_gateway_and_round": args.seconds, "rounds": args.rounds, "slot_ms": eo.SLOT_MS,
                  "connections": 16, "gateway_workers": 1,
                  "sampling": "perf cpu-clock 1000 Hz, DWARF call chains, attached to every gateway", **eo.host_info()},
        "experiments": {"floor": floors, "config": configs, "wasm": {n: str(p) for n, p in builds.items()}},
        "pids": {name: gw.proc.pid for name, gw in gws.items()},
        "medians": {label.strip(): dict(zip(names, values)) for label, values in rows.items()},
        "paired": paired,
        "rounds": {name: [{"rps": x[0], "cpu_us_per_request": x[1], "shares": shares[r][name]}
                          for r, x in enumerate(rounds[name])] for name in names},
    }, indent=1))


if __name__ == "__main__":
    main()
