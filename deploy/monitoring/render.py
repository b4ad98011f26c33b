#!/usr/bin/env python3
"""Writes deploy/monitoring's generated files from gpuroute-rules.yaml and the specs below:

  prometheusrule.yaml     the rules as a Prometheus Operator PrometheusRule (same groups)
  rules-test.yaml         promtool unit tests of every alert (`promtool test rules`)
  grafana-dashboard.json  the Grafana dashboard

  render.py            rewrite them
  render.py --check    exit 1 if any differs from what it would write (the test suite runs this)

The dashboard's queries and the rules' expressions are also run against a real Prometheus
scraping a real Envoy and sidecar-metrics (tests/e2e/test_monitoring.py).
"""

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "gpuroute-rules.yaml"

# ---------------------------------------------------------------------------------------------
# The dashboard. Each panel: title, unit, queries as (expr, legend). `$pool` is the dashboard's
# pool selector (a regex; all pools by default), `$__rate_interval` Grafana's rate window.

PICKS = 'envoy_(dynamicmodulescustom_)?gpuroute_pool_picks'
# The dashboard's pools: those with requests of their own, and those whose requests all moved to
# another pool (counted under the pool that took them, with this one in `gpuroute_pool`).
POOL_SERIES = '{__name__=~"envoy_gpuroute_(pool_requests|failover_to|overflow_to)"}'
OVERFLOWED = 'sum by (gpuroute_pool) (rate(envoy_gpuroute_overflow_to{gpuroute_pool=~"$pool"}[$__rate_interval]))'
ROWS = [
    ("Routing", [
        ("Requests by pool and outcome", "reqps", [
            ('sum by (gpuroute_pool, gpuroute_outcome) (rate(envoy_gpuroute_pool_requests{gpuroute_pool=~"$pool"}[$__rate_interval]))',
             "{{gpuroute_pool}} {{gpuroute_outcome}}"),
        ]),
        ("Fail-open share by pool", "percentunit", [
            ('sum by (gpuroute_pool) (rate(envoy_gpuroute_pool_requests{gpuroute_pool=~"$pool", gpuroute_outcome="fail_open"}[$__rate_interval]))'
             ' / sum by (gpuroute_pool) (rate(envoy_gpuroute_pool_requests{gpuroute_pool=~"$pool", gpuroute_outcome!="routed"}[$__rate_interval]))',
             "{{gpuroute_pool}}"),
        ]),
        ("Fail-opens by reason", "reqps", [
            ("sum by (gpuroute_reason) (rate(envoy_gpuroute_fail_open[$__rate_interval]))", "{{gpuroute_reason}}"),
        ]),
        ("Picks by pod", "reqps", [
            # `> 0`: pods that left keep their counters (Envoy never removes one), not drawn.
            (f'sum by (gpuroute_pool, gpuroute_endpoint) (rate({{__name__=~"{PICKS}", gpuroute_pool=~"$pool"}}[$__rate_interval])) > 0',
             "{{gpuroute_pool}} {{gpuroute_endpoint}}"),
        ]),
        ("Time to first token by pool (streamed requests, from the routing decision)", "ms", [
            ('histogram_quantile(0.5, sum by (le, gpuroute_pool) (rate(envoy_gpuroute_pool_ttft_ms_bucket{gpuroute_pool=~"$pool"}[$__rate_interval])))',
             "{{gpuroute_pool}} p50"),
            ('histogram_quantile(0.99, sum by (le, gpuroute_pool) (rate(envoy_gpuroute_pool_ttft_ms_bucket{gpuroute_pool=~"$pool"}[$__rate_interval])))',
             "{{gpuroute_pool}} p99"),
        ]),
        ("Requests the filter refused, by error code", "reqps", [
            ("sum by (gpuroute_code) (rate(envoy_gpuroute_rejected[$__rate_interval]))", "{{gpuroute_code}}"),
        ]),
        ("Decision time", "µs", [
            ("histogram_quantile(0.5, sum by (le) (rate(envoy_gpuroute_decision_us_bucket[$__rate_interval])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(envoy_gpuroute_decision_us_bucket[$__rate_interval])))", "p99"),
        ]),
        ("Weighted splits, by version taken", "reqps", [
            ("sum by (gpuroute_split, gpuroute_target) (rate(envoy_gpuroute_split_to[$__rate_interval]))",
             "{{gpuroute_split}} -> {{gpuroute_target}}"),
            ("sum by (gpuroute_split) (rate(envoy_gpuroute_split_rerouted[$__rate_interval]))", "{{gpuroute_split}} rerouted"),
        ]),
        # One query each: the dynamic module defines both counters of a pool that overflows, so
        # one rate() over both names would hold two series of the same labels, and fail.
        ("Failover and overflow, by pool and the pool that took its requests", "reqps", [
            ('sum by (gpuroute_pool, gpuroute_target) (rate(envoy_gpuroute_failover_to{gpuroute_pool=~"$pool"}[$__rate_interval]))',
             "{{gpuroute_pool}} -> {{gpuroute_target}} (failover)"),
            ('sum by (gpuroute_pool, gpuroute_target) (rate(envoy_gpuroute_overflow_to{gpuroute_pool=~"$pool"}[$__rate_interval]))',
             "{{gpuroute_pool}} -> {{gpuroute_target}} (overflow)"),
        ]),
        # What GpurouteOverflowingSustained watches: of a pool's requests, those it kept
        # (counted in its own requests) and those it sent on (counted in the pool that took
        # them), the share sent on; `or` for a pool that kept none.
        ("Overflow share by pool (of its requests, kept or sent on)", "percentunit", [
            (f'{OVERFLOWED} / ({OVERFLOWED} + (sum by (gpuroute_pool) (rate(envoy_gpuroute_pool_requests{{gpuroute_pool=~"$pool"}}[$__rate_interval]))'
             f' or 0 * {OVERFLOWED}))',
             "{{gpuroute_pool}}"),
        ]),
        ("Held requests by pool (hold)", "short", [
            ('sum by (gpuroute_pool) (max_over_time(envoy_gpuroute_held{gpuroute_pool=~"$pool"}[$__rate_interval]))',
             "{{gpuroute_pool}} held (the most at once)"),
            ('histogram_quantile(0.99, sum by (le, gpuroute_pool) (rate(envoy_gpuroute_hold_ms_bucket{gpuroute_pool=~"$pool"}[$__rate_interval])))',
             "{{gpuroute_pool}} p99 wait (ms)"),
        ]),
    ]),
    ("Snapshot", [
        ("Snapshot age", "ms", [
            ("max by (instance) (envoy_gpuroute_snapshot_age_ms)", "{{instance}}"),
        ]),
        ("Snapshots taken and rejected", "ops", [
            ("sum by (instance) (rate(envoy_gpuroute_snapshot_accepted[$__rate_interval]))", "{{instance}} accepted"),
            ("sum by (instance, gpuroute_reason) (rate(envoy_gpuroute_snapshot_rejected[$__rate_interval]))",
             "{{instance}} rejected: {{gpuroute_reason}}"),
        ]),
        ("Pods in the snapshot", "short", [
            ("max by (instance) (envoy_gpuroute_snapshot_pods)", "{{instance}}"),
        ]),
    ]),
    ("Aggregator (sidecar-metrics)", [
        ("Pods by health", "short", [
            ('max by (gpuroute_pool, healthy) (gpuroute_sidecar_pods{gpuroute_pool=~"$pool"})', "{{gpuroute_pool}} healthy={{healthy}}"),
        ]),
        ("Requests per healthy pod, by pool (the pods' own counts)", "short", [
            ('max by (gpuroute_pool) (gpuroute_sidecar_pool_waiting{gpuroute_pool=~"$pool"})'
             ' / clamp_min(max by (gpuroute_pool) (gpuroute_sidecar_pods{gpuroute_pool=~"$pool", healthy="true"}), 1)',
             "{{gpuroute_pool}} waiting"),
            ('max by (gpuroute_pool) (gpuroute_sidecar_pool_running{gpuroute_pool=~"$pool"})'
             ' / clamp_min(max by (gpuroute_pool) (gpuroute_sidecar_pods{gpuroute_pool=~"$pool", healthy="true"}), 1)',
             "{{gpuroute_pool}} running"),
        ]),
        ("KV-cache use by pool (mean of its healthy pods)", "percentunit", [
            ('max by (gpuroute_pool) (gpuroute_sidecar_pool_kv_cache_usage{gpuroute_pool=~"$pool"})', "{{gpuroute_pool}}"),
        ]),
        ("Failed scrapes by pool and kind", "ops", [
            ('sum by (gpuroute_pool, kind) (rate(gpuroute_sidecar_scrape_failures_total{gpuroute_pool=~"$pool"}[$__rate_interval]))', "{{gpuroute_pool}} {{kind}}"),
        ]),
        ("Scrape and round time, p99", "s", [
            ("histogram_quantile(0.99, sum by (le) (rate(gpuroute_sidecar_scrape_duration_seconds_bucket[$__rate_interval])))", "scrape"),
            ("histogram_quantile(0.99, sum by (le) (rate(gpuroute_sidecar_round_duration_seconds_bucket[$__rate_interval])))", "round"),
        ]),
        ("Snapshot pushes", "ops", [
            ("sum by (url) (rate(gpuroute_sidecar_push_accepted_total[$__rate_interval]))", "{{url}} accepted"),
            ("sum by (url, reason) (rate(gpuroute_sidecar_push_failures_total[$__rate_interval]))", "{{url}} failed: {{reason}}"),
        ]),
        ("Push time, p99", "s", [
            ("histogram_quantile(0.99, sum by (le, url) (rate(gpuroute_sidecar_push_duration_seconds_bucket[$__rate_interval])))", "{{url}}"),
        ]),
        ("Between gateway replicas (relay)", "ops", [
            ("sum by (direction) (rate(gpuroute_sidecar_prefix_records_total[$__rate_interval]))", "prefix records {{direction}}"),
            ("sum by (direction) (rate(gpuroute_sidecar_replica_load_relayed_total[$__rate_interval]))", "prefill counts {{direction}}"),
        ]),
    ]),
]


def dashboard():
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels, y, pid = [], 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "id": pid, "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, queries) in enumerate(row_panels):
            panels.append({
                "type": "timeseries",
                "id": pid,
                "title": title,
                "datasource": ds,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [{"datasource": ds, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j)}
                            for j, (expr, legend) in enumerate(queries)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": "gpuroute",
        "uid": "gpuroute",
        "description": "GPU-aware routing inside Envoy: the filter's decisions and sidecar-metrics' scrapes and pushes.",
        "tags": ["gpuroute", "envoy", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "pool", "label": "Pool", "type": "query", "datasource": ds,
             "query": {"query": f"label_values({POOL_SERIES}, gpuroute_pool)", "refId": "pools"},
             "definition": f"label_values({POOL_SERIES}, gpuroute_pool)",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "hide": 0, "sort": 1},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


# ---------------------------------------------------------------------------------------------
# promtool unit tests. Each: a name, input series (promtool's expanding notation, one sample a
# minute), and per alert the times to evaluate with the alerts expected then (labels and the
# summary as rendered; the description, static text, is taken from the rules).

def series(name, labels, values):
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


GW = {"instance": "gw-0"}
SC = {"instance": "sc-0"}
URL = "http://127.0.0.1:9002/gpuroute/v1/snapshot"


def requests(pool, outcome, values):
    return series("envoy_gpuroute_pool_requests", {**GW, "gpuroute_runtime": "wasm", "gpuroute_pool": pool,
                                                   "gpuroute_outcome": outcome}, values)


TESTS = [
    ("10% of llama fails open for 5 minutes, qwen 2%: llama alone, and only once it lasted 5 minutes", [
        requests("llama", "picked", "0+90x30"), requests("llama", "fail_open", "0+10x30"),
        requests("qwen", "picked", "0+98x30"), requests("qwen", "fail_open", "0+2x30"),
        # Routed by model by design: not counted against the pool.
        requests("qwen", "routed", "0+500x30"),
    ], [
        ("GpurouteFailingOpen", "4m", []),
        ("GpurouteFailingOpen", "15m", [({"gpuroute_pool": "llama"}, "Pool llama: 10% of requests fail open")]),
    ]),
    ("A snapshot 6 s old for 2 minutes; another gateway's fresh", [
        series("envoy_gpuroute_snapshot_age_ms", GW, "6000x5"),
        series("envoy_gpuroute_snapshot_age_ms", {"instance": "gw-1"}, "80x5"),
    ], [
        ("GpurouteSnapshotStale", "30s", []),
        ("GpurouteSnapshotStale", "2m", [(GW, "The gateway's metrics snapshot is 6k ms old")]),
    ]),
    ("Requests fail open for want of any snapshot", [
        series("envoy_gpuroute_fail_open", {**GW, "gpuroute_reason": "no_snapshot"}, "0+60x20"),
        series("envoy_gpuroute_fail_open", {"instance": "gw-1", "gpuroute_reason": "no_fresh_pod"}, "0+60x20"),
    ], [
        ("GpurouteNeverGotASnapshot", "10m", [(GW, "gw-0 routes without ever having had a snapshot")]),
    ]),
    ("A snapshot rejected for a bad token, then none for 10 minutes", [
        series("envoy_gpuroute_snapshot_rejected", {**GW, "gpuroute_reason": "unauthorized"}, "0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1"),
    ], [
        ("GpurouteSnapshotsRejected", "1m", []),
        ("GpurouteSnapshotsRejected", "5m", [({**GW, "gpuroute_reason": "unauthorized"}, "gw-0 rejects snapshots (unauthorized)")]),
        ("GpurouteSnapshotsRejected", "15m", []),
    ]),
    ("Pool llama loses all its pods; qwen has one of three; an empty pool is no alarm", [
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "llama", "healthy": "true"}, "4 4 0 0 0 0 0 0 0 0 0 0 0 0 0"),
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "llama", "healthy": "false"}, "0 0 4 4 4 4 4 4 4 4 4 4 4 4 4"),
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "qwen", "healthy": "true"}, "1x14"),
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "qwen", "healthy": "false"}, "2x14"),
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "empty", "healthy": "true"}, "0x14"),
        series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "empty", "healthy": "false"}, "0x14"),
    ], [
        ("GpuroutePoolWithoutHealthyPods", "2m", []),
        ("GpuroutePoolWithoutHealthyPods", "4m", [({"gpuroute_pool": "llama"}, "Pool llama has no healthy pod")]),
        ("GpuroutePoolDegraded", "12m", [({"gpuroute_pool": "llama"}, "Pool llama: only 0% of pods healthy"),
                                         ({"gpuroute_pool": "qwen"}, "Pool qwen: only 33.33% of pods healthy")]),
    ]),
    ("A fifth of the scrapes fail", [
        series("gpuroute_sidecar_scrape_failures_total", {**SC, "gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.1:8000", "kind": "timeout"}, "0+120x30"),
        series("gpuroute_sidecar_scrape_duration_seconds_count", SC, "0+600x30"),
    ], [
        ("GpurouteScrapesFailing", "8m", []),
        ("GpurouteScrapesFailing", "20m", [({}, "20% of sidecar-metrics' scrapes fail")]),
    ]),
    ("Pushes to one Envoy all fail; to another they go through, a few failing", [
        # Accepted until minute 5 (a new token rolled out to the Envoy, not to the sidecar).
        series("gpuroute_sidecar_push_accepted_total", {**SC, "url": URL}, "0+600x5 3000x15"),
        series("gpuroute_sidecar_push_failures_total", {**SC, "url": URL, "reason": "unauthorized_401"}, "0x5 0+600x15"),
        series("gpuroute_sidecar_push_accepted_total", {**SC, "url": "http://127.0.0.1:9003/gpuroute/v1/snapshot"}, "0+600x20"),
        series("gpuroute_sidecar_push_failures_total", {**SC, "url": "http://127.0.0.1:9003/gpuroute/v1/snapshot",
                                               "reason": "timeout"}, "0+1x20"),
    ], [
        # The last accepted push still inside the 5-minute window, then the 2 minutes' `for`.
        ("GpuroutePushesFailing", "9m", []),
        ("GpuroutePushesFailing", "13m", [({**SC, "url": URL}, f"sidecar-metrics cannot push to {URL}")]),
    ]),
    ("Half the rounds miss their deadline", [
        series("gpuroute_sidecar_rounds_incomplete_total", SC, "0+300x30"),
        series("gpuroute_sidecar_round_duration_seconds_count", SC, "0+600x30"),
    ], [
        ("GpurouteRoundsIncomplete", "20m", [(SC, "50% of scrape rounds miss their publish deadline")]),
    ]),
    ("Pool llama fails over to dr for 5 minutes; qwen's one request to its standby does not count", [
        series("envoy_gpuroute_failover_to", {**GW, "gpuroute_pool": "llama", "gpuroute_target": "dr"}, "0+30x15"),
        series("envoy_gpuroute_failover_to", {**GW, "gpuroute_pool": "qwen", "gpuroute_target": "standby"}, "0 1x14"),
    ], [
        ("GpurouteFailingOver", "4m", []),
        ("GpurouteFailingOver", "11m", [({"gpuroute_pool": "llama", "gpuroute_target": "dr"},
                                         "Pool llama's requests go to its failover pool dr")]),
    ]),
    ("Pool llama overflows a third of its requests for an hour; qwen, which kept none, all of a few; mistral one in ten", [
        series("envoy_gpuroute_overflow_to", {**GW, "gpuroute_pool": "llama", "gpuroute_target": "burst"}, "0+30x70"),
        requests("llama", "picked", "0+60x70"),
        series("envoy_gpuroute_overflow_to", {**GW, "gpuroute_pool": "qwen", "gpuroute_target": "burst"}, "0+3x70"),
        series("envoy_gpuroute_overflow_to", {**GW, "gpuroute_pool": "mistral", "gpuroute_target": "burst"}, "0+6x70"),
        requests("mistral", "picked", "0+54x70"),
    ], [
        ("GpurouteOverflowingSustained", "20m", []),
        ("GpurouteOverflowingSustained", "65m", [({"gpuroute_pool": "llama"}, "Pool llama overflows 33.33% of its requests"),
                                                 ({"gpuroute_pool": "qwen"}, "Pool qwen overflows 100% of its requests")]),
    ]),
    ("A pod of llama ejected once; qwen's counter defined and never counting", [
        series("envoy_gpuroute_pool_ejections", {**GW, "gpuroute_pool": "llama"}, "0x5 1x30"),
        series("envoy_gpuroute_pool_ejections", {**GW, "gpuroute_pool": "qwen"}, "0x35"),
    ], [
        ("GpuroutePodsEjected", "4m", []),
        ("GpuroutePodsEjected", "10m", [({"gpuroute_pool": "llama"}, "Pool llama: pods ejected by the gateway's passive health")]),
        ("GpuroutePodsEjected", "25m", []),
    ]),
    ("Pool llama sheds", [
        requests("llama", "shed", "0+30x15"),
        requests("qwen", "picked", "0+30x15"),
    ], [
        ("GpurouteShedding", "10m", [({"gpuroute_pool": "llama"}, "Pool llama sheds 0.50 requests/s")]),
    ]),
    ("Held requests run out their wait", [
        series("envoy_gpuroute_hold_expired", {**GW, "gpuroute_pool": "llama"}, "0+6x15"),
        series("envoy_gpuroute_hold_expired", {**GW, "gpuroute_pool": "qwen"}, "0+0x15"),
    ], [
        ("GpurouteHoldExpiring", "10m", [({**GW, "gpuroute_pool": "llama"},
                                          "Held requests of pool llama wait out hold.max_wait_ms on gw-0")]),
    ]),
    ("A quarter of the turns by stored response miss their pod", [
        series("envoy_gpuroute_responses_pinned", GW, "0+30x40"),
        series("envoy_gpuroute_responses_unpinned", GW, "0+10x40"),
    ], [
        ("GpurouteResponsesUnpinned", "10m", []),
        ("GpurouteResponsesUnpinned", "35m", [(GW, "25% of stored-response turns cannot reach their pod")]),
    ]),
    ("Picks of new pods counted as other, after the pods before them had theirs", [
        series("envoy_gpuroute_pool_picks", {**GW, "gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.1:8000"}, "0+60x30"),
        series("envoy_dynamicmodulescustom_gpuroute_pool_picks",
               {"instance": "gw-1", "gpuroute_pool": "qwen", "gpuroute_endpoint": "other"}, "0x10 0+30x20"),
    ], [
        ("GpuroutePodStatsFull", "9m", []),
        ("GpuroutePodStatsFull", "12m", [({"instance": "gw-1", "gpuroute_pool": "qwen"},
                                          "Pool qwen: picks of new pods counted as other on gw-1")]),
    ]),
    ("Decisions take 2.5 ms at p99", [
        series("envoy_gpuroute_decision_us_bucket", {**GW, "le": "1000"}, "0+0x20"),
        series("envoy_gpuroute_decision_us_bucket", {**GW, "le": "2500"}, "0+60x20"),
        series("envoy_gpuroute_decision_us_bucket", {**GW, "le": "+Inf"}, "0+60x20"),
    ], [
        ("GpurouteDecisionSlow", "15m", [({}, "The filter's routing decision takes 2.485k us at p99")]),
    ]),
    ("The Wasm VM is reloaded once", [
        series("envoy_wasm_gpuroute_vm_reload_success", GW, "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1"),
        # Envoy's vm_reload stays 0 through a reload; the requests answered while it backed off.
        series("envoy_wasm_gpuroute_vm_reload", GW, "0x23"),
        series("envoy_wasm_gpuroute_vm_reload_backoff", GW, "0 0 0 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6 6"),
    ], [
        ("GpurouteWasmVmReloaded", "5m", [(GW, "The filter's Wasm VM was reloaded on gw-0")]),
        ("GpurouteWasmVmReloaded", "22m", []),
    ]),
    ("One of four workers' Wasm VM never started: 5 VMs where 6 should run", [
        series("envoy_wasm_envoy_wasm_runtime_v8_active", GW, "5x20"),
        series("envoy_server_concurrency", GW, "4x20"),
        # Every VM of its two workers, and of the main thread, runs.
        series("envoy_wasm_envoy_wasm_runtime_v8_active", {"instance": "gw-1"}, "4x20"),
        series("envoy_server_concurrency", {"instance": "gw-1"}, "2x20"),
        # Two builds of the filter side by side (an upgrade): more VMs than workers need.
        series("envoy_wasm_envoy_wasm_runtime_v8_active", {"instance": "gw-2"}, "8x20"),
        series("envoy_server_concurrency", {"instance": "gw-2"}, "2x20"),
        # The dynamic module: no Wasm VM, no series.
        series("envoy_server_concurrency", {"instance": "gw-3"}, "2x20"),
    ], [
        ("GpurouteWorkerWithoutFilter", "4m", []),
        ("GpurouteWorkerWithoutFilter", "10m", [(GW, "A worker of gw-0 runs without the filter: 5 Wasm VMs")]),
    ]),
]

# Two gateway replicas' aggregators, each reporting the pools it scrapes: llama (3 healthy pods),
# and a pool scaled to zero.
POOL_LOAD = [
    series("gpuroute_sidecar_pool_waiting", {**SC, "gpuroute_pool": "llama"}, "6x10"),
    series("gpuroute_sidecar_pool_running", {**SC, "gpuroute_pool": "llama"}, "18x10"),
    series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "llama", "healthy": "true"}, "3x10"),
    series("gpuroute_sidecar_pool_waiting", {"instance": "sc-1", "gpuroute_pool": "llama"}, "6x10"),
    series("gpuroute_sidecar_pool_running", {"instance": "sc-1", "gpuroute_pool": "llama"}, "18x10"),
    series("gpuroute_sidecar_pods", {"instance": "sc-1", "gpuroute_pool": "llama", "healthy": "true"}, "3x10"),
    # A pool scaled to zero: nothing waits, and no division by zero.
    series("gpuroute_sidecar_pool_waiting", {**SC, "gpuroute_pool": "burst"}, "0x10"),
    series("gpuroute_sidecar_pool_running", {**SC, "gpuroute_pool": "burst"}, "0x10"),
    series("gpuroute_sidecar_pods", {**SC, "gpuroute_pool": "burst", "healthy": "true"}, "0x10"),
]

# Recording rules checked by value (promtool's promql_expr_test).
EXPR_TESTS = [
    ("Time to first token per pool: the 99th percentile of the last 5 minutes", [
        series("envoy_gpuroute_pool_ttft_ms_bucket", {**GW, "gpuroute_pool": "llama", "le": "100"}, "0+54x10"),
        series("envoy_gpuroute_pool_ttft_ms_bucket", {**GW, "gpuroute_pool": "llama", "le": "250"}, "0+60x10"),
        series("envoy_gpuroute_pool_ttft_ms_bucket", {**GW, "gpuroute_pool": "llama", "le": "+Inf"}, "0+60x10"),
    ], "5m", "gpuroute:ttft_ms:p99_5m", [
        # One in ten over 100 ms, none over 250: the 99th percentile is 9/10 of the way through
        # (100, 250].
        ({"gpuroute_pool": "llama"}, 235),
    ]),
    ("Picks per pod, from either build's counter", [
        series("envoy_gpuroute_pool_picks", {**GW, "gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.1:8000"}, "0+60x10"),
        series("envoy_dynamicmodulescustom_gpuroute_pool_picks",
               {"instance": "gw-1", "gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.2:8000"}, "0+120x10"),
    ], "5m", "gpuroute:endpoint_picks:rate5m", [
        ({"gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.1:8000"}, 1),
        ({"gpuroute_pool": "llama", "gpuroute_endpoint": "10.0.0.2:8000"}, 2),
    ]),
    ("Requests per healthy pod: two gateway replicas' aggregators report the same pools",
     POOL_LOAD, "5m", "gpuroute:pool_requests_per_pod", [
        ({"gpuroute_pool": "llama"}, 8),
        ({"gpuroute_pool": "burst"}, 0),
    ]),
    ("Requests waiting per healthy pod, the same pools",
     POOL_LOAD, "5m", "gpuroute:pool_waiting_per_pod", [
        ({"gpuroute_pool": "llama"}, 2),
        ({"gpuroute_pool": "burst"}, 0),
    ]),
]


def rules_test(rules):
    described = {r["alert"]: r["annotations"]["description"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    severity = {r["alert"]: r["labels"]["severity"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    untested = set(described) - {alert for _, _, checks in TESTS for alert, _, _ in checks}
    if untested:
        raise SystemExit(f"render.py: alerts without a unit test: {sorted(untested)}")
    tests = []
    for name, inputs, checks in TESTS:
        tests.append({
            "name": name,
            "interval": "1m",
            "input_series": inputs,
            "alert_rule_test": [
                {"eval_time": at, "alertname": alert, "exp_alerts": [
                    {"exp_labels": {"severity": severity[alert], **labels},
                     "exp_annotations": {"summary": summary, "description": described[alert]}}
                    for labels, summary in expected]}
                for alert, at, expected in checks
            ],
        })
    for name, inputs, at, expr, expected in EXPR_TESTS:
        tests.append({
            "name": name,
            "interval": "1m",
            "input_series": inputs,
            "promql_expr_test": [{"expr": expr, "eval_time": at, "exp_samples": [
                {"labels": expr + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "value": value}
                for labels, value in expected]}],
        })
    return {"rule_files": [RULES.name], "evaluation_interval": "1m", "tests": tests}


def prometheus_rule(rules):
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "gpuroute", "labels": {"app.kubernetes.io/name": "gpuroute"}},
        "spec": rules,
    }


HEADER = "# GENERATED by deploy/monitoring/render.py from {source}. Do not edit: edit the source, then run\n# `.venv/bin/python deploy/monitoring/render.py`.\n"


def outputs():
    rules = yaml.safe_load(RULES.read_text())
    dump = lambda doc: yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)  # noqa: E731
    return {
        "prometheusrule.yaml": HEADER.format(source="gpuroute-rules.yaml") + dump(prometheus_rule(rules)),
        "rules-test.yaml": HEADER.format(source="its TESTS") + dump(rules_test(rules)),
        "grafana-dashboard.json": json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n",
    }


def main(argv):
    check = "--check" in argv
    stale = []
    for name, text in outputs().items():
        path = HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"deploy/monitoring: {', '.join(stale)} out of date; run .venv/bin/python deploy/monitoring/render.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
