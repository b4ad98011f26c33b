#!/usr/bin/env python3
"""What each gateway costs per request in CPU instructions, counted by callgrind: a figure that
does not move with the load of the shared machine, so two builds can be compared across runs and
days (wall-clock figures only within one run: scripts/envoy_overhead.py).

Setup: the same as scripts/envoy_overhead.py (all on 127.0.0.1: a separate direct-response
upstream Envoy with 8 ports, the same 4 KB chat body, one gateway Envoy with 1 worker), but the
gateway runs under `valgrind --tool=callgrind` and one gateway at a time:
  plain          Envoy round robin;
  native_buffer  Envoy round robin with its C++ buffer filter (the pause-and-buffer, natively);
  wasm_floor     the proxy-wasm floor (bench/wasm-floor: read the headers, pause, body into the
                 VM, find the model, three headers; no decision);
  filter         the gpuroute proxy-wasm filter (a snapshot of the 8 pods pushed once);
  module         the same filter as an Envoy dynamic module;
  --compare-wasm other builds of the proxy-wasm filter.
Callgrind runs with instrumentation off until Envoy is up and the snapshot is in; then 300
warm-up requests on one keep-alive connection, the counters zeroed, N requests, the counters
dumped. The figure is the gateway process's instructions (every thread: workers, main thread)
divided by N: Envoy's own work, the VM's host calls and the filter's code. The filter's timer
(`tick_ms`) is set to 10 minutes and pods never go stale (`stale_after_ms` 1 hour), so that
work done per unit of time (ticks, re-pushes), which is large under valgrind's slowdown, is left
out: the figure is per request only. One exception: the filter's exchange with the other workers
and its snapshot-version check run at most every `shared_refresh_ms` (1 ms), which valgrind
stretches every request past, so here they run on every request (at full speed, once a
millisecond). The option stays at its default so that builds from before it (which refuse an
unknown option) can be compared; `--shared-refresh-ms 600000` leaves the exchange out (every
gateway's filter builds must know the option), the per-request work as at full speed. Instructions are not time (cache misses, branch
mispredictions and the host's clock are not in them); they say which build does less work,
reproducibly: the same build gives the same count to within ~0.1%.

With `--workers N` every gateway runs N worker threads, and before the warm-up requests go out
on fresh connections until each worker has served one (the kernel picks each connection's
worker): each worker of a filter build then has its id in the registry and has published its
in-flight table, which the counted worker's exchange reads (under valgrind, on every request).
This is what the exchange costs as Envoy's worker count grows.

With `--tick-ms MS` the filter's tick runs every MS instead of every 10 minutes, so the count
includes what the tick does (the exchange's tick part, the prefix exchange, gauges), at
valgrind's pace: ticks per request are far more than at full speed, so compare builds, not
rates. With `--serving-thread` callgrind counts each thread apart (`--separate-threads`) and the
figure is the busiest thread's, the worker that served the requests: with `--workers N` the
other workers' ticks, which run whether they serve or not, are then left out.

With `--config-changes N` the proxy-wasm builds get their listener from a file (LDS) and, before
the count, the filter's configuration is changed N times while Envoy runs (as an xDS update
changes it; each change routes a few requests and waits for the old plugin instances to drain
and go): what a long-running gateway carries from the configurations it had before.

With `--access-log` every gateway writes envoy/render.py's access log (one JSON line per
request, `ACCESS_LOG_FORMAT`) to a file: what logging each routing decision costs, beside the
same count without it.

With `--body messages-blocks` the request is the same conversation as an Anthropic Messages API
body on `/v1/messages`, in the shape Anthropic's SDKs send (the system prompt a text block with
`cache_control`, every content a list of text blocks): what the scanner's Messages and
content-part paths cost through Envoy. Filter builds only (the floor reads chat bodies).
With `--body chat-lines` it is the chat body with every sentence and clause of its contents on a
line of its own: the contents hold newline escapes, as multi-line prompts do, which the default
body does not. With `--body chat-unicode` a few of its words are Spanish or Japanese and every user
message ends with an emoji, written as Python's `json.dumps` (and the Python SDKs) writes them:
`\\u` escapes, the emoji a surrogate pair.
With `--body chat-cjk` the conversation is in Japanese, as Python writes it by default: every
character of its contents a `\\u` escape (a run of them, read two escapes at a time).

Usage: scripts/envoy_instructions.py [--requests 1000] [--compare-wasm NAME=PATH ...] [--only NAME ...]
                                     [--keep DIR] [--sim] [--config-changes N] [--workers N] [--pods N]
                                     [--tick-ms MS] [--serving-thread] [--access-log] [--body chat|chat-lines|chat-unicode|chat-cjk|chat-long-system|messages-blocks]
Writes target/bench/envoy-instructions.json. Needs valgrind (Debian's package).
"""

import argparse
import glob
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "scripts"))
from envoy_overhead import (CONFIG, REFERENCES, Upstream, chat_body, compare_builds, host_info,  # noqa: E402
                             gateway_specs, pod_snapshot)
from harness import BUILDS, Envoy, LdsListener, scratch, snapshot  # noqa: E402

WARMUP = 300
# Per-time work left out (see the docstring); everything else is the shipped default.
MEASURE_CONFIG = dict(CONFIG, tick_ms=600_000, scoring={"stale_after_ms": 3_600_000})


def callgrind(out_dir, sim=False, threads=False, ll=None):
    extra = ["--cache-sim=yes", "--branch-sim=yes"] if sim else []
    if sim and ll:
        extra.append(f"--LL={ll}")
    if threads:
        extra.append("--separate-threads=yes")
    return ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--instr-atstart=no",
            *extra, f"--callgrind-out-file={out_dir}/cg.%p.out"]


def messages_blocks_body():
    """The same conversation as chat_body() as an Anthropic Messages API body, the way Anthropic's
    SDKs and the agents built on them send it: `system` a text block with `cache_control`, every
    content a list of text blocks."""
    chat = json.loads(chat_body())
    messages = chat["messages"]
    system = messages.pop(0)["content"]
    return json.dumps({
        "model": chat["model"], "max_tokens": 64,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages],
    }).encode()


def chat_lines_body():
    """chat_body() with every sentence and clause of its contents on a line of its own, as
    multi-line prompts are written: its contents hold newline escapes (the benchmark's body has
    none), which the filter's scanner decodes into the prompt text."""
    chat = json.loads(chat_body())
    for m in chat["messages"]:
        for sep in (". ", "; ", ", "):
            m["content"] = m["content"].replace(sep, sep[0] + "\n")
    return json.dumps(chat).encode()


def chat_unicode_body():
    """chat_body() with a few words outside ASCII in its contents (Spanish, Japanese) and an emoji
    at the end of every user message, written as Python's `json.dumps` writes them by default (and
    so the OpenAI and Anthropic Python SDKs): each such character a `\\u` escape, the emoji a
    surrogate pair."""
    chat = json.loads(chat_body())
    for m in chat["messages"]:
        m["content"] = m["content"].replace("shipment", "envío").replace("customer", "クライアント")
        if m["role"] == "user":
            m["content"] += " \U0001F642"
    return json.dumps(chat).encode()


def chat_cjk_body():
    """A conversation of chat_body()'s shape in Japanese (a system prompt, turns until the body
    passes ~3,900 bytes, a last question), written as Python's `json.dumps` writes it by default
    (`ensure_ascii`, as `requests`, `aiohttp` and many scripts send JSON): every character of its
    contents a `\\u` escape."""
    system = ("あなたは物流会社の几帳面なアシスタントです。番号付きの手順で答え、依拠する規定の節を"
              "引用し、追跡番号を決して作らないでください。") * 2
    messages = [{"role": "system", "content": system}]
    turn = 0
    while len(json.dumps(messages)) < 3900:
        messages.append({"role": "user", "content": f"ターン{turn}：荷物は火曜日にロッテルダムのハブを出発し、"
                                                    "それ以来スキャンされていません。次はどうすればよいですか？"})
        messages.append({"role": "assistant", "content": "最後の引き渡しスキャンの積荷目録を確認し、幹線輸送業者に"
                                                         "追跡を依頼し、顧客に通知してください。"})
        turn += 1
    messages.append({"role": "user", "content": "ハブが受け取っていないと言ったら？"})
    return json.dumps({"model": "llama-3-8b", "stream": False, "max_tokens": 64, "messages": messages}).encode()


def chat_long_system_body():
    """An agent's turn: a ~20 KB system prompt (its rules and tool descriptions), past the
    prompt limit the filter hashes (`prefix.max_blocks` x 64 B = 16 KiB), then a user message,
    an answer and a question. The conversation key reaches past that limit (the whole system
    prompt and the first user message), so the body is read a second time for it."""
    rule = "Rule {}: before editing a file, read it and the tests that cover it; never guess a path. "
    system = "".join(rule.format(i) for i in range(230))
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in core/src/request.rs."},
        {"role": "assistant", "content": "I read the test: it expects the key to cover the first user message."},
        {"role": "user", "content": "Good, now make it pass."},
    ]
    return json.dumps({"model": "llama-3-8b", "stream": False, "max_tokens": 64, "messages": messages}).encode()


# --body: the request's path and body.
def streamed(body):
    """The same request asking for a streamed answer: the filter then counts it in prefill until
    the answer's first byte, and times that (`gpuroute.pool.<pool>.ttft_ms`)."""
    doc = json.loads(body)
    doc["stream"] = True
    return json.dumps(doc).encode()


def model_last(body):
    """The same request with `model` after `messages`, the order OpenAI's Python SDK writes: a
    rewrite of its `model` (an alias, a split) replaces nearly the whole body."""
    doc = json.loads(body)
    model = doc.pop("model")
    return json.dumps(dict(doc, model=model)).encode()


BODIES = {
    "chat": ("/v1/chat/completions", chat_body, "4 KB chat body"),
    "chat-lines": ("/v1/chat/completions", chat_lines_body, "4 KB chat body, contents on several lines"),
    "chat-unicode": ("/v1/chat/completions", chat_unicode_body,
                     "4 KB chat body, non-ASCII text and emoji as Python writes them"),
    "chat-cjk": ("/v1/chat/completions", chat_cjk_body,
                 "4 KB chat body in Japanese, every character a \\u escape as Python writes it"),
    "messages-blocks": ("/v1/messages", messages_blocks_body, "4 KB Messages API body (content blocks)"),
    "chat-long-system": ("/v1/chat/completions", chat_long_system_body,
                         "20 KB chat body, its system prompt past the 16 KiB prompt limit"),
    "chat-stream": ("/v1/chat/completions", lambda: streamed(chat_body()), "4 KB chat body, streamed (\"stream\": true)"),
    "chat-model-last": ("/v1/chat/completions", lambda: model_last(chat_body()),
                        "4 KB chat body, `model` after `messages` (as OpenAI's Python SDK writes it)"),
}
PATH = BODIES["chat"][0]


def send(gw, body, k, conn=None):
    """`k` chat requests to the gateway, on `conn` if given (else on a new connection, closed
    after); anything but 200 stops the measurement."""
    own = conn is None
    if own:
        host, port = gw.listen.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
    for _ in range(k):
        conn.request("POST", PATH, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        answer = r.read()
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {answer[:300]!r}")
    if own:
        conn.close()


def reach_every_worker(gw, body, workers, attempts=500):
    """Requests on fresh connections until each of the gateway's `workers` worker threads has
    served one (Envoy's per-worker listener counters say which have)."""
    for _ in range(attempts):
        served = [w for w, n in gw.worker_connections().items() if n > 0]
        if len(served) >= workers:
            return
        send(gw, body, 1)
    raise RuntimeError(f"{attempts} connections did not reach all {workers} workers")


def count(gw, body, n, out_dir):
    """The gateway process's events per request over `n` requests, after a warm-up: a dict of
    callgrind's event names (`Ir`, instructions, always; with `--sim` also cache misses and
    branch mispredictions) to their counts divided by `n`."""
    pid = str(gw.proc.pid)
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    host, port = gw.listen.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    send(gw, body, WARMUP, conn)
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
    t0 = time.monotonic()
    send(gw, body, n, conn)
    seconds = time.monotonic() - t0
    for f in glob.glob(f"{out_dir}/cg.{pid}.out*"):
        Path(f).unlink()
    subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
    conn.close()
    totals = {}
    every_thread = 0
    # One file per dump, or with --serving-thread one per thread: the largest is the serving one.
    for f in glob.glob(f"{out_dir}/cg.{pid}.out.*"):
        events = []
        file_ir = 0
        for line in Path(f).read_text(errors="replace").splitlines():
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith(("summary:", "totals:")):
                values = [int(v) for v in line.split()[1:]]
                # One dump's summary and totals agree; keep the largest of each event.
                for e, v in zip(events, values):
                    totals[e] = max(totals.get(e, 0), v)
                file_ir = max([file_ir] + [v for e, v in zip(events, values) if e == "Ir"])
        every_thread += file_ir
    if not totals.get("Ir"):
        raise RuntimeError("callgrind wrote no counts")
    return {**{e: v / n for e, v in totals.items()}, "seconds": seconds, "every_thread": every_thread / n}


def change_config(gw, lds, n, body, tick_ms):
    """Changes the filter's configuration `n` times (a different `tick_ms`, one more than the
    measured one each time); after each, requests on a fresh connection (the new plugin instance
    routes), then time for the old one to drain (1 s) and be deleted."""
    for k in range(1, n + 1):
        lds.change(gw, timeout_s=300, tick_ms=tick_ms + k)
        send(gw, body, 3)
        time.sleep(3)



def without_stats_tags(patch):
    """A configuration patch that drops the bootstrap's stats_config, then applies `patch`."""
    def apply(config):
        config.pop("stats_config", None)
        if patch:
            patch(config)
    return apply

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--compare-wasm", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="measure only these gateways")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep callgrind's output files in DIR (callgrind_annotate reads them)")
    ap.add_argument("--sim", action="store_true",
                    help="also simulate the caches and branch predictor (callgrind's --cache-sim and "
                         "--branch-sim; ~2x slower): L1 and last-level misses, mispredicted branches")
    ap.add_argument("--ll", metavar="SIZE,ASSOC,LINE",
                    help="with --sim, the simulated last-level cache (valgrind's --LL), e.g. 1048576,8,64: "
                         "this host's per-core L2 instead of valgrind's choice, the shared L3; callgrind "
                         "models two levels, so the level the code and data of Envoy and the VM compete "
                         "for is only seen when it is the last")
    ap.add_argument("--config-changes", type=int, default=0, metavar="N",
                    help="change the proxy-wasm filter's configuration N times (through LDS) before counting")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="Envoy worker threads of each gateway; every one serves a request before the count")
    ap.add_argument("--tick-ms", type=int, metavar="MS",
                    help="the filter's tick_ms (default: 10 minutes, the tick left out of the count)")
    ap.add_argument("--shared-refresh-ms", type=int, metavar="MS",
                    help="the filter's shared_refresh_ms (default: its default, 1 ms, which under valgrind "
                         "puts the exchange with other workers on every request; 600000 leaves it out, as "
                         "at full speed, where it runs once a millisecond)")
    ap.add_argument("--serving-thread", action="store_true",
                    help="count only the busiest thread (the serving worker), not the whole process")
    ap.add_argument("--access-log", action="store_true",
                    help="every gateway writes render.py's access log (ACCESS_LOG_FORMAT) to a file")
    ap.add_argument("--body", choices=sorted(BODIES), default="chat",
                    help="the request: the 4 KB chat body (default); the same with its contents on "
                         "several lines (newline escapes); with non-ASCII text and emoji as Python writes "
                         "them (\\u escapes, surrogate pairs); or the same conversation as a Messages API "
                         "body with content blocks (filter builds only: the floor reads chat)")
    ap.add_argument("--failover", action="store_true",
                    help="the request's model belongs to a pool `down` whose one pod the snapshot says is "
                         "unhealthy, with `failover: [llama]`: the filter's failover path and its counter on "
                         "every request (filter builds only: measure them with --only)")
    ap.add_argument("--split", action="store_true",
                    help="the request names a weighted split (`splits`: `assistant`, one version, llama-3-8b, "
                         "at weight 100) instead of its model: the filter's split path and its counter on every "
                         "request (filter builds only: measure them with --only)")
    ap.add_argument("--pods", type=int, default=0, metavar="N",
                    help="the pool has N pods: the 8 upstream ports and N - 8 unhealthy ones (never picked, so "
                         "scoring is unchanged): what a large pool costs the in-flight tables and their "
                         "exchange between workers (with --workers)")
    ap.add_argument("--no-stats-tags", action="store_true",
                    help="every gateway without render.py's STATS_TAGS (the tag extraction that labels the "
                         "filter's stats for Prometheus), as before 2026-12-06's thirtieth session")
    args = ap.parse_args()
    global PATH
    PATH, make_body, body_label = BODIES[args.body]
    if args.ll and not args.sim:
        sys.exit("--ll sets the simulated cache: it goes with --sim")
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        sys.exit("needs valgrind: apt-get install valgrind")
    extra = compare_builds(args.compare_wasm)
    body = make_body()
    scratch("gpuroute-instructions-")
    up = Upstream()
    config = dict(MEASURE_CONFIG, **({"tick_ms": args.tick_ms} if args.tick_ms else {}),
                  **({"shared_refresh_ms": args.shared_refresh_ms} if args.shared_refresh_ms else {}))
    if args.split:
        config["splits"] = {"assistant": [{"model": "llama-3-8b", "weight": 100}]}
        body = json.dumps(dict(json.loads(body), model="assistant")).encode()
    pods = pod_snapshot(up)
    for i in range(max(0, args.pods - len(pods["llama"]))):
        pods["llama"].append({"address": f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:8000",
                              "healthy": False})
    if args.failover:
        config["pools"] = [{"name": "down", "models": ["llama-3-8b"], "failover": ["llama"]},
                           {"name": "llama", "models": []}]
        pods["down"] = [{"address": "127.0.0.1:9", "healthy": False}]
    gateways = gateway_specs(up, config, extra)
    out_dir = args.keep or Path(tempfile.mkdtemp(prefix="gpuroute-callgrind-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    events = {}
    try:
        for name, spec in gateways.items():
            if args.only and name not in args.only:
                continue
            lds = None
            if args.access_log:
                spec = dict(spec, extra=dict(spec.get("extra") or {}, access_log=str(out_dir / f"access-{name}.log")))
            if args.config_changes and spec.get("runtime") == "wasm" and name not in REFERENCES:
                lds = LdsListener(out_dir / f"lds-{name}")
                spec = dict(spec, patch=lds.patch, envoy_args=lds.envoy_args)
            if args.no_stats_tags:
                spec = dict(spec, patch=without_stats_tags(spec.get("patch")))
            gw = Envoy(**spec, concurrency=args.workers, wrap=callgrind(out_dir, args.sim, args.serving_thread, args.ll), ready_timeout=600)
            pushed = name not in REFERENCES
            try:
                if pushed:
                    answer = gw.push(snapshot(pods))
                    if answer[0] != 204:
                        raise RuntimeError(f"{name}: snapshot push refused: {answer[:3]}")
                if lds:
                    change_config(gw, lds, args.config_changes, body, config["tick_ms"])
                if args.workers > 1:
                    reach_every_worker(gw, body, args.workers)
                events[name] = count(gw, body, args.requests, out_dir)
                if pushed:
                    prefix = BUILDS["module" if name == "module" else "filter"][1]
                    # (Picks are counted on the tick, which is off here; a fail-open is counted at
                    # once.)
                    fail_open = gw.stat(f"{prefix}gpuroute.pool.llama.requests.fail_open")
                    if fail_open:
                        raise RuntimeError(f"{name}: {fail_open} requests failed open; the figure would not be the decision's")
                    # Without the failover, a request would fail open in `down` (counted at once);
                    # the failover's own counter is batched until the tick, which is off here.
                    down = gw.stat(f"{prefix}gpuroute.pool.down.requests.fail_open")
                    if down:
                        raise RuntimeError(f"{name}: {down} requests failed open in pool down, not over")
            finally:
                gw.stop()
            if args.access_log:
                # Envoy writes the file at exit at the latest: every request counted has its line.
                logged = sum(1 for _ in open(spec["extra"]["access_log"]))
                if logged < args.requests:
                    raise RuntimeError(f"{name}: {logged} access log lines for {args.requests} counted requests")
            every = f", every thread {events[name]['every_thread']:,.0f}" if args.serving_thread else ""
            print(f"{name}: {events[name]['Ir']:,.0f} instructions per request "
                  f"({args.requests} in {events[name]['seconds']:.1f} s{every})", flush=True)
    finally:
        up.stop()
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    result = {name: ev["Ir"] for name, ev in events.items()}
    plain = result.get("plain")
    changes = f", after {args.config_changes} changes of the filter's configuration" if args.config_changes else ""
    changes += f", {args.workers} Envoy workers (each served a request first)" if args.workers > 1 else ""
    changes += f", tick every {args.tick_ms} ms" if args.tick_ms else ""
    changes += f", shared_refresh_ms {args.shared_refresh_ms}" if args.shared_refresh_ms else ""
    changes += ", the serving thread only" if args.serving_thread else ""
    changes += ", each request written to the access log" if args.access_log else ""
    changes += ", without the stats' tag extraction" if args.no_stats_tags else ""
    changes += ", the request for a weighted split" if args.split else ""
    changes += f", a pool of {args.pods} pods ({args.pods - 8} unhealthy)" if args.pods > 8 else ""
    changes += ", the request's pool down and failing over" if args.failover else ""
    print(f"\n{body_label}, {args.requests} requests on one connection after {WARMUP} warm-up{changes}, "
          "instructions of the gateway Envoy per request (callgrind):")
    for name, v in result.items():
        added = f", {v - plain:+,.0f} over plain" if plain and name != "plain" else ""
        print(f"  {name:14} {v:10,.0f}{added}")
    if "filter" in result:
        for name in extra:
            if name in result:
                print(f"  filter vs '{name}': {result['filter'] - result[name]:+,.0f} instructions per request")
    if args.sim:
        # Callgrind's simulated machine: L1 (I1, D1) and last-level (LL) caches, and a branch
        # predictor (conditional Bc, indirect Bi); "m" is a miss or a misprediction.
        shown = ["I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw", "Bcm", "Bim"]
        print("\nsimulated per request: " + ", ".join(shown))
        for name, ev in events.items():
            print(f"  {name:14} " + " ".join(f"{ev.get(e, 0):9,.0f}" for e in shown))
    out = ROOT / "target" / "bench" / "envoy-instructions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"requests": args.requests, "warmup": WARMUP, "config_changes": args.config_changes,
                               "workers": args.workers, "pods": max(args.pods, 8),
                               "tick_ms": config["tick_ms"], "shared_refresh_ms": config.get("shared_refresh_ms"),
                               "serving_thread": args.serving_thread, "access_log": args.access_log, "simulated_last_level": args.ll if args.sim else None,
                               "instructions_per_request": result,
                               "seconds": {name: ev["seconds"] for name, ev in events.items()},
                               **({"every_thread_per_request": {name: ev["every_thread"] for name, ev in events.items()}}
                                  if args.serving_thread else {}),
                               **({"simulated_events_per_request": events} if args.sim else {}),
                               "compare_wasm": {k: str(v) for k, v in extra.items()},
                               # V8 compiles for the CPU it finds: name it beside the counts.
                               **host_info()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
