#!/usr/bin/env python3
"""The filter's own code per request in CPU instructions, by wasm function: exact counts where
`make profile-wasm` gives samples.

The built .wasm runs under Node's V8 (the engine Envoy embeds) with the minimal host of
scripts/wasm_profile.mjs, the whole process under `valgrind --tool=callgrind --dump-instr=yes`.
V8 compiles with TurboFan only (`--no-liftoff`, as proxy-wasm-cpp-host sets it for Envoy) and
logs where it put each wasm function's machine code (`--log-code`); every instruction callgrind
counted at an address inside a function's code is that function's. Two runs, N and 2N requests,
and their difference over N: what a request costs, without start-up and compilation.

Besides the functions: the machine code a request runs through, as distinct 64-byte lines of
the wasm functions' compiled code (the lines whose count grows by at least one instruction per
request from the N-request run to the 2N one). A line is a 64-byte piece of a function counted
from the function's start, named by the function and its offset, which are the same in both
runs; so the count is about, not exactly, the cache lines. It is the VM's instruction-cache
footprint per request: distinct code run in the VM slows Envoy's own
side of the request, where the same time in a tight loop does not (docs/performance.md, twelfth
session). And `memory.copy` executions per request. V8 runs each as a call out of the
wasm code into a C function (`memory_copy_wrapper`), ~80 instructions of fixed cost, so a copy
of a short string costs more than the bytes it moves; they are counted by their callers.

What this does not count: the host side of the host calls (Envoy's, not this JavaScript host's)
and the C function behind each `memory.copy`. Envoy's whole cost per request is
scripts/envoy_instructions.py; this splits the VM's part of it.

Usage: make profile-wasm-instr, or
       scripts/wasm_instructions.py [--wasm FILTER.wasm] [--requests N] [--top K]
Needs valgrind and node (~1 min).
"""
import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import envoy_overhead  # noqa: E402  (the benchmark's 4 KB chat body)

DEFAULT_WASM = ROOT / "target" / "wasm32-wasip1" / "wasm-release" / "gpuroute_filter.wasm"
COPY_WRAPPER = "memory_copy_wrapper"


def demangle(name):
    """A legacy Rust symbol (`_ZN...E`) as its path without the hash; others unchanged."""
    m = re.fullmatch(r"_ZN(.*)E", name)
    if not m:
        return name
    rest, parts = m.group(1), []
    while rest and rest[0].isdigit():
        n = re.match(r"\d+", rest).group(0)
        part, rest = rest[len(n):len(n) + int(n)], rest[len(n) + int(n):]
        parts.append(part)
    if parts and re.fullmatch(r"h[0-9a-f]{16}", parts[-1]):
        parts.pop()
    text = "::".join(parts)
    for code, ch in (("$LT$", "<"), ("$GT$", ">"), ("$u20$", " "), ("$u7b$", "{"), ("$u7d$", "}"),
                     ("$RF$", "&"), ("$C$", ","), ("..", "::")):
        text = text.replace(code, ch)
    return text


def code_ranges(log):
    """(start, size, name) of every piece of code V8 logged, sorted by start; the name of a wasm
    function (V8 logs it as kind `JS`) is its symbol, other code's is prefixed with its kind."""
    ranges = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("code-creation,"):
            p = line.split(",")
            try:
                name = p[6] if p[1] == "JS" else f"{p[1]}:{p[6]}"
                ranges.append((int(p[4], 16), int(p[5]), name))
            except (IndexError, ValueError):
                continue
    ranges.sort()
    return ranges


LINE = 64


def count(cg, ranges):
    """Self instructions per named code range, self instructions per 64-byte line of code as
    {(range name, line's offset in the range): instructions}, and calls into the `memory.copy`
    wrapper per calling range, from a callgrind file written with --dump-instr=yes."""
    starts = [r[0] for r in ranges]

    def owner(addr):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < ranges[i][0] + ranges[i][1]:
            return ranges[i][2], ranges[i][0]
        return None, 0

    def pos(tok, prev):
        if tok == "*":
            return prev
        if tok[0] in "+-":
            return prev + int(tok)
        return int(tok, 16) if tok.startswith("0x") else int(tok)

    own, lines, copies, names = {}, {}, {}, {}
    addr = line_no = 0
    callee, calls = "", None
    with open(cg) as f:
        for line in f:
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m:
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                if line.startswith("cfn="):
                    callee = names.get(m.group(1), "")
                continue
            if line.startswith("calls="):
                calls = int(line.split()[0][len("calls="):])
                continue
            if not line or not (line[0].isdigit() or line[0] in "+-*"):
                continue
            parts = line.split()
            if len(parts) < 3:
                calls = None
                continue
            addr, line_no = pos(parts[0], addr), pos(parts[1], line_no)
            name, start = owner(addr)
            if calls is not None:
                # The line after `calls=` is the call's inclusive cost, at the call site.
                if COPY_WRAPPER in callee and name:
                    copies[name] = copies.get(name, 0) + calls
                calls = None
                continue
            if name:
                key = (name, (addr - start) // LINE * LINE)
                lines[key] = lines.get(key, 0) + int(parts[2])
    for (name, _), n in lines.items():
        own[name] = own.get(name, 0) + n
    return own, lines, copies


def is_wasm(name):
    """Whether a code range V8 logged is a wasm function (not the JavaScript host's code, a
    builtin or a wrapper between the two)."""
    return ":" not in name.split(" ")[0] and " file:" not in name and not name.startswith(("wasm-to-js", "js-to-wasm"))


# --split: the request names a weighted split, as scripts/envoy_instructions.py --split.
SPLIT = {"splits": {"assistant": [{"model": "llama-3-8b", "weight": 100}]}}


def run(wasm, body, n, work, path="/v1/chat/completions", config=None):
    cg, log = work / f"cg.{n}.out", work / f"v8.{n}.log"
    cmd = ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--dump-instr=yes",
           f"--callgrind-out-file={cg}", "node", "--no-liftoff", "--log-code", "--no-logfile-per-isolate",
           f"--logfile={log}", "--no-warnings", str(ROOT / "scripts" / "wasm_profile.mjs"), str(wasm), str(body), str(n), path]
    env = dict(os.environ, GPUROUTE_PROFILE_CONFIG=json.dumps(config)) if config else None
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"node under valgrind failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}")
    return count(cg, code_ranges(log))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wasm", type=Path, default=DEFAULT_WASM)
    ap.add_argument("--requests", type=int, default=2000, help="N: the runs route N and 2N requests")
    ap.add_argument("--top", type=int, default=30, help="functions listed")
    ap.add_argument("--path", default="/v1/chat/completions",
                    help="the request's path (/v1/messages for a Messages API body)")
    ap.add_argument("--body", type=Path, help="the chat request's body, from this file (default: the "
                    "4 KB chat body of the Envoy benchmarks)")
    ap.add_argument("--split", action="store_true",
                    help="the request names a weighted split (`assistant`, one version, llama-3-8b) instead of its model")
    args = ap.parse_args()
    for tool in ("valgrind", "node"):
        if not shutil.which(tool):
            sys.exit(f"needs {tool}")
    with tempfile.TemporaryDirectory(prefix="gpuroute-wasm-instr-") as tmp:
        work = Path(tmp)
        body = work / "chat.json"
        body.write_bytes(args.body.read_bytes() if args.body else envoy_overhead.chat_body())
        config = None
        if args.split:
            config = SPLIT
            body.write_bytes(json.dumps(dict(json.loads(body.read_bytes()), model="assistant")).encode())
        n = args.requests
        own1, lines1, copies1 = run(args.wasm, body, n, work, args.path, config)
        own2, lines2, copies2 = run(args.wasm, body, 2 * n, work, args.path, config)
    # Per request: the difference of the two runs over N. Only wasm functions (V8 logs them under
    # their export or symbol name); the JavaScript host's own functions are left out.
    per = {k: (own2.get(k, 0) - own1.get(k, 0)) / n for k in set(own1) | set(own2)}
    wasm_fns = {k: v for k, v in per.items() if is_wasm(k)}
    # A line a request runs grows by at least one instruction per request between the runs.
    hot = {key for key, v in lines2.items() if is_wasm(key[0]) and v - lines1.get(key, 0) >= n}
    total = sum(v for v in wasm_fns.values() if v > 0)
    copy_calls = {k: (copies2.get(k, 0) - copies1.get(k, 0)) / n for k in set(copies1) | set(copies2)}
    what = (args.body.name if args.body else "the 4 KB chat body") + (", for a weighted split" if args.split else "")
    print(f"{args.wasm.name}: {n} and {2 * n} requests of {what} (scripts/wasm_profile.mjs), "
          "V8 TurboFan under Node, instructions per request")
    print(f"  the filter's wasm code: {total:,.0f} (and per function the KiB of its machine code a request runs)")
    fp = {}
    for name, _ in hot:
        fp[name] = fp.get(name, 0) + LINE / 1024
    for k, v in sorted(wasm_fns.items(), key=lambda x: -x[1])[:args.top]:
        print(f"  {v:9,.0f}  {v / total:6.1%}  {fp.get(k, 0):5.1f} KiB  {demangle(k)}")
    print(f"machine code a request runs: {len(hot):,} distinct {LINE}-byte lines ({len(hot) * LINE / 1024:,.1f} KiB) "
          f"in {len(fp)} functions; the most:")
    for k, v in sorted(fp.items(), key=lambda x: -x[1])[:8]:
        print(f"  {v:5.1f} KiB  {demangle(k)}")
    print(f"memory.copy per request (each a call into V8's C function): {sum(copy_calls.values()):.1f}")
    for k, v in sorted(copy_calls.items(), key=lambda x: -x[1])[:8]:
        if v >= 0.5:
            print(f"  {v:5.1f}  {demangle(k)}")


if __name__ == "__main__":
    main()
