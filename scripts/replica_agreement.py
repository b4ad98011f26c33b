#!/usr/bin/env python3
"""Prefix affinity between two gateway replicas that share nothing (no relay), over many sets of
pods, for one or more filter settings.

`tests/e2e/test_affinity.py` measures it once, on one set of stub pods. Which first turns are
near ties depends on the pods' ports (the rendezvous homes hash the pod addresses), so one set
says little; this replays the test's 200 turns on `--sets` new sets of 8 pods per setting and
prints the mean and range of the share of follow-up turns that reached the previous turn's pod.

  scripts/replica_agreement.py --sets 12 --variant '{}' \\
      --variant '{"scoring":{"prefix_home_score":0.5}}'

Needs the built filter (`make build`) and the project's venv (`make setup`); ~10 s per set.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))

import test_affinity  # noqa: E402
from stubpod import serving  # noqa: E402


def agreement(variant, sets):
    """(affinity, pods used) for each of `sets` new sets of pods, two replicas each."""
    out = []
    for _ in range(sets):
        with serving(test_affinity.POD_NAMES) as pods:
            config = {**test_affinity.CONFIG, **variant}
            out.append(test_affinity.run_replicas(list(pods.values()), config, replicas=2))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", type=int, default=12, help="sets of new pods per variant")
    ap.add_argument("--variant", action="append", default=[],
                    help="JSON merged into the filter configuration (repeatable; default: '{}')")
    args = ap.parse_args()
    for text in args.variant or ["{}"]:
        results = agreement(json.loads(text), args.sets)
        affs = [a for a, _ in results]
        used = sorted({u for _, u in results})
        print(f"{text}: affinity mean {statistics.mean(affs):.3f} min {min(affs):.3f} "
              f"max {max(affs):.3f} over {len(affs)} sets; pods used {used}", flush=True)


if __name__ == "__main__":
    main()
