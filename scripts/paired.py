"""Paired, turn-by-turn comparison of gateways measured interleaved (bench/src/interleave.rs).

httpload gives every gateway a quarter-second turn in each cycle and reports each turn
(`targets[i].turns`). Two gateways' turns of one cycle ran within a second of each other, so the
host's speed was nearly the same for both: the difference of their median latencies, or the ratio
of their requests/s, in one cycle is a paired observation with most of the host's drift removed.
Over all cycles of all rounds the comparison is the median of those pairs, with a
distribution-free confidence interval for that median (order statistics of the pairs; no
assumption about their distribution). The pairs are not fully independent (a slow spell can
outlast a cycle and treat two gateways slightly differently), so the interval is a guide to the
noise, not an exact 95%.
"""

from fractions import Fraction
from math import comb
import statistics


def median_ci(values, level=0.95):
    """(median, low, high, coverage) of `values`: `low`..`high` is the narrowest interval between
    order statistics x(k)..x(n+1-k) whose coverage of the true median is at least `level` when
    the values are independent (the binomial argument: each value is under the median with
    probability 1/2). With too few values for `level` it is the whole range and `coverage` says
    what that range covers (1 - 2/2^n)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    if not 0 < level < 1:
        raise ValueError(f"level {level} is not in (0, 1)")
    tail = Fraction(1) - Fraction(level).limit_denominator(10**6)
    # the largest k >= 1 with P(X <= k - 1) <= tail / 2, X ~ Binomial(n, 1/2); exact in integers
    total = 2**n
    k, below = 1, comb(n, 0)
    while k < (n + 1) // 2:
        nxt = below + comb(n, k)
        if 2 * nxt > tail * total:
            break
        below, k = nxt, k + 1
    coverage = 1 - 2 * below / total
    return statistics.median(xs), xs[k - 1], xs[n - k], coverage


def pairs(rounds_a, rounds_b, of):
    """`of(turn_a, turn_b)` for the two gateways' turns of every cycle of every round.
    `rounds_a` and `rounds_b` are lists of httpload target results (one per round, same rounds),
    each with its `turns`. Turns where either gateway answered nothing are skipped."""
    if len(rounds_a) != len(rounds_b):
        raise ValueError(f"{len(rounds_a)} rounds against {len(rounds_b)}")
    out = []
    for a, b in zip(rounds_a, rounds_b):
        if len(a["turns"]) != len(b["turns"]):
            raise ValueError(f"a round with {len(a['turns'])} turns against {len(b['turns'])}")
        out += [of(x, y) for x, y in zip(a["turns"], b["turns"]) if x["requests"] and y["requests"]]
    return out


def latency_differences(rounds_a, rounds_b):
    """Median latency of gateway a minus gateway b's, microseconds, per cycle."""
    return pairs(rounds_a, rounds_b, lambda x, y: x["p50_us"] - y["p50_us"])


def rps_ratios(rounds_a, rounds_b):
    """Requests/s of gateway a over gateway b's, per cycle."""
    return pairs(rounds_a, rounds_b, lambda x, y: x["rps"] / y["rps"])


def cpu_ratios(rounds_a, rounds_b):
    """Gateway b's CPU time per request over gateway a's, per cycle: what the requests/s ratio
    would be if each had a core to itself."""
    return pairs(rounds_a, rounds_b, lambda x, y: y["cpu_us_per_request"] / x["cpu_us_per_request"])


def summary(values, limit=None, higher_is_better=True, level=0.95):
    """median_ci of `values` as a dict, with the number of pairs and, given a `limit`, the verdict
    against it."""
    med, lo, hi, cov = ci = median_ci(values, level)
    out = {"median": med, "low": lo, "high": hi, "coverage": cov, "pairs": len(values)}
    if limit is not None:
        out["verdict"] = verdict(ci, limit, higher_is_better)
    return out


def verdict(ci, limit, higher_is_better):
    """'met', 'missed' or 'undecided' for a median_ci result against `limit`: met when the whole
    interval is on the good side, missed when the whole interval is on the bad side."""
    _, lo, hi, _ = ci
    good, bad = (lo >= limit, hi < limit) if higher_is_better else (hi <= limit, lo > limit)
    return "met" if good else "missed" if bad else "undecided"
