#!/usr/bin/env python3
"""What asking a vLLM pod for only the metrics sidecar-metrics reads saves, on the real
prometheus_client (the library vLLM and SGLang serve /metrics with).

    .venv/bin/python scripts/metrics_filter_cost.py [--sample FILE] [--sidecar BIN]

It rebuilds the sample exposition (default: the real 45 KB vLLM V1 scrape in testdata/metrics/)
as prometheus_client Gauge, Counter and Histogram objects in a registry, as vLLM registers its
metrics, then reports for the whole exposition and for the one restricted to sidecar-metrics'
names (`?name[]=...`, the query `sidecar-metrics scrape-once` sends by default):
  - the body's size;
  - the CPU time prometheus_client takes to render it (what the pod's API server spends per
    scrape, on its event loop), best of 5 x 200;
  - with --sidecar, what `sidecar-metrics scrape-once` reads from it over HTTP, both ways.

The names asked for are read from sidecar-metrics' own table (sidecar-metrics/src/engine.rs,
SLOTS), so they are the ones the aggregator asks for.
"""

import argparse
import json
import re
import subprocess
import sys
import timeit
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import _bake_output
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "testdata" / "metrics" / "vllm-v1-0.11-hardware-aware-router-idle.txt"


def sidecar_names():
    """The sample names sidecar-metrics reads, from its table."""
    src = (ROOT / "sidecar-metrics" / "src" / "engine.rs").read_text()
    table = src.split("const SLOTS", 1)[1].split("];", 1)[0]
    return re.findall(r'\(\s*Engine::\w+,\s*"([^"]+)",\s*Slot::\w+,?\s*\)', table)


def registry_like_vllm(text):
    """A registry of metric objects holding the exposition's families and values, as vLLM's
    own Gauge/Counter/Histogram objects would. Families the text parser reports for the
    counters' and histograms' `_created` samples are left to the objects that make them."""
    reg = CollectorRegistry(auto_describe=True)
    families = list(text_string_to_metric_families(text))
    made = 0
    for f in families:
        if f.name.endswith("_created"):
            continue
        labels = sorted({k for s in f.samples for k in s.labels if k != "le"})

        def child(metric, s):
            return metric.labels(**{k: s.labels[k] for k in labels}) if labels else metric

        if f.type == "gauge":
            m = Gauge(f.name, f.documentation or f.name, labels, registry=reg)
            for s in f.samples:
                child(m, s).set(s.value)
        elif f.type == "counter":
            m = Counter(f.name, f.documentation or f.name, labels, registry=reg)
            for s in f.samples:
                if s.name.endswith("_total"):
                    child(m, s).inc(s.value)
        elif f.type == "histogram":
            bounds = sorted({float(s.labels["le"]) for s in f.samples
                             if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"})
            if len(bounds) < 1:
                continue
            m = Histogram(f.name, f.documentation or f.name, labels, buckets=bounds, registry=reg)
            for s in f.samples:
                if s.name.endswith("_sum"):
                    child(m, s)  # the series exists, as vLLM's do before any observation
        else:
            continue
        made += 1
    return reg, made, len(families)


def render_ms(reg, params):
    best = min(timeit.repeat(lambda: _bake_output(reg, "text/plain", None, params, False), number=200, repeat=5))
    return best / 200 * 1000


def serve(reg):
    server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    return server


def same_reading(a, b):
    """Two `scrape-once --json` outputs read the same values (the time of the scrape aside; a
    restricted registry lists its families in another order)."""
    pod = lambda o: {k: v for k, v in o["pod"].items() if k != "last_scrape_ms"}  # noqa: E731
    return pod(a) == pod(b) and sorted(a["raw"]) == sorted(b["raw"])


def scrape_once(sidecar, url, whole, engine=None):
    cmd = [str(sidecar), "scrape-once", url, "--delta-ms", "0", "--json"] + (["--whole"] if whole else [])
    cmd += ["--engine", engine] if engine else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sample", default=str(SAMPLE), help="exposition to rebuild (default: the real vLLM V1 scrape)")
    ap.add_argument("--sidecar", help="sidecar-metrics binary: also scrape the registry with it, both ways")
    args = ap.parse_args()

    reg, made, families = registry_like_vllm(Path(args.sample).read_text())
    names = sidecar_names()
    whole = _bake_output(reg, "text/plain", None, {}, False)[2]
    restricted = _bake_output(reg, "text/plain", None, {"name[]": names}, False)[2]
    print(f"registry: {made} metric objects from the sample's {families} families; {len(names)} names asked for")
    print(f"body:     whole {len(whole):,} bytes, restricted {len(restricted):,} bytes")
    w_ms, r_ms = render_ms(reg, {}), render_ms(reg, {"name[]": names})
    print(f"render:   whole {w_ms:.3f} ms, restricted {r_ms:.3f} ms per scrape "
          f"({w_ms * 10:.1f} and {r_ms * 10:.1f} ms of the pod's CPU a second at a 100 ms scrape)")
    if args.sidecar:
        server = serve(reg)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        a, b = scrape_once(args.sidecar, url, False), scrape_once(args.sidecar, url, True)
        print(f"sidecar:  filtered {a['filtered']} {a['body_bytes']} bytes, whole {b['body_bytes']} bytes; "
              f"the same reading: {same_reading(a, b)} ({len(a['raw'])} samples used)")
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
