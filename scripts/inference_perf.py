#!/usr/bin/env python3
"""Cross-check the project's loadgen with an independent load generator, kubernetes-sigs
inference-perf (issue 4): the same stack, the same requests at the same times, TTFT side by side.

  .venv/bin/python scripts/inference_perf.py                      mixed-gpu and uniform-steady,
                                                                  round_robin and filter, one run each (~10 min)
  .venv/bin/python scripts/inference_perf.py --quick              5 s of each schedule (~4 min; proves the
                                                                  pipeline: 180 requests cannot judge a p99)
  .venv/bin/python scripts/inference_perf.py --scenario mixed-gpu --routers filter --repeat 2
  .venv/bin/python scripts/inference_perf.py --report-only        re-print the table of the last run

Steps (bench/inference-perf/README.md has the why):
1. `.venv-ip/`: a Python 3.12 venv (inference-perf needs >= 3.12) with inference-perf pinned.
2. A local byte-level BPE tokenizer (bench/inference-perf/build_tokenizer.py): no model hub is
   reachable, and fleet-sim counts a token per 4 bytes, so it is trained to ~4 bytes/token.
3. The scenario's exact request schedule as an Azure-format CSV (bench/inference-perf/schedule.py,
   a port of loadgen's Poisson generator), after a 5 s lead-in request: both tools replay that
   file, inference-perf as `trace_replay` + `random` data, loadgen as a `trace` workload, both
   on /v1/completions.
4. Per scenario, router and tool: a fresh stack (scripts/stack.py: fleet-sim, sidecar-metrics,
   Envoy; or `--routers stub`: sse-stub with a fixed 50 ms TTFT, to calibrate the tools), one
   run, the pods' counters scraped, stop. Runs alternate the tool order per repeat.
5. A table: tool x router x TTFT p50/p90/p99, output tokens/s, send lag, and inference-perf's
   difference from loadgen. Everything lands in target/bench/inference-perf/ (summary.json,
   summary.md, per-run reports and logs under runs/).

Needs `make build` (fleet-sim, sidecar-metrics, loadgen, the filter) and `make setup` (.venv with Envoy).
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from string import Template

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "bench" / "inference-perf"))
import stack as stack_mod  # noqa: E402
from stack import Stack, free_port, http_ok, wait_for  # noqa: E402
import harness  # noqa: E402  (tests/e2e, put on the path by stack.py)
import analyze  # noqa: E402
import schedule as sched_mod  # noqa: E402

IP_VERSION = "0.7.0"
# tokenizers trains the BPE: pinned so the tokenizer (and its bytes/token) is reproducible.
IP_PINS = [f"inference-perf=={IP_VERSION}", "tokenizers==0.22.2", "transformers==5.13.0"]
IP_VENV = ROOT / ".venv-ip"
IP_BIN = IP_VENV / "bin" / "inference-perf"
IP_PY = IP_VENV / "bin" / "python"
PY312_CANDIDATES = [os.environ.get("INFERENCE_PERF_PYTHON", ""), "/root/.pyenv/versions/3.12.1/bin/python3.12",
                    shutil.which("python3.12") or "", shutil.which("python3.13") or ""]
LOADGEN = ROOT / "target" / "release" / "loadgen"
SSE_STUB = ROOT / "target" / "release" / "sse-stub"
# `--routers stub`: no fleet, no Envoy; sse-stub answers every request with its first token after
# exactly STUB_FIRST_TOKEN_MS and the next ones STUB_TOKEN_INTERVAL_MS apart (about fleet-sim's
# decode pace, so as many streams are open as on the fleet). What a tool measures above
# STUB_FIRST_TOKEN_MS is its own overhead: the calibration of the two instruments.
STUB_FIRST_TOKEN_MS = 50
STUB_TOKEN_INTERVAL_MS = 20
HERE = ROOT / "bench" / "inference-perf"
TEMPLATE = HERE / "config.template.yaml"
ROUTERS = ["round_robin", "filter"]
SCENARIOS = ["mixed-gpu", "uniform-steady"]
TIMEOUT_S = 120


def log(msg):
    print(msg, flush=True)


# --- setup ---------------------------------------------------------------------------------

def ensure_venv():
    if IP_BIN.exists():
        v = subprocess.run([str(IP_PY), "-c", "import importlib.metadata as m; print(m.version('inference-perf'))"],
                           capture_output=True, text=True).stdout.strip()
        if v == IP_VERSION:
            return
    py = next((p for p in PY312_CANDIDATES if p and Path(p).exists()), None)
    if not py:
        sys.exit("inference-perf needs Python >= 3.12: set INFERENCE_PERF_PYTHON=/path/to/python3.12")
    log(f"creating {IP_VENV} with {py} and installing {' '.join(IP_PINS)} (~30 s)")
    subprocess.run([py, "-m", "venv", str(IP_VENV)], check=True)
    subprocess.run([str(IP_PY), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([str(IP_PY), "-m", "pip", "install", "--quiet", *IP_PINS], check=True)


def ensure_tokenizer(tok_dir):
    if (tok_dir / "build-info.json").exists() and (tok_dir / "tokenizer.json").exists():
        return json.loads((tok_dir / "build-info.json").read_text())
    subprocess.run([str(IP_PY), str(HERE / "build_tokenizer.py"), str(tok_dir)], check=True, env=offline_env())
    return json.loads((tok_dir / "build-info.json").read_text())


def freeze_binaries(out_dir):
    """Copy the filter and the native binaries into OUT/bin and run every stack and loadgen from
    the copies: others rebuilding the tree mid-run cannot change the system under test between
    two runs that are compared. Returns {name: sha256}."""
    global LOADGEN, SSE_STUB
    import hashlib
    bin_dir = out_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    frozen = {}
    for name, src in (("gpuroute_filter.wasm", Path(harness.WASM)), ("fleet-sim", stack_mod.FLEET_SIM),
                      ("sidecar-metrics", stack_mod.SIDECAR), ("loadgen", LOADGEN), ("sse-stub", SSE_STUB)):
        if not Path(src).exists():
            continue
        dst = bin_dir / name
        shutil.copy2(src, dst)
        frozen[name] = {"sha256": hashlib.sha256(dst.read_bytes()).hexdigest(),
                        "built": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(Path(src).stat().st_mtime))}
    harness.WASM = bin_dir / "gpuroute_filter.wasm"
    stack_mod.FLEET_SIM = bin_dir / "fleet-sim"
    stack_mod.SIDECAR = bin_dir / "sidecar-metrics"
    LOADGEN, SSE_STUB = bin_dir / "loadgen", bin_dir / "sse-stub"
    return frozen


def offline_env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    return env


class StubStack:
    """sse-stub in place of a stack (same attributes the runners use)."""

    def __init__(self, workdir):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.listen = f"127.0.0.1:{free_port()}"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([str(SSE_STUB), "--listen", self.listen, "--first-token-ms", str(STUB_FIRST_TOKEN_MS),
                                      "--token-interval-ms", str(STUB_TOKEN_INTERVAL_MS), "--max-tokens", "100000"],
                                     stdout=open(self.dir / "sse-stub.log", "w"), stderr=subprocess.STDOUT)
        wait_for(lambda: http_ok(f"http://{self.listen}/metrics") or self.proc.poll() is not None, 10, "sse-stub")
        return self

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# --- the two tools -------------------------------------------------------------------------

def run_inference_perf(stack, run_dir, csv, sched_info, tok_dir, model, seed, lead_in, max_concurrency=None):
    out = run_dir / "report"
    shutil.rmtree(out, ignore_errors=True)
    cfg = Template(TEMPLATE.read_text()).substitute(
        model=model, base_url=f"http://{stack.listen}", tokenizer_dir=str(tok_dir), schedule_csv=str(csv),
        rate=max(1, round(sched_info["offered_rate_per_s"] or 1)), duration=max(1, round(sched_info["span_s"] + lead_in)),
        num_workers=2, max_concurrency=max_concurrency or sched_info["requests"] + 10, timeout_s=TIMEOUT_S, seed=seed, out_dir=str(out))
    (run_dir / "inference-perf.yaml").write_text(cfg)
    with open(run_dir / "inference-perf.log", "w") as lf:
        subprocess.run([str(IP_BIN), "--config_file", str(run_dir / "inference-perf.yaml")], cwd=run_dir,
                       env=offline_env(), stdout=lf, stderr=subprocess.STDOUT, check=True)
    return parse_inference_perf(out, lead_in > 0)


def run_loadgen(stack, run_dir, csv, model, label, lead_in):
    out = run_dir / "results.json"
    workload = {"kind": "trace", "file": str(csv), "api": "completions", "speedup": 1.0,
                "models": {"names": [model]}, "name": csv.stem}
    pods = stack.dir / "fleet-ports.json"
    with open(run_dir / "loadgen.log", "w") as lf:
        subprocess.run([str(LOADGEN), "--target", f"http://{stack.listen}", "--workload", json.dumps(workload),
                        "--out", str(out), "--label", label, "--timeout-s", str(TIMEOUT_S)]
                       + (["--pods-file", str(pods)] if pods.exists() else []),
                       stdout=lf, stderr=subprocess.STDOUT, check=True)
    return parse_loadgen(out, lead_in > 0)


def run_loadgen_scenario(stack, run_dir, sc_file, label, quick):
    """The reference: loadgen on the scenario file itself (its own Poisson schedule, chat API, no
    lead-in), as `make bench` runs it. Shows the CSV replay offers what the scenario offers."""
    out = run_dir / "results.json"
    pods = stack.dir / "fleet-ports.json"
    with open(run_dir / "loadgen.log", "w") as lf:
        subprocess.run([str(LOADGEN), "--target", f"http://{stack.listen}", "--workload", str(sc_file), "--out", str(out),
                        "--label", label, "--timeout-s", str(TIMEOUT_S)] + (["--quick"] if quick else [])
                       + (["--pods-file", str(pods)] if pods.exists() else []),
                       stdout=lf, stderr=subprocess.STDOUT, check=True)
    return parse_loadgen(out, False)


POD_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def pod_counters(stack):
    """Each pod's request, prompt and generated token counters after a run (fresh fleet: totals =
    this run). Output lengths are exact (max_tokens from the schedule), so the generated tokens per
    pod say which requests each pod served: runs with the same per-pod figures had the same
    request-to-pod assignment, whichever tool sent them."""
    out = {}
    for pod in getattr(stack, "pods", []) or []:
        try:
            with urllib.request.urlopen(pod["metrics_url"], timeout=5) as r:
                text = r.read().decode()
        except Exception:
            continue
        vals = {}
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in POD_COUNTERS:
                vals[name] = vals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out[pod["name"]] = vals
    return out


def assignment(counters):
    """Signature of a run's request-to-pod assignment: per pod type (name without -N), the sorted
    generated-token totals of its pods."""
    by = {}
    for name, v in counters.items():
        by.setdefault(name.rsplit("-", 1)[0], []).append(int(v.get("vllm:generation_tokens_total", 0)))
    return ";".join(f"{t}:{'/'.join(map(str, sorted(x)))}" for t, x in sorted(by.items())) if by else None


# --- results -------------------------------------------------------------------------------

def same_method(ttfts_ms):
    """Both tools' per-request TTFTs summarised the same way (analyze.pct: linear interpolation
    between closest ranks, numpy's default)."""
    return {f"p{p}": round(analyze.pct(ttfts_ms, p), 2) for p in (50, 90, 99)} if ttfts_ms else {}


def own_figures(n, ok, errors, ttft, tput, lag_p99, lag_max):
    return {"requests": n, "ok": ok, "errors": errors, "ttft_ms": ttft, "output_tokens_per_s": tput,
            "send_lag_ms_p99": lag_p99, "send_lag_ms_max": lag_max}


def recomputed(reqs):
    """One method for both tools, over the schedule's requests (the lead-in left out):
    reqs = [(sent_s, end_s or None, ttft_ms or None, output_tokens)] of successful requests.
    Throughput as loadgen defines it: output tokens over first send to last completion."""
    ttfts = [r[2] for r in reqs if r[2] is not None]
    ends = [r[1] for r in reqs if r[1] is not None]
    window = (max(ends) - min(r[0] for r in reqs)) if reqs and ends else None
    return {"ok": len(reqs), "ttft_ms": same_method(ttfts),
            "output_tokens_per_s": sum(r[3] for r in reqs) / window if window else None}


def slim_per_request(path):
    """inference-perf's per-request report keeps every token's timestamp (~33 MB a mixed-gpu run);
    keep what the figures and analyze.py read (send/end times, TTFT, usage, errors)."""
    per = json.loads(path.read_text())
    for r in per:
        rm = (r.get("info") or {}).get("response_metrics") or {}
        for k in ("chunk_times", "output_token_times", "response_chunks"):
            rm.pop(k, None)
        (r.get("computed_metrics") or {}).pop("inter_token_latencies", None)
    path.write_text(json.dumps(per))
    return per


def parse_inference_perf(out, lead_in):
    s = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    per = slim_per_request(out / "per_request_lifecycle_metrics.json")
    per.sort(key=lambda r: r["start_time"])
    if lead_in:
        per = per[1:]     # the earliest send is the lead-in request
    usage = [((r.get("info") or {}).get("response_metrics") or {}).get("server_usage") or {} for r in per]
    reqs = [(r["start_time"], r["end_time"], (r.get("computed_metrics") or {}).get("time_to_first_token"),
             u.get("completion_tokens") or 0) for r, u in zip(per, usage) if r.get("error") is None]
    reqs = [(a, b, None if t is None else t * 1e3, n) for a, b, t, n in reqs]
    ttft = s["successes"]["latency"]["time_to_first_token"]
    lag = s["load_summary"]["schedule_delay"]
    prompt = [u["prompt_tokens"] for r, u in zip(per, usage) if r.get("error") is None and "prompt_tokens" in u]
    return {
        "own": own_figures(s["load_summary"]["count"], s["successes"]["count"],
                           s.get("failures", {}).get("count", 0),
                           {"p50": ttft["median"] * 1e3, "p90": ttft["p90"] * 1e3, "p99": ttft["p99"] * 1e3},
                           s["successes"]["throughput"]["output_tokens_per_sec"], lag["p99"] * 1e3, lag["max"] * 1e3),
        "recomputed": recomputed(reqs),
        "server_prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
    }


def parse_loadgen(out, lead_in):
    d = json.loads(out.read_text())
    s = d["summary"]
    recs = [r for r in d["records"] if not (lead_in and r["id"] == 0)]
    reqs = [(r["sent_ms"] / 1e3, (r["sent_ms"] + r["e2e_ms"]) / 1e3 if r.get("e2e_ms") is not None else None,
             r.get("ttft_ms"), r.get("output_tokens") or 0) for r in recs if r.get("error") is None]
    delta = (d.get("metrics") or {}).get("total_delta") or {}
    served, ptok = delta.get("vllm:request_success_total"), delta.get("vllm:prompt_tokens_total")
    if lead_in and served and ptok:
        served, ptok = served - 1, ptok - 1
    return {
        "own": own_figures(s["requests"], s["ok"], s["errors"],
                           {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99")},
                           s["output_tokens_per_s"], s["send_lag"]["p99_ms"], s["send_lag"]["max_ms"]),
        "recomputed": recomputed(reqs),
        "server_prompt_tokens_mean": ptok / served if ptok and served else None,
        "max_in_flight": s.get("max_in_flight"),
    }


def rel(a, b):
    return None if a is None or b in (None, 0) else (a - b) / b


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def fmt(x, nd=0):
    return "-" if x is None else f"{x:.{nd}f}"


def table(summary):
    lines = ["Each tool's own report (its percentiles: loadgen HDR histogram, inference-perf numpy; the lead-in",
             "request included), then [both recomputed from per-request records, lead-in excluded, one method].", "",
             "| scenario | router | tool | run | ok/sent | TTFT p50 ms | p90 ms | p99 ms | out tok/s | send lag p99 ms "
             "| prompt tok/req (server) | load avg |", "|" + "---|" * 12]
    for r in summary["runs"]:
        m, o = r["result"], r["result"]["own"]
        rc = m["recomputed"]
        t, tr = o["ttft_ms"], rc["ttft_ms"]
        lines.append(
            f"| {r['scenario']} | {r['router']} | {r['tool']} | {r['repeat']} | {o['ok']}/{o['requests']} "
            + "".join(f"| {t[k]:.0f} [{fmt(tr.get(k))}] " for k in ("p50", "p90", "p99"))
            + f"| {o['output_tokens_per_s']:.0f} [{fmt(rc['output_tokens_per_s'])}] | {o['send_lag_ms_p99']:.1f} "
            f"| {fmt(m.get('server_prompt_tokens_mean'), 1)} | {r['loadavg_before']:.1f} |")
    lines += ["", "inference-perf relative to loadgen (median over repeats; own figures [recomputed]); "
              "`lg vs lg`: the spread of loadgen's own repeats (max/min - 1), the stack's run-to-run noise:", "",
              "| scenario | router | TTFT p50 | p90 | p99 | out tok/s | lg vs lg p50 / p90 / p99 |", "|---|---|---|---|---|---|---|"]
    for c in summary["comparison"]:
        def f(k):
            own, same = c["own"][k], c["recomputed"].get(k)
            return ("n/a" if own is None else f"{own * 100:+.1f}%") + ("" if same is None else f" [{same * 100:+.1f}%]")
        noise = c.get("loadgen_spread")
        lines.append(f"| {c['scenario']} | {c['router']} | {f('p50')} | {f('p90')} | {f('p99')} | {f('throughput')} | "
                     + (" / ".join(f"{noise[k] * 100:.0f}%" for k in ("p50", "p90", "p99")) if noise else "-") + " |")
    if summary.get("same_assignment"):
        lines += ["", "Same request-to-pod assignment only (runs grouped by the generated tokens each pod served; "
                  "recomputed TTFT, median of the group's runs, inference-perf vs loadgen):", "",
                  "| scenario | router | assignment (tokens per pod) | runs ip/lg | p50 ms | p90 ms | p99 ms |",
                  "|---|---|---|---|---|---|---|"]
        for g in summary["same_assignment"]:
            cells = "".join(f"| {g['ttft_ms'][k]['inference-perf']:.0f} vs {g['ttft_ms'][k]['loadgen']:.0f} "
                            f"({g['diff'][k] * 100:+.1f}%) " for k in ("p50", "p90", "p99"))
            lines.append(f"| {g['scenario']} | {g['router']} | {g['assignment']} | "
                         f"{g['runs'].get('inference-perf', 0)}/{g['runs'].get('loadgen', 0)} {cells}|")
    if summary.get("paired"):
        lines += ["", "Request by request (first repeat of each tool; TTFT inference-perf - loadgen, ms; "
                  "first bin = first quarter of the schedule):", "",
                  "| scenario | router | matched | paired diff p10 / p50 / p90 | first bin p50 diff | later bins p50 diff |",
                  "|---|---|---|---|---|---|"]
        for a in summary["paired"]:
            d = a["paired_diff_ms"]
            later = [b["paired_diff_p50_ms"] for b in a["bins"][1:]]
            lines.append(f"| {a['scenario']} | {a['router']} | {a['pairs']} ({a['matched_share'] * 100:.0f}%) | "
                         f"{d['p10']:+.1f} / {d['p50']:+.1f} / {d['p90']:+.1f} | {a['bins'][0]['paired_diff_p50_ms']:+.1f} | "
                         f"{min(later):+.1f} .. {max(later):+.1f} |")
    return "\n".join(lines)


def compare(runs):
    out = []
    keys = sorted({(r["scenario"], r["router"]) for r in runs})
    for sc, router in keys:
        by = {tool: [r["result"] for r in runs if r["scenario"] == sc and r["router"] == router and r["tool"] == tool]
              for tool in ("inference-perf", "loadgen")}
        if not by["inference-perf"] or not by["loadgen"]:
            continue
        c = {"scenario": sc, "router": router, "own": {}, "recomputed": {}}
        for k in ("p50", "p90", "p99"):
            c["own"][k] = rel(median([m["own"]["ttft_ms"][k] for m in by["inference-perf"]]),
                              median([m["own"]["ttft_ms"][k] for m in by["loadgen"]]))
            c["recomputed"][k] = rel(median([m["recomputed"]["ttft_ms"].get(k) for m in by["inference-perf"]]),
                                     median([m["recomputed"]["ttft_ms"].get(k) for m in by["loadgen"]]))
        c["own"]["throughput"] = rel(median([m["own"]["output_tokens_per_s"] for m in by["inference-perf"]]),
                                     median([m["own"]["output_tokens_per_s"] for m in by["loadgen"]]))
        c["recomputed"]["throughput"] = rel(median([m["recomputed"]["output_tokens_per_s"] for m in by["inference-perf"]]),
                                            median([m["recomputed"]["output_tokens_per_s"] for m in by["loadgen"]]))
        if len(by["loadgen"]) > 1:
            c["loadgen_spread"] = {k: max(v) / min(v) - 1 for k in ("p50", "p90", "p99")
                                   for v in [[m["own"]["ttft_ms"][k] for m in by["loadgen"]]]}
        out.append(c)
    return out


def same_assignment(runs):
    """Runs grouped by request-to-pod assignment (see assignment()): where the router's choices
    vary from run to run (Envoy's round robin starts its rotation at a random place, so a
    different quarter of the requests meets each pod), tools are compared within a group."""
    out = []
    for sc, router in sorted({(r["scenario"], r["router"]) for r in runs}):
        groups = {}
        for r in runs:
            a = r["result"].get("assignment")
            if r["scenario"] == sc and r["router"] == router and a and r["tool"] in ("inference-perf", "loadgen"):
                groups.setdefault(a, {}).setdefault(r["tool"], []).append(r["result"])
        for a, by in sorted(groups.items()):
            if len(by) < 2:
                continue
            g = {"scenario": sc, "router": router, "assignment": a,
                 "runs": {t: len(v) for t, v in by.items()}, "ttft_ms": {}, "diff": {}}
            for k in ("p50", "p90", "p99"):
                ip = median([m["recomputed"]["ttft_ms"].get(k) for m in by["inference-perf"]])
                lg = median([m["recomputed"]["ttft_ms"].get(k) for m in by["loadgen"]])
                g["ttft_ms"][k] = {"inference-perf": ip, "loadgen": lg}
                g["diff"][k] = rel(ip, lg)
            out.append(g)
    return out


def paired(runs, csvs):
    out = []
    for sc, router in sorted({(r["scenario"], r["router"]) for r in runs}):
        d = {r["tool"]: r["dir"] for r in runs if r["scenario"] == sc and r["router"] == router and r["repeat"] == 0}
        if "inference-perf" in d and "loadgen" in d:
            try:
                a = analyze.analyze(d["inference-perf"], d["loadgen"], csvs[sc], bins=4)
            except Exception as e:  # a diagnostic: never fail the run for it
                log(f"  paired analysis of {sc}/{router} failed: {e}")
                continue
            out.append(dict(a, scenario=sc, router=router))
    return out


# --- main ----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", help=f"repeatable; default: {' '.join(SCENARIOS)}")
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma-separated: round_robin, least_request, filter, filter_original_dst, or stub "
                         f"(sse-stub, first token after exactly {STUB_FIRST_TOKEN_MS} ms: calibrates the tools) "
                         "(default: round_robin,filter)")
    ap.add_argument("--tools", default="inference-perf,loadgen",
                    help="comma-separated: inference-perf, loadgen (both replay the schedule CSV), "
                         "loadgen-scenario (loadgen on the scenario file itself: chat API, no lead-in; a reference)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario, router and tool (order alternates)")
    ap.add_argument("--quick", action="store_true", help="the scenario's quick duration (5 s of schedule)")
    ap.add_argument("--lead-in-s", type=float, default=5.0,
                    help="a tiny request this long before the schedule, so inference-perf has built its prompts "
                         "before the first measured send (0: none; see bench/inference-perf/schedule.py)")
    ap.add_argument("--ip-worker-max-concurrency", type=int,
                    help="inference-perf's load.worker_max_concurrency (default: the request count, i.e. open "
                         "loop; inference-perf's own default, 100 per worker, shows what a cap does)")
    ap.add_argument("--schedule-csv", help="replay this Azure-format CSV instead of the scenario's schedule "
                                           "(the scenario still gives the fleet; --lead-in-s is ignored)")
    ap.add_argument("--out-dir", default=str(ROOT / "target" / "bench" / "inference-perf"))
    ap.add_argument("--report-only", action="store_true", help="print the table of the summary.json in --out-dir")
    args = ap.parse_args()
    if args.schedule_csv:
        args.schedule_csv = str(Path(args.schedule_csv).resolve())
        args.lead_in_s = 0.0
    out_dir = Path(args.out_dir).resolve()
    if args.report_only:
        log(table(json.loads((out_dir / "summary.json").read_text())))
        return
    if not LOADGEN.exists():
        sys.exit(f"{LOADGEN} is missing: run `make build` first")
    out_dir.mkdir(parents=True, exist_ok=True)
    frozen = freeze_binaries(out_dir)
    ensure_venv()
    tok_dir = out_dir / "tokenizer"
    tok_info = ensure_tokenizer(tok_dir)
    log(f"tokenizer: {tok_dir} (vocab {tok_info['vocab_size']}, "
        f"{tok_info['random_prompt_bytes_per_token']} bytes/token on inference-perf's random prompts)")
    routers = args.routers.split(",")
    tools = args.tools.split(",")
    started = time.time()
    runs, csvs = [], {}
    summary = {"inference_perf_version": IP_VERSION, "tokenizer": tok_info, "quick": args.quick,
               "lead_in_s": args.lead_in_s, "binaries": frozen,
               "git_head": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip(),
               "command": " ".join([".venv/bin/python", "scripts/inference_perf.py", *sys.argv[1:]]),
               "machine": {"cpus": os.cpu_count()}, "schedules": {}, "runs": runs}

    def save():
        summary["comparison"] = compare(runs)
        summary["same_assignment"] = same_assignment(runs)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))

    for name in args.scenario or SCENARIOS:
        sc_file = ROOT / "bench" / "scenarios" / f"{name}.json"
        sc = json.loads(sc_file.read_text())
        duration = sc.get("quick", {}).get("duration_s", 5.0) if args.quick else None
        seed = sc["workload"].get("seed", 1)
        csv = out_dir / f"{name}{'-quick' if args.quick else ''}.schedule.csv"
        if args.schedule_csv:
            # any Azure-format CSV, replayed as it is (its rows already include whatever lead-in it wants)
            shutil.copyfile(args.schedule_csv, csv)
            schedule = [(t, p, o) for t, p, o in sched_mod.read_azure_rows(csv)]
        else:
            schedule = sched_mod.poisson_schedule(sc["workload"], sc_file.parent, duration=duration)
            sched_mod.write_csv(schedule, csv, args.lead_in_s)
        csvs[name] = csv
        info = sched_mod.describe(schedule)
        summary["schedules"][name] = dict(info, csv=str(csv))
        model = sc["workload"]["models"]["names"][0]
        log(f"{name}: {info['requests']} requests over {info['span_s']} s ({info['offered_rate_per_s']} req/s), "
            f"mean prompt {info['mean_prompt_tokens']} / output {info['mean_output_tokens']} tokens"
            + (f", after a {args.lead_in_s:g} s lead-in" if args.lead_in_s > 0 else ""))
        for router in routers:
            for rep in range(args.repeat):
                order = tools if rep % 2 == 0 else list(reversed(tools))
                for tool in order:
                    run_dir = out_dir / "runs" / name / router / f"{tool}-{rep}"
                    shutil.rmtree(run_dir, ignore_errors=True)
                    run_dir.mkdir(parents=True)
                    t0 = time.time()
                    load = os.getloadavg()[0]
                    if router == "stub":
                        stack = StubStack(run_dir / "stack").start()
                    else:
                        stack = Stack(fleet=sc["fleet"], router=router, workdir=run_dir / "stack").start()
                    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    try:
                        if tool == "inference-perf":
                            res = run_inference_perf(stack, run_dir, csv, info, tok_dir, model, seed, args.lead_in_s,
                                                     args.ip_worker_max_concurrency)
                        elif tool == "loadgen":
                            res = run_loadgen(stack, run_dir, csv, model, router, args.lead_in_s)
                        elif tool == "loadgen-scenario":
                            res = run_loadgen_scenario(stack, run_dir, sc_file, router, args.quick)
                        else:
                            sys.exit(f"unknown tool {tool}")
                        # the tool is the only child reaped in between (the stack's processes still run)
                        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        res["tool_cpu_s"] = round(cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime, 1)
                        res["pods"] = pod_counters(stack)
                        res["assignment"] = assignment(res["pods"])
                    finally:
                        stack.stop()
                    o, t = res["own"], res["recomputed"]["ttft_ms"]
                    log(f"  {name} {router} {tool} #{rep}: TTFT p50 {t.get('p50', 0):.0f} / p90 {t.get('p90', 0):.0f} / "
                        f"p99 {t.get('p99', 0):.0f} ms, {o['ok']}/{o['requests']} ok, "
                        f"{res['recomputed']['output_tokens_per_s'] or 0:.0f} out tok/s "
                        f"(tool CPU {res.get('tool_cpu_s', 0):.0f} s; {time.time() - t0:.0f} s, load {load:.1f})")
                    runs.append({"scenario": name, "router": router, "tool": tool, "repeat": rep,
                                 "loadavg_before": load, "loadavg_after": os.getloadavg()[0],
                                 "wall_s": round(time.time() - t0, 1), "dir": str(run_dir), "result": res})
                    save()
    summary["paired"] = paired(runs, csvs)
    summary["elapsed_s"] = round(time.time() - started)
    save()
    text = table(summary)
    (out_dir / "summary.md").write_text(text + "\n")
    log("\n" + text)
    log(f"\nfinished in {time.time() - started:.0f} s; results in {out_dir}")


if __name__ == "__main__":
    main()
