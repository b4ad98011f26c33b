"""deploy/monitoring's rules and dashboard, checked against what the filter and sidecar-metrics
really export: promtool checks and unit-tests the rules, then a real Prometheus scrapes a real
Envoy (with the build under test) and a real sidecar-metrics in front of stub pods, while the
stack goes through what the alerts are about (a pool with no healthy pod, fail-opens, a
snapshot with a bad token, a saturated pool holding and shedding, a saturated pool overflowing
to its burst pool, a weighted split whose target cannot serve, a pod answering every request
with a 500, streamed requests, Responses API turns), and finally loses its
aggregator. Every series the rules and the dashboard name must exist, every dashboard query and
every recording rule must return data from that, every rule must evaluate without error, and the
alerts about those situations, and only those, must be pending or firing."""

import http.client
import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from harness import RUNTIME, ROOT, STAT_PREFIX, Envoy, Sidecar, free_port, stop_process, wait_for, work_dir
from stubpod import StubPod

MONITORING = ROOT / "deploy" / "monitoring"
AUTOSCALING = ROOT / "deploy" / "autoscaling"
PROM_DIR = ROOT / ".venv" / "prometheus"
PROMETHEUS, PROMTOOL = PROM_DIR / "prometheus", PROM_DIR / "promtool"
# What `$__rate_interval` stands for here: Prometheus scrapes every second, so a few seconds of
# samples make a rate.
RATE_WINDOW = "10s"

CONFIG = {
    "pools": [
        {"name": "llama", "models": ["llama-3-8b"]},
        {"name": "qwen", "models": ["qwen-7b"]},
        {"name": "mistral", "models": ["mistral-7b"]},
        # gemma's only pod is dead too, but gemma fails over to a standby pool that serves.
        {"name": "gemma", "models": ["gemma-2b"], "failover": ["standby"]},
        {"name": "standby", "models": []},
        # phi's only pod is saturated from the start: all its requests overflow to the standby.
        {"name": "phi", "models": ["phi-3"], "failover": ["standby"], "overflow": True},
        # flaky's only pod answers every request with a 500: passive health ejects it.
        {"name": "flaky", "models": ["flaky-1b"]},
    ],
    # Half of the split's conversations belong to mistral, which cannot serve (below): they
    # are rerouted to llama.
    "splits": {"chat": [{"model": "llama-3-8b", "weight": 50}, {"model": "mistral-7b", "weight": 50}]},
    "hold": {"max_wait_ms": 100},
    # Two of the three pods get a picks counter of their own; the one picked last is counted
    # as `other` in its pool.
    "max_pod_stats": 2,
}

# Alerts this scenario brings about (pending, for those with a `for`, or firing), with the
# labels that must be on them; and every other alert must stay quiet.
EXPECTED_ALERTS = {
    "GpuroutePoolWithoutHealthyPods": {"gpuroute_pool": "mistral"},
    "GpurouteFailingOpen": {"gpuroute_pool": "mistral"},
    "GpurouteSnapshotsRejected": {"gpuroute_reason": "unauthorized"},
    "GpurouteShedding": {"gpuroute_pool": "llama"},
    "GpurouteHoldExpiring": {"gpuroute_pool": "llama"},
    "GpurouteScrapesFailing": {},
    "GpuroutePoolDegraded": {"gpuroute_pool": "mistral"},
    "GpurouteResponsesUnpinned": {},  # half the turns name an id the gateway never saw
    "GpuroutePodStatsFull": {},
    "GpurouteFailingOver": {"gpuroute_pool": "gemma", "gpuroute_target": "standby"},
    "GpurouteOverflowingSustained": {"gpuroute_pool": "phi"},
    "GpuroutePodsEjected": {"gpuroute_pool": "flaky"},
}
# ... and the one about the ingest URL where no Envoy listens (the fixture's `nowhere`).
PUSHES_FAILING = "GpuroutePushesFailing"


def need_prometheus():
    if not (PROMETHEUS.exists() and PROMTOOL.exists()):
        pytest.fail(f"no Prometheus in {PROM_DIR}: `make prometheus` fetches it (make e2e does)")


def test_generated_files_are_up_to_date():
    """prometheusrule.yaml, rules-test.yaml and the dashboard are what render.py makes of the
    rules and its specs (the PrometheusRule's groups are the rule file's)."""
    proc = subprocess.run([sys.executable, str(MONITORING / "render.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    need_prometheus()
    for args in (["check", "rules", "gpuroute-rules.yaml"], ["test", "rules", "rules-test.yaml"]):
        proc = subprocess.run([str(PROMTOOL), *args], cwd=MONITORING, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


class Prometheus:
    """A real Prometheus scraping `targets` ({job: (address, path)}) every second and
    evaluating the shipped rules every second."""

    def __init__(self, targets):
        self.dir = work_dir("gpuroute-prometheus-")
        self.address = f"127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(MONITORING / "gpuroute-rules.yaml")],
            "scrape_configs": [
                {"job_name": job, "metrics_path": path, "static_configs": [{"targets": [address]}]}
                for job, (address, path) in targets.items()
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))
        self.log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [str(PROMETHEUS), "--config.file", str(self.dir / "prometheus.yml"), "--storage.tsdb.path",
             str(self.dir / "data"), "--web.listen-address", self.address],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._ready, timeout=30, what="Prometheus ready")

    def _ready(self):
        if self.proc.poll() is not None:
            raise RuntimeError("prometheus exited: " + (self.dir / "prometheus.log").read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path, **params):
        url = f"http://{self.address}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def active_alerts(self):
        return [a for a in self.api("alerts")["alerts"] if a["state"] in ("pending", "firing")]

    def stop(self):
        stop_process(self.proc)
        self.log.close()


def rules_text():
    return (MONITORING / "gpuroute-rules.yaml").read_text()


def dashboard_queries():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE_WINDOW).replace('=~"$pool"', '=~".*"')
            assert "$" not in expr, expr
            yield panel["title"], expr


@pytest.fixture(scope="module")
def stack():
    need_prometheus()
    pods = {name: StubPod(name) for name in ("llama-0", "llama-1", "qwen-0", "standby-0", "phi-0", "flaky-0")}
    pods["flaky-0"].status = 500
    # Saturated before the first scrape, so no snapshot shows it with room.
    pods["phi-0"].set_load(waiting=40, running=60, kv=0.9)
    # mistral's and gemma's only pods: nothing listens there.
    dead = {"mistral": f"127.0.0.1:{free_port()}", "gemma": f"127.0.0.1:{free_port()}"}
    pools = [
        {"name": "llama", "endpoints": [pods["llama-0"].address, pods["llama-1"].address]},
        {"name": "qwen", "endpoints": [pods["qwen-0"].address]},
        {"name": "mistral", "endpoints": [dead["mistral"]]},
        {"name": "gemma", "endpoints": [dead["gemma"]]},
        {"name": "standby", "endpoints": [pods["standby-0"].address]},
        {"name": "phi", "endpoints": [pods["phi-0"].address]},
        {"name": "flaky", "endpoints": [pods["flaky-0"].address]},
    ]
    # Prometheus reads the gateway's stats through its metrics listener (render.py's
    # `metrics`), as it would from outside the pod, not through the admin port.
    metrics = f"127.0.0.1:{free_port()}"
    gw = Envoy("filter", pools, CONFIG, extra={"metrics": metrics})
    # Pushes to a second ingest URL, where no Envoy listens, fail.
    nowhere = f"http://127.0.0.1:{free_port()}/gpuroute/v1/snapshot"
    # And sidecar-metrics' through its metrics_listen, which serves nothing of the fleet.
    sc_metrics = f"127.0.0.1:{free_port()}"
    sc = Sidecar({p["name"]: p["endpoints"] for p in pools}, [f"http://{gw.ingest}/gpuroute/v1/snapshot", nowhere],
                 extra={"metrics_listen": sc_metrics})
    prom = Prometheus({"envoy": (metrics, "/stats/prometheus"), "sidecar": (sc_metrics, "/metrics")})
    yield pods, gw, sc, prom, nowhere, metrics, dead
    prom.stop()
    sc.stop()
    gw.stop()
    for p in pods.values():
        p.close()


def test_the_metrics_listener_serves_the_stats_and_nothing_else_of_the_admin(stack):
    """render.py's `metrics` listener: GET /stats/prometheus (with a query too) reaches the
    admin interface; any other path or method gets a 404, and Envoy keeps running."""
    _, gw, _, _, _, metrics, _ = stack

    def ask(method, path):
        conn = http.client.HTTPConnection(metrics, timeout=5)
        try:
            conn.request(method, path)
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    for path in ("/stats/prometheus", "/stats/prometheus?usedonly"):
        status, body = ask("GET", path)
        assert status == 200 and "envoy_gpuroute_" in body, (path, status, body[:300])
    for method, path in [("POST", "/quitquitquit"), ("POST", "/healthcheck/fail"), ("GET", "/config_dump"),
                         ("GET", "/stats"), ("GET", "/clusters"), ("POST", "/stats/prometheus"),
                         ("GET", "/stats/prometheus/../config_dump"), ("POST", "/logging?level=trace")]:
        assert ask(method, path)[0] == 404, (method, path)
    assert gw.alive()
    assert gw.chat("llama-3-8b")[0] == 200


def drive(gw, seconds, saturated):
    """Requests of every kind for `seconds`: picks in two pools (qwen's streamed, and Responses
    API turns), fail-opens in mistral, gemma's requests failing over to its standby pool, phi's
    overflowing to it, a split half rerouted, refusals, snapshots with a bad
    token, and, with llama saturated, held requests that run out their wait and sheddable ones
    that are shed."""
    end, i = time.time() + seconds, 0
    while time.time() < end:
        i += 1
        assert gw.chat("llama-3-8b", f"plain {i}")[0] == 200
        streamed = {"model": "qwen-7b", "stream": True, "messages": [{"role": "user", "content": f"streamed {i}"}]}
        # The proxy-wasm filter times one routed request in 8, at random (its decision and,
        # streamed, its first byte): every eighth round sends 8 streamed ones, so that every
        # rate window of the time-to-first-token panel has some. Before it drew at random, one
        # a round fell on the same turn of its count of eight round after round.
        for _ in range(8 if i % 8 == 0 else 1):
            assert gw.request("POST", "/v1/chat/completions", streamed)[0] == 200
        assert gw.chat("qwen-7b", f"plain {i}")[0] == 200
        gw.chat("mistral-7b", f"fails open {i}")  # to a dead pod: Envoy's 503
        assert gw.chat("gemma-2b", f"fails over {i}")[0] == 200
        status, headers, _, _ = gw.chat("phi-3", f"overflows {i}")
        assert status == 200 and headers.get("x-served-by") == "standby-0", (status, headers)
        assert gw.chat("chat", f"conversation {i}")[0] in (200, 503)
        # Picked even once ejected: no other pod of its pool is a candidate.
        assert gw.chat("flaky-1b", f"fails {i}")[0] == 500
        assert gw.chat("no-such-model")[0] == 404
        assert gw.request("POST", "/v1/chat/completions", b"{not json")[0] == 400
        assert gw.push({"version": 1}, token="not-the-token")[0] == 401
        # Responses API turns: one continuing an answer the gateway saw (pinned to its pod),
        # one an id it never saw (unpinned).
        s, _, first, _ = gw.request("POST", "/v1/responses", {"model": "qwen-7b", "input": f"remember {i}"})
        assert s == 200, first
        for rid in (first["id"], "resp_unknown"):
            turn = {"model": "qwen-7b", "previous_response_id": rid, "input": "what was it?"}
            assert gw.request("POST", "/v1/responses", turn)[0] == 200
        if saturated and i % 4 == 0:
            assert gw.chat("llama-3-8b", f"sheddable {i}", headers={"x-gateway-priority": "-1"})[0] == 429
        time.sleep(0.05)


def scaled_object_queries(name, pools):
    """deploy/autoscaling/`name`'s ScaledObject, checked for the fields KEDA's Prometheus scaler
    needs, and its triggers' (query, threshold), the queries with the pools renamed (`pools`:
    {name in the file: pool here})."""
    (doc,) = list(yaml.safe_load_all((AUTOSCALING / name).read_text()))
    assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject"), name
    assert doc["spec"]["scaleTargetRef"]["name"] and doc["metadata"]["namespace"], name
    queries = []
    for trigger in doc["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus" and meta["serverAddress"].startswith("http"), name
        query = meta["query"]
        for old, new in pools.items():
            query = query.replace(f'"{old}"', f'"{new}"').replace(f'{old}|', f'{new}|').replace(f'|{old}"', f'|{new}"')
        assert all(old not in query for old in pools), query
        queries.append((query, float(meta["threshold"])))
    return doc, queries


def test_pool_load_gauges_and_the_autoscaling_queries_read_what_the_pods_report(stack):
    """sidecar-metrics' pool gauges (waiting and running summed over a pool's healthy pods, the
    mean KV-cache use) through a real Prometheus, and the queries of deploy/autoscaling's KEDA
    ScaledObjects run there, for phi (its one pod reports 40 waiting, 60 running, KV 0.9) with
    standby (an idle pod) as its burst pool; KEDA itself is not run here."""
    pods, gw, sc, prom, *_ = stack

    def one(expr):
        got = prom.query(expr)
        return float(got[0]["value"][1]) if len(got) == 1 else got

    wait_for(lambda: one('max(gpuroute_sidecar_pool_waiting{gpuroute_pool="phi"})') == 40, timeout=15,
             what="phi's queue through Prometheus", every=0.2)
    assert one('max(gpuroute_sidecar_pool_running{gpuroute_pool="phi"})') == 60
    assert one('max(gpuroute_sidecar_pool_kv_cache_usage{gpuroute_pool="phi"})') == pytest.approx(0.9)
    # mistral's one pod is dead: no load, and no KV-cache use to average.
    assert one('max(gpuroute_sidecar_pool_waiting{gpuroute_pool="mistral"})') == 0
    assert prom.query('gpuroute_sidecar_pool_kv_cache_usage{gpuroute_pool="mistral"}') == []
    wait_for(lambda: one('gpuroute:pool_requests_per_pod{gpuroute_pool="phi"}') == 100, timeout=15,
             what="the recording rule", every=0.2)
    assert one('gpuroute:pool_waiting_per_pod{gpuroute_pool="phi"}') == 40

    steady, [(requests, threshold), (kv, kv_threshold)] = scaled_object_queries("keda-pool.yaml", {"llama-8b": "phi"})
    assert one(requests) == 100
    # The KV cache's trigger: the mean use times the healthy pods.
    assert one(kv) == pytest.approx(0.9) and kv_threshold == 0.8
    spec = steady["spec"]
    # What KEDA makes of the requests: ceil(100 / 16) replicas, within the bounds.
    assert spec["minReplicaCount"] <= -(-100 // threshold) <= spec["maxReplicaCount"]
    burst, [(over, burst_threshold)] = scaled_object_queries("keda-burst-pool.yaml",
                                                            {"llama-8b-burst": "standby", "llama-8b": "phi"})
    assert burst_threshold == threshold and f"{threshold:g} * max(" in over, over
    # phi's 100 and standby's 0, less the 16 phi's one healthy pod serves.
    assert one(over) == 100 - threshold
    assert burst["spec"]["minReplicaCount"] == 0 and float(burst["spec"]["triggers"][0]["metadata"]["activationThreshold"]) == 0
    # An idle pool and its burst pool: nothing over the steady pool's share.
    _, [(idle, _)] = scaled_object_queries("keda-burst-pool.yaml", {"llama-8b-burst": "standby", "llama-8b": "qwen"})
    assert one(idle) == 0


def test_every_query_and_rule_has_data_and_the_right_alerts_fire(stack):
    pods, gw, sc, prom, nowhere, _, dead = stack
    wait_for(lambda: gw.stats().get(STAT_PREFIX + "gpuroute.snapshot.accepted", 0) > 0, timeout=10,
             what="a snapshot from sidecar-metrics")
    # flaky's pod fails every request: out after five server errors in a row (a proxy-wasm
    # worker reads one answer's status in 8 until it meets an error), long before the alerts
    # are looked at. Prometheus has its ejection counter at 0 first: `increase()` makes nothing
    # of a series whose first sample is 1, so the alert would never fire for a pool's first
    # ejection (the proxy-wasm build defined the counter at its first count before 2026-12-07).
    wait_for(lambda: prom.query('envoy_gpuroute_pool_ejections{gpuroute_pool="flaky"} == 0'), timeout=10,
             what="flaky's ejection counter scraped at 0")
    for i in range(200):
        assert gw.chat("flaky-1b", f"first {i}")[0] == 500
        if gw.stats().get(STAT_PREFIX + "gpuroute.pool.flaky.ejections", 0) >= 1:
            break
    else:
        raise AssertionError("flaky's pod never ejected")
    drive(gw, 3, saturated=False)
    for p in ("llama-0", "llama-1"):
        pods[p].set_load(waiting=40, running=60, kv=0.9)  # saturated: held, then shed
    # Once a snapshot says so (the next scrape and its push), sheddable requests are shed.
    wait_for(lambda: gw.chat("llama-3-8b", "sheddable?", headers={"x-gateway-priority": "-1"})[0] == 429,
             timeout=10, what="llama saturated", every=0.05)
    # Meanwhile one client after another is held, so that Prometheus's scrapes find some held.
    stop = threading.Event()
    held = threading.Thread(target=lambda: [gw.chat("llama-3-8b", "held") for _ in iter(stop.is_set, True)])
    held.start()
    try:
        drive(gw, 9, saturated=True)
    finally:
        stop.set()
        held.join(10)

    # Every dashboard query has a non-zero value (one series at least). The relay's panel too:
    # with two ingest URLs sidecar-metrics relays prefix records between them. The snapshot's
    # age is a gauge the filter sets when it takes in a snapshot and on its ticks: it reads 0 ms
    # when that came in the millisecond of a push (a fresh-clone CI run met it), so a series is
    # its data.
    may_read_zero = {"Snapshot age"}

    def nonzero(title, expr):
        return [s for s in prom.query(expr) if title in may_read_zero or float(s["value"][1]) != 0]

    empty = [(title, expr) for title, expr in dashboard_queries() if not nonzero(title, expr)]
    assert not empty, f"dashboard queries without data: {empty}"
    # The queries the scenario was built to reach have the values it caused.
    picks = {(s["metric"]["gpuroute_pool"], s["metric"]["gpuroute_endpoint"])
             for s in prom.query('sum by (gpuroute_pool, gpuroute_endpoint) (rate({__name__=~"envoy_(dynamicmodulescustom_)?gpuroute_pool_picks"}[1m]))')}
    # The endpoint label is the pod's address in both builds, as Prometheus's `instance` of the
    # pod's own scrape is: a query can join the two. Five pods are picked (two of llama's,
    # qwen's, the standby's and flaky's); the first two admitted fill `max_pod_stats`, the
    # others are `other` in their pools. Which two comes first depends on the order of the
    # first picks (and, in the module, of one flush), so only the counts are fixed.
    homes = {"llama": {pods["llama-0"].address, pods["llama-1"].address}, "qwen": {pods["qwen-0"].address},
             "standby": {pods["standby-0"].address}, "flaky": {pods["flaky-0"].address}}
    own = [(p, e) for p, e in picks if e != "other"]
    assert len(own) == 2 and all(e in homes[p] for p, e in own), picks
    # Every pool has its picks: under a pod's own counter, or as `other`.
    assert {p for p, _ in picks} == set(homes), picks
    # sidecar-metrics labels its pods the same way: the dead pods' failed scrapes carry the
    # pool and the address Envoy's counters would.
    failed = {(s["metric"]["gpuroute_pool"], s["metric"]["gpuroute_endpoint"], s["metric"]["kind"])
              for s in prom.query("gpuroute_sidecar_scrape_failures_total > 0")}
    assert failed == {(pool, addr, "connect") for pool, addr in dead.items()}, failed
    outcomes = {(s["metric"]["gpuroute_pool"], s["metric"]["gpuroute_outcome"]) for s in prom.query("gpuroute:requests:rate5m")
                if float(s["value"][1]) > 0}
    assert {("llama", "picked"), ("llama", "shed"), ("qwen", "picked"), ("mistral", "fail_open")} <= outcomes, outcomes
    reasons = {s["metric"]["gpuroute_reason"] for s in prom.query("rate(envoy_gpuroute_fail_open[1m]) > 0")}
    assert reasons == {"no_fresh_pod"}, reasons
    overflowed = {(s["metric"]["gpuroute_pool"], s["metric"]["gpuroute_target"])
                  for s in prom.query("rate(envoy_gpuroute_overflow_to[1m]) > 0")}
    assert overflowed == {("phi", "standby")}, overflowed
    rerouted = prom.query('sum by (gpuroute_split) (increase(envoy_gpuroute_split_rerouted[1m])) > 0')
    assert [s["metric"]["gpuroute_split"] for s in rerouted] == ["chat"], rerouted
    assert set(prom.api("label/gpuroute_pool/values")) >= {"llama", "qwen", "mistral"}

    # Every series the rules and the dashboard name exists here: a renamed stat would leave an
    # expression quietly empty, an alert that can never fire. But the Wasm VMs' reload counter
    # and their count, which the dynamic module has no VM for.
    names = set()
    for expr in [e for _, e in dashboard_queries()] + re.findall(r"expr: (.+(?:\n {10,}.+)*)", rules_text()):
        names |= {("=~", n) for n in re.findall(r'__name__=~"([^"]+)"', expr)}
        plain = re.sub(r'__name__=~"[^"]+"', "", expr)
        names |= {("=", n) for n in re.findall(r"\b((?:envoy|gpuroute_sidecar)_[a-z0-9_]+)\b", plain)}
    missing = [n for op, n in sorted(names)
               if not prom.query(f'count({{__name__{op}"{n}"}})')
               and not (RUNTIME == "dynamic" and n in ("envoy_wasm_.+_vm_reload_(success|backoff)", "envoy_wasm_envoy_wasm_runtime_v8_active"))]
    assert len(names) >= 25 and missing == [], (len(names), missing)
    # The histograms have the shipped buckets (render.HISTOGRAM_BUCKETS), not Envoy's coarse
    # defaults that had histogram_quantile read a 1.25 s TTFT p99 as 2.5 s.
    for family, le in [("envoy_gpuroute_pool_ttft_ms_bucket", "1300"), ("envoy_gpuroute_decision_us_bucket", "13")]:
        assert prom.query(f'count({family}{{le="{le}"}})'), (family, le)
    # The held requests' waits by pool (one histogram for every pool before 2026-12-07), the
    # name as it was, with the shipped buckets: every pool's, defined with the configuration.
    waits = {s["metric"].get("gpuroute_pool") for s in prom.query('envoy_gpuroute_hold_ms_bucket{le="13"}')}
    assert waits == {p["name"] for p in CONFIG["pools"]}, waits
    # Passive health's counters too, at 0 until they count (proxy-wasm defined them at their
    # first count before 2026-12-07, so a pool's first ejection gave `increase()` nothing).
    for family in ("envoy_gpuroute_pool_ejections", "envoy_gpuroute_pool_unanswered"):
        pools = {s["metric"].get("gpuroute_pool") for s in prom.query(family)}
        assert pools == {p["name"] for p in CONFIG["pools"]}, (family, pools)

    # Every recording rule has a value, every rule evaluates without error.
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(re.findall(r"^\s+- (?:record|alert):", rules_text(), re.M))
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    for r in rules:
        if r["type"] == "recording":
            assert prom.query(r["name"]), f"recording rule {r['name']} has no data"

    # The alerts this scenario brings about, with their labels; no other.
    expected = dict(EXPECTED_ALERTS, **{PUSHES_FAILING: {"url": nowhere}})
    active = prom.active_alerts()
    for name, labels in expected.items():
        matching = [a for a in active if a["labels"]["alertname"] == name
                    and all(a["labels"].get(k) == v for k, v in labels.items())]
        assert matching, f"{name} {labels} not active; active: {[a['labels'] for a in active]}"
    others = sorted({a["labels"]["alertname"] for a in active} - set(expected))
    assert others == [], [a["labels"] for a in active if a["labels"]["alertname"] in others]

    # The aggregator stops: the snapshot ages past 5 s, and GpurouteSnapshotStale comes up.
    sc.stop()
    wait_for(lambda: any(a["labels"]["alertname"] == "GpurouteSnapshotStale" for a in prom.active_alerts()),
             timeout=20, what="GpurouteSnapshotStale pending", every=0.5)
    print(f"runtime {RUNTIME}: {len(list(dashboard_queries()))} dashboard queries, {len(rules)} rules checked")
