#!/usr/bin/env python3
"""What the filter costs inside Envoy: median latency and requests/s for 4 KB chat bodies,
with and without the filter, same upstream, same run.

Setup (all on 127.0.0.1):
  upstream  a separate Envoy (1 worker) answering on 8 ports with a fixed small JSON body
            (direct_response), so the upstream costs next to nothing and the same for both. It
            reads the whole request body before answering (buffer filter), as a model server
            does: an upstream that answers before the body is in makes the gateway close the
            connection, and every request then pays a TCP connect at the gateway (that inflated
            plain Envoy's cost per request 2.5x in an earlier version of this script; the report
            now checks that upstream connections are reused);
  gateway   Envoy 1.40 with 1 worker: plain Envoy (round robin over the 8 upstream ports),
            Envoy + the gpuroute proxy-wasm filter ("filter": override_host over the same 8
            ports, a snapshot of the 8 pods re-pushed every 100 ms as sidecar-metrics would), or
            Envoy + the same filter built as a dynamic module ("module": libgpuroute.so, same
            configuration, same pushes);
  client    target/release/httpload: closed loop, keep-alive, the same 4 KB chat body.
  reference Envoy round robin with its own C++ `buffer` filter in front: the same pause of the
            headers until the whole body is in, done natively (what the filter's pause-and-buffer
            would cost without a VM).
  floor     the proxy-wasm floor (bench/wasm-floor): the least any proxy-wasm filter that routes
            on the body and sets the destination does per request (read the headers, pause,
            copy the body into the VM, find the model, add the pool, model and destination
            headers; destination round robin, no decision). What no work on the filter's own code
            can remove.
Latency is measured with 1 connection (no queueing), throughput with 16. The gateways are
measured interleaved: one httpload run loads them in turn, ~250 ms each (shortened so that every
gateway's turns make whole periods of the order: 18 of 222 ms for six), the order changing every
cycle (a balanced Latin square: every gateway in every position and after every other alike, never
two turns in a row), until each has had its seconds (see bench/src/interleave.rs: measured 4 s apiece, the host's
slow spells of a second or more land on one gateway and not the next; in quarter-second turns they
land on all alike). Several rounds; the report gives the median of the rounds, the median and range
of the per-round requests/s ratio (ours / plain), and the gateway Envoy's CPU time per request
(all its threads, from /proc, counted over its own turns: what the ratio would be if the gateway
had a core to itself). The verdicts come from the turns paired within each cycle (scripts/paired.py):
per cycle, a gateway's median latency minus plain's and its requests/s over plain's, whose median
over every cycle of every round is given with a distribution-free 95% interval; a figure is "met"
or "missed" only when its whole interval is on one side of the target, else "undecided". A second
interval takes whole rounds as the independent units (a block bootstrap over rounds), which what
the cycles of one round share widens; its verdict is shown where it differs.

Every run also measures a byte-identical copy of the filter's .wasm ("copy") as a sixth gateway:
the filter against its copy is the method's own A/A check (two identical builds must read ~100% of
each other; the report warns when the paired interval leaves 100% out), and the two pooled per
cycle give the build's figures with half the turn-to-turn noise ("filter_pooled" in the JSON).
--no-copy leaves the copy out.

Usage: scripts/envoy_overhead.py [--rounds 9] [--seconds 4] [--no-copy] [--compare-wasm NAME=PATH ...]
                                 [--compare-config NAME=JSON ...] [--ask NAME ...]
  --compare-wasm adds another build of the proxy-wasm filter (same configuration, same pushes)
  to the interleaved rounds, e.g. the build before a change: builds compared within one run agree
  far better than runs of different days on this shared machine. To build an earlier revision:
    scripts/build-base-wasm.sh REV /tmp/prev
    scripts/envoy_overhead.py --compare-wasm prev=/tmp/prev/REV/gpuroute_filter.wasm
  --compare-config NAME=JSON adds the filter's own .wasm with its configuration changed by JSON
  (keys of the plugin configuration, e.g. '{"tick_ms": 1000}'), measured like a --compare-wasm
  build: what one option costs, in the same rounds as the filter as shipped.
  --ask NAME asks that gateway for its prefix records every 50 ms, as sidecar-metrics' relay
  between gateway replicas does (`GET ingest.prefix_path`, the cursor carried on): with
  `--compare-wasm relayed=<the filter's .wasm> --ask relayed`, the relay's cost on the gateway
  is `relayed` against the filter (and its copy), same build.
Writes target/bench/envoy-overhead.json.
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from harness import BUILDS, ENVOY, FLOOR_WASM, TOKEN, Envoy, Pusher, free_port, scratch, work_dir  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts"))
import paired  # noqa: E402

HTTPLOAD = ROOT / "target" / "release" / "httpload"
PODS = 8
CONFIG = {"pools": [{"name": "llama", "models": ["llama-3-8b"]}]}


def chat_body():
    system = ("You are a meticulous assistant for a logistics company. Answer with numbered steps, cite the "
              "policy section you rely on, and never invent tracking numbers. ") * 3
    messages = [{"role": "system", "content": system}]
    turn = 0
    while len(json.dumps(messages)) < 3900:
        messages.append({"role": "user", "content": f"Turn {turn}: the shipment left the Rotterdam hub on Tuesday and has not been scanned since; what next?"})
        messages.append({"role": "assistant", "content": "Check the manifest for the last handoff scan, open a trace with the line-haul partner, notify the customer."})
        turn += 1
    messages.append({"role": "user", "content": "And if the hub says it was never received?"})
    return json.dumps({"model": "llama-3-8b", "stream": False, "max_tokens": 64, "messages": messages}).encode()


class Upstream:
    def __init__(self):
        self.ports = [free_port() for _ in range(PODS)]
        body = json.dumps({"id": "cmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})
        listeners = []
        for p in self.ports:
            listeners.append({
                "name": f"pod{p}",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "pod",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                            {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": body}}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.buffer", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 1048576}},
                                         {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    }}]}],
            })
        cfg = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
               "static_resources": {"listeners": listeners}}
        self.dir = work_dir("gpuroute-upstream-")
        path = self.dir / "upstream.json"
        path.write_text(json.dumps(cfg))
        self.proc = subprocess.Popen([str(ENVOY), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)

    def addresses(self):
        return [f"127.0.0.1:{p}" for p in self.ports]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def native_buffer(config):
    """Puts Envoy's native `buffer` filter before the router of a rendered round-robin gateway."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if any("wasm" in f["name"] for f in hcm["http_filters"]):
        raise RuntimeError("the reference gateway must not run the wasm filter")
    hcm["http_filters"].insert(0, {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 1048576}})


def upstream_connections_per_request(gw):
    """Upstream connections the gateway opened per request sent upstream."""
    s = gw.stats("^cluster.pool_llama.upstream_(cx|rq)_total$")
    return s.get("cluster.pool_llama.upstream_cx_total", 0) / max(1, s.get("cluster.pool_llama.upstream_rq_total", 0))


WARMUP = 200  # requests per connection before httpload starts measuring (its default)
SLOT_MS = 250  # one gateway's turn in the interleaved runs (httpload --slot-ms)


def load(gateways, body_file, connections, seconds, cpu=False):
    """Runs httpload on every gateway of `gateways` ((name, Envoy) pairs) at once, interleaved
    in SLOT_MS slots until each has been measured for `seconds`; returns {name: its result}.
    With `cpu`, each result has the gateway process's CPU microseconds per request, counted
    over its own slots."""
    cmd = [str(HTTPLOAD), "--body-file", str(body_file), "--connections", str(connections),
           "--duration-s", str(seconds), "--slot-ms", str(SLOT_MS), "--warmup", str(WARMUP)]
    for _, gw in gateways:
        cmd += ["--addr", gw.listen, *(["--pid", str(gw.proc.pid)] if cpu else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    results = {}
    report = json.loads(out.stdout)
    for (name, gw), res in zip(gateways, report["targets"]):
        if res["errors"] or not res["requests"]:
            # A gateway answering errors (a 404 from a route it failed to steer, say) would be
            # measured as fast and cheap: refuse to report it.
            raise RuntimeError(f"gateway {name} ({gw.listen}): {res['errors']} failed requests, "
                               f"{res['requests']} answered 200")
        results[name] = dict(res, slot_ms=report["slot_ms"])
    return results


# Gateways that route without the filter: they take no snapshot.
# The floor built with its `callbacks` feature (`make wasm`): also the three callbacks the filter
# needs beyond the floor, exported empty (`--floor-callbacks`).
FLOOR_CALLBACKS_WASM = FLOOR_WASM.parents[2] / "wasm-floor-callbacks" / "wasm32-wasip1" / "wasm-release" / FLOOR_WASM.name
REFERENCES = ("plain", "native_buffer", "wasm_floor", "floor_callbacks")
GATEWAYS = (*REFERENCES, "filter", "module")


def gateway_specs(up, config, extra, floor_callbacks=False, configs=None):
    """Each gateway of the comparison as `Envoy(**spec)` arguments, in report order: plain,
    native_buffer, wasm_floor (and floor_callbacks), filter, module, then the `--compare-wasm`
    builds (`extra`). `config` is the configuration of the filter builds, with `configs[name]`'s
    keys changed for an extra build that has them; the references get `CONFIG`."""
    configs = configs or {}
    pools = [{"name": "llama", "endpoints": up.addresses()}]
    ours = dict(mode="filter", pools=pools, filter_config=config)
    floor = dict(mode="filter", pools=pools, filter_config=dict(CONFIG, floor_endpoints=up.addresses()), runtime="wasm")
    return {
        "plain": dict(mode="round_robin", pools=pools, filter_config=CONFIG),
        "native_buffer": dict(mode="round_robin", pools=pools, filter_config=CONFIG, patch=native_buffer),
        "wasm_floor": dict(floor, wasm=FLOOR_WASM),
        **({"floor_callbacks": dict(floor, wasm=FLOOR_CALLBACKS_WASM)} if floor_callbacks else {}),
        "filter": dict(ours, runtime="wasm"),
        "module": dict(ours, runtime="dynamic"),
        **{name: dict(ours, runtime="wasm", wasm=path, filter_config=dict(config, **configs.get(name, {})))
           for name, path in extra.items()},
    }


def compare_configs(specs, taken):
    """The `--compare-config NAME=JSON` arguments as {name: configuration changes}; exits on a
    malformed one or a name in `taken`."""
    configs = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            changes = json.loads(text) if sep and name else None
        except json.JSONDecodeError:
            changes = None
        if not isinstance(changes, dict):
            sys.exit(f"--compare-config {spec!r}: want NAME=JSON, the JSON an object of configuration keys")
        if name in taken or name in configs:
            sys.exit(f"--compare-config: the name {name!r} is taken")
        configs[name] = changes
    return configs


def pod_snapshot(up):
    """The snapshot the filter builds get: the 8 upstream ports as equally loaded pods."""
    return {"llama": [{"address": a, "running": 4, "kv_cache_usage": 0.3} for a in up.addresses()]}


def compare_builds(specs, taken=()):
    """The `--compare-wasm NAME=PATH` arguments as {name: path}; exits on a malformed one, a
    missing file or a name already taken (a gateway's, or one in `taken`)."""
    extra = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            sys.exit(f"--compare-wasm {spec!r}: want NAME=PATH of a .wasm file")
        if name in extra or name in GATEWAYS or name in taken:
            sys.exit(f"--compare-wasm: the name {name!r} is taken")
        extra[name] = Path(path).resolve()
    return extra


def round_ratios(rows, a, b):
    """Requests/s of gateway `a` over gateway `b`, round by round (measured seconds apart, so a
    slow spell of the shared machine hits both)."""
    return [x["rps"] / y["rps"] for x, y in zip(rows[a]["rps"], rows[b]["rps"])]


def host_info():
    """The host's CPU (/proc/cpuinfo "model name") and core count: the ratios move with the host,
    not only the times (2026-11-30: plain Envoy 53-55 us of CPU per request, the floor at 74-80% of
    its requests/s; 2026-12-01 on an "AMD EPYC": 33-34 us and 85-87%), so every report names it. A
    virtual machine's model name is coarse, and a shared host runs the same model at different
    speeds (a third run that day on a machine reporting the same name: 75 us and 81%): plain
    Envoy's CPU per request, reported beside it, says how fast the run was."""
    model = "unknown"
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu_model": model, "cores": os.cpu_count()}


LATENCY_LIMIT_US = 100  # the figures: the filter adds <= 100 us to median latency ...
RPS_FLOOR = 0.75  # ... and Envoy keeps >= 75% of its requests/s


def paired_figures(rows, name, base, judge=True):
    """`name` against `base`, turn by turn (scripts/paired.py): added median latency (the
    latency runs), requests/s and CPU-per-request ratios (the throughput runs), each its median
    over all cycles, a 95% interval and, with `judge`, the verdict against the issue's figure.
    `name` may be a tuple of gateways that run one build (the filter and its A/A copy): their
    turns are pooled cycle by cycle."""
    names = name if isinstance(name, tuple) else (name,)
    mine = {k: paired.pooled(*(rows[n][k] for n in names)) for k in ("lat", "rps")}
    lat, thr = (mine["lat"], rows[base]["lat"]), (mine["rps"], rows[base]["rps"])
    latency, rps = (LATENCY_LIMIT_US, RPS_FLOOR) if judge else (None, None)
    return {"added_p50_us": paired.summary(paired.latency_differences(*lat), latency, False),
            "rps_ratio": paired.summary(paired.rps_ratios(*thr), rps),
            "cpu_ratio": paired.summary(paired.cpu_ratios(*thr), rps)}


def pct(x):
    return f"{100 * x:.1f}%"


def ci_text(e, fmt):
    """'median (95% interval low to high; over rounds low to high)' of a paired_figures entry;
    fmt: a format string or function."""
    f = fmt if callable(fmt) else fmt.format
    return (f"{f(e['median'])} (95% interval {f(e['low'])} to {f(e['high'])}; "
            f"over rounds {f(e['rounds_low'])} to {f(e['rounds_high'])})")


def verdicts(e):
    """The verdict by the pairs' interval, and by the rounds' when it differs."""
    v, rv = e["verdict"], e["rounds_verdict"]
    return v if v == rv else f"{v} (over rounds: {rv})"


def print_paired(pp):
    print(f"    paired per turn ({pp['added_p50_us']['pairs']} cycles, {pp['added_p50_us']['rounds']} rounds): "
          f"added median latency {ci_text(pp['added_p50_us'], '{:+.0f} us')} -> {verdicts(pp['added_p50_us'])}; "
          f"requests/s {ci_text(pp['rps_ratio'], pct)} of plain -> {verdicts(pp['rps_ratio'])}; "
          f"by CPU {ci_text(pp['cpu_ratio'], pct)} -> {verdicts(pp['cpu_ratio'])}")


class Asker:
    """Asks a gateway for its prefix records every `interval_s` on one keep-alive connection,
    carrying the cursor on, as sidecar-metrics' relay does; counts the records."""

    def __init__(self, gw, interval_s=0.05):
        import threading

        self.gw, self.interval_s, self.records, self.asks = gw, interval_s, 0, 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        import http.client

        host, port = self.gw.ingest.rsplit(":", 1)
        conn, cursor = None, ""
        while not self.stop_event.wait(self.interval_s):
            try:
                conn = conn or http.client.HTTPConnection(host, int(port), timeout=5)
                conn.request("GET", "/gpuroute/v1/prefix",
                             headers={"authorization": f"Bearer {TOKEN}", "x-gpuroute-cursor": cursor})
                r = conn.getresponse()
                body = r.read()
                if r.status == 200:
                    cursor = r.getheader("x-gpuroute-cursor", cursor)
                    self.records += count_records(body)
                    self.asks += 1
            except OSError:
                conn = None

    def stop(self):
        self.stop_event.set()
        self.thread.join(5)


def count_records(body):
    """Records in a GPX1 body (each: seq u64, pod u64, n u8, n anchors u64)."""
    i, n = 4, 0
    while i + 17 <= len(body):
        i += 17 + 8 * body[i + 16]
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--compare-wasm", action="append", default=[], metavar="NAME=PATH",
                    help="another build of the proxy-wasm filter to measure in the same rounds (repeatable)")
    ap.add_argument("--compare-config", action="append", default=[], metavar="NAME=JSON",
                    help="the filter's .wasm with these configuration keys changed, measured in the same rounds (repeatable)")
    ap.add_argument("--ask", action="append", default=[], metavar="NAME",
                    help="ask this gateway for its prefix records every 50 ms, as the relay between replicas does")
    ap.add_argument("--floor-callbacks", action="store_true",
                    help="also measure the floor with the three callbacks the filter needs beyond it, exported empty")
    ap.add_argument("--no-copy", action="store_true",
                    help="leave out the byte-identical copy of the filter (the method's A/A check)")
    args = ap.parse_args()
    if not HTTPLOAD.exists() or not FLOOR_WASM.exists() or (args.floor_callbacks and not FLOOR_CALLBACKS_WASM.exists()):
        sys.exit("build first: make build")
    extra = compare_builds(args.compare_wasm)
    work = scratch("gpuroute-overhead-")
    aa = None if args.no_copy else "copy"  # the A/A copy's name among the extra builds
    if aa:
        if aa in extra:
            sys.exit(f"--compare-wasm: the name {aa!r} is the A/A copy's (or pass --no-copy)")
        copy = work / "gpuroute_filter_copy.wasm"
        shutil.copyfile(BUILDS["filter"][2], copy)
        extra = {aa: copy, **extra}
    configs = compare_configs(args.compare_config, {*extra, *GATEWAYS})
    extra.update({name: BUILDS["filter"][2] for name in configs})
    body_file = work / "chat.json"
    body_file.write_bytes(chat_body())
    up = Upstream()
    gateways = tuple((name, Envoy(**spec)) for name, spec in gateway_specs(up, CONFIG, extra, args.floor_callbacks, configs).items())
    pusher = Pusher([gw for name, gw in gateways if name not in REFERENCES], pod_snapshot(up))
    unknown = set(args.ask) - set(extra)
    if unknown:
        sys.exit(f"--ask {', '.join(sorted(unknown))}: not among the --compare-wasm builds")
    askers = {name: Asker(gw) for name, gw in gateways if name in args.ask}
    ours = {name: (prefix, path) for name, (_, prefix, path) in BUILDS.items()}
    ours.update({name: (ours["filter"][0], path) for name, path in extra.items()})
    rows = {name: {"lat": [], "rps": []} for name, _ in gateways}
    try:
        for r in range(args.rounds):
            order = gateways if r % 2 == 0 else gateways[::-1]
            for name, res in load(order, body_file, 1, args.seconds).items():
                rows[name]["lat"].append(res)
            for name, res in load(order[::-1], body_file, 16, args.seconds, cpu=True).items():
                rows[name]["rps"].append(res)
            print(f"round {r + 1}: " + ", ".join(f"{name} p50 {rows[name]['lat'][-1]['latency_us']['p50']} us, "
                                                 f"{rows[name]['rps'][-1]['rps']:.0f} req/s" for name, _ in gateways), flush=True)
        outcomes = {
            name: {o: gw.stat(f"{ours[name][0]}gpuroute.pool.llama.requests.{o}") for o in ("picked", "fail_open")}
            for name, gw in gateways if name in ours
        }
        # Upstream connections opened per request: ~0 when keep-alive works (16 clients reuse a
        # handful of connections); 1 would mean a TCP connect per request on the measured path.
        conns = {name: upstream_connections_per_request(gw) for name, gw in gateways}
    finally:
        pusher.stop()
        for a in askers.values():
            a.stop()
        for _, gw in gateways:
            gw.stop()
        up.stop()
    asked = {name: {"asks": a.asks, "records": a.records} for name, a in askers.items()}
    for name, a in asked.items():
        print(f"{name}: asked {a['asks']} times for its prefix records, {a['records']} records received")

    def med(name, key, q):
        return statistics.median(x["latency_us"][q] if key == "lat" else x["rps"] for x in rows[name][key])

    res = {
        "setup": {"body_bytes": len(body_file.read_bytes()), "pods": PODS, "gateway_workers": 1, "rounds": args.rounds,
                  "seconds_per_run": args.seconds, "slot_ms": rows["plain"]["lat"][0]["slot_ms"], "interleaved": True,
                  "turn_order": "rows of a Williams design (balanced Latin square), whole periods", "aa_copy": aa is not None, "latency_connections": 1, "throughput_connections": 16,
                  "machine": "the cores shared by client, gateway Envoy and upstream Envoy", **host_info()},
        "builds": {name: {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                   for name, path in [*((n, p) for n, (_, p) in ours.items()), ("wasm_floor", FLOOR_WASM),
                                      *([("floor_callbacks", FLOOR_CALLBACKS_WASM)] if args.floor_callbacks else [])]},
        "configs": configs,
        "outcomes": outcomes, "upstream_connections_per_request": conns, "asked": asked, "raw": rows,
    }
    for name, _ in gateways:
        res[name] = {"p50_us": med(name, "lat", "p50"), "p99_us": med(name, "lat", "p99"), "rps": med(name, "rps", None),
                     "cpu_us_per_request": statistics.median(x["cpu_us_per_request"] for x in rows[name]["rps"])}
        if name == "plain":
            continue
        ratios = round_ratios(rows, name, "plain")
        res[name]["added_p50_us"] = res[name]["p50_us"] - res["plain"]["p50_us"]
        res[name]["rps_ratio"] = res[name]["rps"] / res["plain"]["rps"]
        res[name]["rps_ratio_per_round"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        res[name]["paired"] = paired_figures(rows, name, "plain")
    for name in extra:
        # two builds of one filter: the spread, not a verdict against the figures
        res[name]["paired_with_filter"] = paired_figures(rows, "filter", name, judge=False)
    if aa:
        res["filter_pooled"] = {"gateways": ["filter", aa], "paired": paired_figures(rows, ("filter", aa), "plain")}
    out = ROOT / "target" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "envoy-overhead.json").write_text(json.dumps(res, indent=1))
    p, setup = res["plain"], res["setup"]
    print(f"\n4 KB chat body, {args.rounds} rounds x {args.seconds:g} s, {setup['cores']} cores ({setup['cpu_model']}), medians "
          f"(plain Envoy: median latency {p['p50_us']} us, p99 {p['p99_us']} us, {p['rps']:.0f} req/s, "
          f"CPU {p['cpu_us_per_request']:.1f} us per request):")
    labels = {"filter": "proxy-wasm filter", "module": "dynamic module", "native_buffer": "reference: Envoy's native buffer filter",
              "wasm_floor": "reference: the proxy-wasm floor (bench/wasm-floor: pause, body into the VM, three headers, no decision)",
              "floor_callbacks": "reference: the floor with the filter's three other callbacks exported empty "
                                 "(response headers, response body, context deleted)",
              **{name: f"proxy-wasm filter, build '{name}' ({path})" for name, path in extra.items()},
              **{name: f"proxy-wasm filter, configuration '{name}' ({json.dumps(c)})" for name, c in configs.items()}}
    if aa:
        labels[aa] = "proxy-wasm filter, a byte-identical copy (the method's A/A check)"
    floors = ("wasm_floor", "floor_callbacks") if args.floor_callbacks else ("wasm_floor",)
    for name in ("filter", *extra, "module", *floors, "native_buffer"):
        g = res[name]
        pr = g["rps_ratio_per_round"]
        print(f"  {labels[name]}:")
        print(f"    median latency {g['p50_us']} us -> +{g['added_p50_us']} us (target <= 100); p99 {g['p99_us']} us")
        print(f"    requests/s {g['rps']:.0f} -> {100 * g['rps_ratio']:.1f}% of plain (target >= 75%); "
              f"per-round ratio median {100 * pr['median']:.1f}%, range {100 * pr['min']:.1f}-{100 * pr['max']:.1f}%")
        print(f"    gateway CPU per request {g['cpu_us_per_request']:.1f} us")
        pp = g["paired"]
        print_paired(pp)
    if aa:
        print("  proxy-wasm filter and its A/A copy pooled (one build, two gateways; per cycle their turns averaged):")
        print_paired(res["filter_pooled"]["paired"])
    for name, (_, path) in ours.items():
        o = outcomes[name]
        print(f"  {labels[name]} outcomes: picked {o['picked']}, fail-open {o['fail_open']} "
              f"({path.name} sha256 {res['builds'][name]['sha256'][:12]})")
        if not o["picked"]:
            print(f"  WARNING: the {labels[name]} counted no picks: is the build the one committed?")
        if o["fail_open"]:
            print(f"  WARNING: the {labels[name]} failed open on some requests; its cost is understated for those")
    for name in extra:
        ratios = round_ratios(rows, "filter", name)
        print(f"  proxy-wasm filter vs build '{name}': requests/s ratio per round median "
              f"{100 * statistics.median(ratios):.1f}% (range {100 * min(ratios):.1f}-{100 * max(ratios):.1f}%), "
              f"CPU per request {res['filter']['cpu_us_per_request']:.1f} vs {res[name]['cpu_us_per_request']:.1f} us, "
              f"median latency {res['filter']['p50_us']} vs {res[name]['p50_us']} us")
        pp = res[name]["paired_with_filter"]
        print(f"    paired per turn: the filter's median latency minus the build's {ci_text(pp['added_p50_us'], '{:+.0f} us')}, "
              f"requests/s {ci_text(pp['rps_ratio'], pct)} of the build's, by CPU {ci_text(pp['cpu_ratio'], pct)}")
        if name == aa:
            off = [k for k in ("rps_ratio", "cpu_ratio") if not pp[k]["low"] <= 1 <= pp[k]["high"]]
            off += ["added_p50_us"] if not pp["added_p50_us"]["low"] <= 0 <= pp["added_p50_us"]["high"] else []
            if off:
                print(f"  WARNING: the filter and its byte-identical copy differ in {', '.join(off)} beyond the "
                      "95% interval: chance (with three intervals, about one fair run in seven) or a bias of this "
                      "run's turns; read its verdicts with that margin")
    print("  upstream connections opened per request: " + ", ".join(f"{k} {v:.4f}" for k, v in conns.items()))
    if max(conns.values()) > 0.01:
        print("  WARNING: upstream connections are not being reused; the figures include a TCP connect per request")


if __name__ == "__main__":
    main()
