#!/usr/bin/env python3
"""Start a whole gpuroute stack on 127.0.0.1: a simulated GPU fleet (fleet-sim),
sidecar-metrics scraping it and pushing snapshots, and Envoy with the filter (or a baseline
load balancer).

  stack.py run                                   the demo (make run): fixed ports, waits for Ctrl-C
  stack.py run --any-ports                       the same on OS-chosen ports (tests)
  stack.py stack --router filter --scenario mixed-gpu
                                                 one benchmark scenario's fleet behind one router,
                                                 left running for any other load tool (make stack)

As a library (the benchmark uses it): Stack(fleet=..., router=...).start() / .stop().
Routers: filter (override_host + our filter), filter_original_dst, round_robin, least_request.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from harness import Envoy, free_port, wait_for, work_dir  # noqa: E402

FLEET_SIM = ROOT / "target" / "release" / "fleet-sim"
SIDECAR = ROOT / "target" / "release" / "sidecar-metrics"
TOKEN = os.environ.get("GPUROUTE_INGEST_TOKEN", "dev-token-change-me")


def http_ok(url):
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return 200 <= r.status < 300
    except Exception:
        return False


def filter_pools(pools, settings):
    """The filter's `pools` for the fleet's `pools` (name, models, adapters), each with a
    scenario's `settings` of it over them; settings for a pool the fleet does not have are an
    error, not dropped."""
    unknown = sorted(set(settings) - {p["name"] for p in pools})
    if unknown:
        raise SystemExit(f"settings for pools the fleet does not have: {', '.join(unknown)}")
    return [{"name": p["name"], "models": p["models"], "adapters": p["adapters"], **settings.get(p["name"], {})}
            for p in pools]


class Stack:
    def __init__(self, fleet=None, preset=None, router="filter", listen=None, admin=None, ingest=None,
                 sidecar_listen=None, concurrency=1, interval_ms=100, filter_overrides=None, workdir=None,
                 time_scale=None, quiet=True, access_log=None, fleet_args=(), wasm=None, replicas=1,
                 pool_settings=None):
        """`access_log`: a file for Envoy's access log of the OpenAI listener (envoy/render.py's
        `access_log`), written every second; none by default (the benchmarks run without).
        `replicas`: gateway replicas, each an Envoy with (for the filter) its own sidecar-metrics,
        the sidecars each other's peers as the shipped manifests run them; `targets()` lists
        their OpenAI listeners. The first is `envoy` / `listen`. `pool_settings`: a scenario's
        `pools`, each pool's keys in the filter's configuration over what the fleet gives it
        (`failover`, `overflow`, `scoring`; `"models": []` for a standby pool)."""
        self.access_log = access_log
        self.fleet_args = list(fleet_args)
        # The .wasm the filter gateway loads (None: this tree's build); benchmarks compare builds.
        self.wasm = wasm
        self.fleet = fleet
        self.preset = preset
        self.router = router
        self.listen, self.admin, self.ingest = listen, admin, ingest
        self.sidecar_listen = sidecar_listen or f"127.0.0.1:{free_port()}"
        self.concurrency = concurrency
        self.interval_ms = interval_ms
        self.filter_overrides = filter_overrides or {}
        self.pool_settings = pool_settings or {}
        self.dir = Path(workdir) if workdir else work_dir("gpuroute-stack-")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.time_scale = time_scale
        self.quiet = quiet
        self.procs = []
        self.envoy = None
        self.envoys = []
        self.replicas = max(1, replicas)
        self.pods = []

    # --- processes ------------------------------------------------------------------------

    def _spawn(self, args, log_name):
        log = open(self.dir / log_name, "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self):
        for b in (FLEET_SIM, SIDECAR):
            if not b.exists():
                raise SystemExit(f"{b} is missing: run `make build` first")
        ports_file = self.dir / "fleet-ports.json"
        # A ports file left by an earlier run in the same directory would be read as this one's.
        ports_file.unlink(missing_ok=True)
        args = [str(FLEET_SIM), "--ports-file", str(ports_file)]
        if self.preset:
            args += ["--preset", self.preset]
        else:
            fleet_file = self.dir / "fleet.json"
            fleet_file.write_text(json.dumps(self.fleet))
            args += ["--fleet", str(fleet_file), "--admin", "127.0.0.1:0"]
        if self.time_scale:
            args += ["--time-scale", str(self.time_scale)]
        args += self.fleet_args
        fleet_proc = self._spawn(args, "fleet-sim.log")
        wait_for(lambda: ports_file.exists() or fleet_proc.poll() is not None, 30, "fleet-sim")
        if fleet_proc.poll() is not None:
            raise RuntimeError("fleet-sim exited: " + (self.dir / "fleet-sim.log").read_text()[-2000:])
        ports = json.loads(ports_file.read_text())
        self.pods = ports["pods"]
        self.fleet_admin = ports.get("admin")

        pools = {}
        for p in self.pods:
            pool = pools.setdefault(p["pool"], {"name": p["pool"], "models": [], "adapters": [], "endpoints": [], "pods": []})
            if p["model"] not in pool["models"]:
                pool["models"].append(p["model"])
            for a in p.get("adapters", []):
                if a not in pool["adapters"]:
                    pool["adapters"].append(a)
            pool["endpoints"].append(p["address"])
            pool["pods"].append({"address": p["address"], "metrics_url": p["metrics_url"], "engine": p.get("engine", "vllm")})
        self.pools = list(pools.values())
        filter_config = {
            "pools": filter_pools(self.pools, self.pool_settings),
            "ingest": {"token": TOKEN},
        }
        filter_config.update(self.filter_overrides)
        logging = {}
        if self.access_log:
            logging = {"extra": {"access_log": str(self.access_log)},
                       "envoy_args": ("--file-flush-interval-msec", "1000")}
        for r in range(self.replicas):
            first = r == 0
            self.envoys.append(Envoy(
                self.router, [{"name": p["name"], "endpoints": p["endpoints"]} for p in self.pools],
                filter_config, concurrency=self.concurrency, listen=self.listen if first else None,
                admin=self.admin if first else None, ingest=self.ingest if first else None,
                workdir=self.dir / ("envoy" if first else f"envoy-{r}"), wasm=self.wasm, **logging))
        self.envoy = self.envoys[0]
        self.listen, self.admin, self.ingest = self.envoy.listen, self.envoy.admin, self.envoy.ingest

        if self.router.startswith("filter"):
            listens = [self.sidecar_listen] + [f"127.0.0.1:{free_port()}" for _ in self.envoys[1:]]
            peer_ports = [free_port() for _ in self.envoys]
            for r, envoy in enumerate(self.envoys):
                sidecar_cfg = {
                    "interval_ms": self.interval_ms,
                    "listen": listens[r],
                    "push": {"urls": [f"http://{envoy.ingest}/gpuroute/v1/snapshot"], "token": TOKEN},
                    "pools": [{"name": p["name"], "pods": p["pods"]} for p in self.pools],
                }
                if self.replicas > 1:
                    # Each replica by its own name (they share a host, so $HOSTNAME would not do).
                    sidecar_cfg["source"] = f"gateway-{r}"
                    sidecar_cfg["prefix"] = {
                        "listen": f"127.0.0.1:{peer_ports[r]}",
                        "peers": [f"http://127.0.0.1:{port}" for i, port in enumerate(peer_ports) if i != r],
                    }
                suffix = "" if r == 0 else f"-{r}"
                cfg_file = self.dir / f"sidecar{suffix}.json"
                cfg_file.write_text(json.dumps(sidecar_cfg, indent=1))
                log = f"sidecar-metrics{suffix}.log"
                sc = self._spawn([str(SIDECAR), "run", "--config", str(cfg_file)], log)
                wait_for(lambda: http_ok(f"http://{listens[r]}/readyz") or sc.poll() is not None, 30,
                         "sidecar-metrics to push its first snapshot")
                if sc.poll() is not None:
                    raise RuntimeError("sidecar-metrics exited: " + (self.dir / log).read_text()[-2000:])

    def targets(self):
        """The OpenAI base URLs of the gateway replicas, comma-separated (loadgen's --target)."""
        return ",".join(f"http://{e.listen}" for e in self.envoys)

    def stop(self):
        for e in self.envoys:
            e.stop()
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs = []

    def describe(self):
        lines = [f"  OpenAI API     http://{self.listen}   (router: {self.router})",
                 f"  Envoy admin    http://{self.admin}/stats?filter=gpuroute"]
        if self.router.startswith("filter"):
            lines.append(f"  sidecar        http://{self.sidecar_listen}/   (status page; /debug/snapshot, /metrics)")
        if self.fleet_admin:
            lines.append(f"  fleet admin    http://{self.fleet_admin}/pods")
        for p in self.pools:
            lines.append(f"  pool {p['name']}: models {', '.join(p['models'])}"
                         + (f"; adapters {', '.join(p['adapters'])}" if p["adapters"] else "")
                         + f"; {len(p['endpoints'])} pods"
                         + (f"; {json.dumps(self.pool_settings[p['name']])}" if p["name"] in self.pool_settings else ""))
        lines.append(f"  logs           {self.dir}")
        if self.access_log:
            lines.append(f"  access log     {self.access_log}   (a JSON line per request: pool, pods chosen, pod that served)")
        return "\n".join(lines)


def wait_forever(stack):
    stop = {"now": False}

    def handler(*_):
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        while not stop["now"]:
            if any(p.poll() is not None for p in stack.procs) or not stack.envoy.alive():
                print("a component exited; see the logs in", stack.dir)
                break
            time.sleep(0.5)
    finally:
        print("\nstopping ...")
        stack.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rn = sub.add_parser("run", help="the demo stack on 127.0.0.1:8080")
    rn.add_argument("--any-ports", action="store_true",
                    help="every listener on an OS-chosen port, the logs in a temporary directory (a test "
                         "runs the demo this way beside other servers; the printed commands name the ports)")
    st = sub.add_parser("stack", help="a benchmark scenario's stack, left running")
    st.add_argument("--router", default="filter", choices=["filter", "filter_original_dst", "round_robin", "least_request"])
    st.add_argument("--scenario", default="mixed-gpu")
    st.add_argument("--listen", default="127.0.0.1:8080")
    st.add_argument("--concurrency", type=int, default=1)
    args = ap.parse_args()

    if args.cmd == "run":
        # A weighted split over the demo fleet's two models (fleet-sim's `demo` preset), as a
        # canary rollout of a new model would be: the public name `assistant`, 80 / 20.
        split = {"assistant": [{"model": "meta-llama/Llama-3.1-8B-Instruct", "weight": 80},
                               {"model": "Qwen/Qwen2.5-7B-Instruct", "weight": 20}]}
        if args.any_ports:
            ports = {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}",
                     "ingest": f"127.0.0.1:{free_port()}", "sidecar_listen": f"127.0.0.1:{free_port()}"}
            workdir = work_dir("gpuroute-run-")
        else:
            ports = {"listen": "127.0.0.1:8080", "admin": "127.0.0.1:9901", "ingest": "127.0.0.1:9002",
                     "sidecar_listen": "127.0.0.1:9100"}
            workdir = ROOT / "target" / "run"
        stack = Stack(preset="demo", router="filter", concurrency=2, **ports,
                      filter_overrides={"debug_header": True, "splits": split}, workdir=workdir,
                      access_log=workdir / "access.log",
                      fleet_args=["--any-ports"] if args.any_ports else []).start()
        model = stack.pools[0]["models"][0]
        print("\ngpuroute is up: Envoy + filter + sidecar-metrics + a simulated fleet\n")
        print(stack.describe())
        print("\nTry it:\n")
        print(f"  curl -s http://{stack.listen}/v1/chat/completions -H 'content-type: application/json' \\\n"
              f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}' -i\n")
        print(f"  curl -s http://{stack.listen}/v1/messages -H 'content-type: application/json' \\\n"
              f"    -d '{{\"model\": \"{model}\", \"system\": \"Be brief.\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}' -i\n")
        print(f"  curl -s http://{stack.listen}/v1/models\n")
        print("A weighted split: `assistant` is Llama for 80% of conversations and Qwen for 20%, each\n"
              "conversation kept on one (x-gateway-debug starts with split=assistant->...):\n")
        print(f"  curl -s http://{stack.listen}/v1/chat/completions -H 'content-type: application/json' \\\n"
              f"    -d '{{\"model\": \"assistant\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi, I am Ada.\"}}], \"max_tokens\": 32}}' -i\n")
        audio = [m for p in stack.pools for m in p["models"] if "whisper" in m]
        if audio:
            print("An audio upload, a multipart form routed by its model field (the file: 10 s of 16 kHz\n"
                  "16-bit audio to the simulated fleet; with model first, the upload streams to the pod):\n")
            print(f"  head -c 320000 /dev/zero > /tmp/clip.wav\n"
                  f"  curl -s http://{stack.listen}/v1/audio/transcriptions -F model={audio[0]} -F file=@/tmp/clip.wav -i\n")
        adapters = [a for p in stack.pools for a in p.get("adapters", [])]
        if adapters:
            print(f"A LoRA adapter goes to a pod that holds it or is its home (x-gateway-debug ends with the\n"
                  f"other pods, left out as adapter-elsewhere):\n")
            print(f"  curl -s http://{stack.listen}/v1/chat/completions -H 'content-type: application/json' \\\n"
                  f"    -d '{{\"model\": \"{adapters[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}' -i\n")
        print("The filter's counts as Prometheus reads them, by pool and outcome (deploy/monitoring/ has\n"
              "alerts and a Grafana dashboard over these):\n")
        print(f"  curl -s http://{stack.admin}/stats/prometheus | grep '^envoy_gpuroute_pool_requests'\n")
        print("The x-served-by response header names the pod; x-gateway-debug shows why it was picked,\n"
              "and which pods were left out and why.")
        print("Ctrl-C stops everything.", flush=True)
        wait_forever(stack)
        return
    scenario_file = ROOT / "bench" / "scenarios" / f"{args.scenario}.json"
    if not scenario_file.exists():
        scenario_file = Path(args.scenario)
    scenario = json.loads(scenario_file.read_text())
    stack = Stack(fleet=scenario["fleet"], router=args.router, listen=args.listen, concurrency=args.concurrency,
                  workdir=ROOT / "target" / "stack", pool_settings=scenario.get("pools")).start()
    print(f"\nstack for scenario {args.scenario!r} is up:\n")
    print(stack.describe(), flush=True)
    print("\nCtrl-C stops everything.", flush=True)
    wait_forever(stack)


if __name__ == "__main__":
    main()
