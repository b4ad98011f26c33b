#!/usr/bin/env python3
"""The head-to-head TTFT benchmark (make bench / make bench-quick).

For each scenario in bench/scenarios/: start the scenario's simulated fleet, sidecar-metrics
and Envoy in each router configuration (round_robin, least_request, filter) in turn, with a
fresh fleet every time (cold caches, same seed), replay the same workload with loadgen, then
let bench-report print one table and write target/bench/<scenario>.json and the TTFT CDF SVG.

  scripts/bench.py                      every scenario (~20 min)
  scripts/bench.py --quick              every scenario briefly (< 4 min), proves the pipeline
  scripts/bench.py --scenario mixed-gpu --scenario bursty
  scripts/bench.py --scenario-file bench/experiments/sampling-bursts.json \
      --configs least_request,filter,filter-before --filter-wasm before=/tmp/before.wasm
                                        a scenario file outside bench/scenarios (an experiment,
                                        with no targets), and another build of the filter beside
                                        this tree's, as configuration `filter-before`
  scripts/bench.py --scenario mixed-gpu --replicas 2 --configs filter,filter-blind \
      --filter-variant 'blind={"ingest": {"token": "dev-token-change-me", "load_path": ""}}'
                                        two gateway replicas taking the requests in turn, with and
                                        without the relay of their requests in prefill
  scripts/bench.py --trace FILE [--speedup N]
                                        replay any Azure-conv CSV or Mooncake JSONL trace through
                                        every configuration for 40 s (fleet: the shared-prefix
                                        scenario's for Mooncake, replayed at 3x with 512-token
                                        blocks scaled to 64; the bursty scenario's for Azure,
                                        at ~70% of its capacity unless SPEEDUP is given)
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import Stack  # noqa: E402

LOADGEN = ROOT / "target" / "release" / "loadgen"
REPORT = ROOT / "target" / "release" / "bench-report"
CONFIGS = ["round_robin", "least_request", "filter"]


def scenario_names():
    return sorted(p.stem for p in (ROOT / "bench" / "scenarios").glob("*.json"))


def run_scenario(name, scenario_file, fleet, quick, extra_args, out_dir, concurrency, configs=CONFIGS, debug=False,
                 filter_config=None, filter_wasm=None, filter_variants=None, replicas=1, pool_settings=None):
    """`filter_wasm`: {name: path} of other builds of the filter, run as configuration
    `filter-<name>`; `filter_variants`: {name: options} merged into this build's configuration,
    run as configuration `filter-<name>`; `pool_settings`: the scenario's `pools`."""
    filter_wasm = filter_wasm or {}
    filter_variants = filter_variants or {}
    work = out_dir / "work" / name
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for label in configs:
        t0 = time.time()
        overrides = dict(filter_config or {})
        if debug:
            overrides["debug_header"] = True
        build = label.removeprefix("filter-") if label.startswith("filter-") else None
        if build in filter_variants:
            overrides.update(filter_variants[build])
        elif build is not None and build not in filter_wasm:
            raise SystemExit(f"configuration {label}: no --filter-wasm {build}=PATH or --filter-variant {build}=JSON")
        stack = Stack(fleet=fleet, router="filter" if build else label, workdir=work / label,
                      concurrency=concurrency, filter_overrides=overrides,
                      wasm=filter_wasm.get(build), replicas=replicas, pool_settings=pool_settings).start()
        try:
            out = work / f"{label}.json"
            args = [str(LOADGEN), "--target", stack.targets(), "--workload", str(scenario_file),
                    "--out", str(out), "--pods-file", str(stack.dir / "fleet-ports.json"), "--label", label,
                    "--fleet-file", str(stack.dir / "fleet.json")]
            if quick:
                args.append("--quick")
            args += extra_args
            subprocess.run(args, check=True, stdout=open(work / f"{label}.loadgen.log", "w"), stderr=subprocess.STDOUT)
            if label.startswith("filter"):
                (work / f"{label}.envoy-stats.txt").write_text(json.dumps(stack.envoy.stats(), indent=1))
        finally:
            stack.stop()
        print(f"  {name}: {label} done in {time.time() - t0:.0f} s", flush=True)
        results.append(f"{label}={out}")
    cmd = [str(REPORT), "--scenario", name, "--out-dir", str(out_dir)]
    if scenario_file.suffix == ".json" and "fleet" in json.loads(scenario_file.read_text()):
        cmd += ["--scenario-file", str(scenario_file)]
    if quick:
        cmd.append("--quick")
    for r in results:
        cmd += ["--result", r]
    subprocess.run(cmd, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--scenario", action="append", help="scenario name (repeatable); default: all")
    ap.add_argument("--scenario-file", action="append", default=[],
                    help="a scenario file anywhere, such as bench/experiments/*.json (repeatable)")
    ap.add_argument("--filter-wasm", action="append", default=[], metavar="NAME=PATH",
                    help="another build of the filter, run as configuration filter-NAME (name it in --configs)")
    ap.add_argument("--filter-variant", action="append", default=[], metavar="NAME=JSON",
                    help="this build of the filter with JSON merged into its configuration, run as configuration "
                    "filter-NAME (name it in --configs), e.g. hold='{\"hold\": {}}'")
    ap.add_argument("--trace", help="replay this trace file instead of the scenarios")
    ap.add_argument("--speedup", type=float, help="trace seconds per wall second")
    ap.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads")
    ap.add_argument("--replicas", type=int, default=1,
                    help="gateway replicas (Envoys, each with its own sidecar-metrics, the sidecars relaying "
                    "to each other), taking the requests in turn")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated router configurations (default: all three)")
    ap.add_argument("--debug-header", action="store_true",
                    help="filter: record each decision's x-gateway-debug breakdown in the per-request records "
                    "(work/<scenario>/filter.json)")
    ap.add_argument("--filter-config", type=json.loads, default=None, metavar="JSON",
                    help="merged into the filter's configuration for this run, e.g. "
                    "'{\"scoring\": {\"weights\": {\"prefix\": 1.5}}}' (what-if runs of other weights)")
    ap.add_argument("--out-dir", help="default: target/bench (--quick: target/bench/quick, so a quick "
                    "run never replaces the results of a full one)")
    args = ap.parse_args()
    if args.out_dir is None:
        args.out_dir = str(ROOT / "target" / "bench" / ("quick" if args.quick else ""))
    for b in (LOADGEN, REPORT):
        if not b.exists():
            sys.exit(f"{b} is missing: run `make build` first")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    configs = args.configs.split(",")
    filter_wasm = dict(w.split("=", 1) for w in args.filter_wasm)
    filter_variants = {name: json.loads(options) for name, options in (v.split("=", 1) for v in args.filter_variant)}
    clash = set(filter_wasm) & set(filter_variants)
    if clash:
        sys.exit(f"named both a --filter-wasm and a --filter-variant: {', '.join(sorted(clash))}")
    if args.trace:
        trace = Path(args.trace).resolve()
        mooncake = trace.read_text(errors="replace").lstrip().startswith("{")
        # The fleet of the scenario built on the same kind of trace, and the replay settings that
        # scenario's calibration found sensible for it (bench/README.md, "Calibration").
        base = "shared-prefix" if mooncake else "bursty"
        fleet = json.loads((ROOT / "bench" / "scenarios" / f"{base}.json").read_text())["fleet"]
        model = fleet["pods"][0]["model"]
        extra = ["--model", model, "--duration-s", "10" if args.quick else "40"]
        if args.speedup:
            extra += ["--speedup", str(args.speedup)]
        elif mooncake:
            extra += ["--speedup", "3"]
        else:
            extra += ["--rate", "14"]  # ~70% of the bursty fleet's ~20.4 req/s (8 x ~2.55; ~11.6 before the 2026-12-07 KV-cache fix)
        if mooncake:
            extra += ["--token-scale", "0.125"]  # 512-token blocks -> 64 tokens, as shared-prefix
        run_scenario(f"trace-{trace.stem}", trace, fleet, False, extra, out_dir, args.concurrency, configs,
                     args.debug_header, args.filter_config, filter_wasm, filter_variants, args.replicas)
    else:
        files = [ROOT / "bench" / "scenarios" / f"{name}.json" for name in args.scenario or []]
        files += [Path(f).resolve() for f in args.scenario_file]
        if not files:
            files = [ROOT / "bench" / "scenarios" / f"{name}.json" for name in scenario_names()]
        for f in files:
            scenario = json.loads(f.read_text())
            run_scenario(f.stem, f, scenario["fleet"], args.quick, [], out_dir, args.concurrency, configs,
                         args.debug_header, args.filter_config, filter_wasm, filter_variants, args.replicas,
                         scenario.get("pools"))
    print(f"\nbenchmark finished in {time.time() - started:.0f} s; results in {out_dir}")


if __name__ == "__main__":
    main()
