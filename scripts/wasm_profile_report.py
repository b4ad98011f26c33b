#!/usr/bin/env python3
"""Sums a V8 CPU profile (node --cpu-prof) by function: self time, largest first.

Usage: scripts/wasm_profile_report.py PROFILE.cpuprofile [TOP]
The filter's wasm functions carry their Rust (mangled) names; the JavaScript host of
scripts/wasm_profile.mjs shows under its own function names.
"""

import collections
import json
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    profile = json.load(open(sys.argv[1]))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    nodes = {n["id"]: n for n in profile["nodes"]}
    samples = collections.Counter(profile["samples"])
    total = sum(samples.values())
    by_fn = collections.Counter()
    for node_id, count in samples.items():
        frame = nodes[node_id]["callFrame"]
        by_fn[frame["functionName"] or frame["url"] or "(anonymous)"] += count
    print(f"{total} samples")
    for name, count in by_fn.most_common(top):
        print(f"{100 * count / total:6.2f}%  {name[:140]}")


if __name__ == "__main__":
    main()
