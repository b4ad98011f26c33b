"""Paired, turn-by-turn comparison of gateways measured interleaved (bench/src/interleave.rs).

httpload gives every gateway a quarter-second turn in each cycle and reports each turn
(`targets[i].turns`). Two gateways' turns of one cycle ran within a second of each other, so the
host's speed was nearly the same for both: the difference of their median latencies, or the ratio
of their requests/s, in one cycle is a paired observation with most of the host's drift removed.
Over all cycles of all rounds the comparison is the median of those pairs, with a
distribution-free confidence interval for that median (order statistics of the pairs; no
assumption about their distribution). The pairs are not fully independent (a slow spell can
outlast a cycle and treat two gateways slightly differently), so that interval is a guide to the
noise, not an exact 95%. A second interval takes the rounds as the independent units (a block
bootstrap over rounds: whole rounds drawn with replacement), so whatever the cycles of one
round share widens it instead of hiding.

Two builds that are the same (the filter and its byte-identical A/A copy) can be pooled: per
cycle, their two turns averaged into one, then paired with the baseline's turn of that cycle.
That halves the turn-to-turn noise of the build's side without treating the two as independent
(they share the baseline's turn).
"""

from fractions import Fraction
from math import comb
import random
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


def pairs_by_round(rounds_a, rounds_b, of):
    """`of(turn_a, turn_b)` for the two gateways' turns of every cycle, one list per round.
    `rounds_a` and `rounds_b` are lists of httpload target results (one per round, same rounds),
    each with its `turns`. Turns where either gateway answered nothing are skipped."""
    if len(rounds_a) != len(rounds_b):
        raise ValueError(f"{len(rounds_a)} rounds against {len(rounds_b)}")
    out = []
    for a, b in zip(rounds_a, rounds_b):
        if len(a["turns"]) != len(b["turns"]):
            raise ValueError(f"a round with {len(a['turns'])} turns against {len(b['turns'])}")
        out.append([of(x, y) for x, y in zip(a["turns"], b["turns"]) if x["requests"] and y["requests"]])
    return out


def flat(by_round):
    """Every round's values in one list."""
    return [v for r in by_round for v in r]


def pairs(rounds_a, rounds_b, of):
    """pairs_by_round, every round's pairs in one list."""
    return flat(pairs_by_round(rounds_a, rounds_b, of))


def pooled(*builds):
    """Rounds of one build measured as several gateways (the same rounds), as one: per cycle the
    builds' turns averaged (requests/s, median latency; CPU per request as their CPU time over
    their requests), a turn where any of them answered nothing left empty (then skipped by
    `pairs`)."""
    if len({len(b) for b in builds}) != 1:
        raise ValueError("the builds ran different numbers of rounds")
    out = []
    for rounds in zip(*builds):
        if len({len(r["turns"]) for r in rounds}) != 1:
            raise ValueError("a round where the builds had different numbers of turns")
        turns = []
        for ts in zip(*(r["turns"] for r in rounds)):
            # the figures every turn has (a run without CPU counting has no cpu_us_per_request)
            keys = [k for k in ("rps", "p50_us", "cpu_us_per_request") if all(k in t for t in ts)]
            if all(t["requests"] for t in ts):
                both = {k: statistics.fmean(t[k] for t in ts) for k in ["requests", *keys]}
                if "cpu_us_per_request" in keys:
                    # CPU time over requests of the turns together: a slow turn's few requests
                    # do not weigh like a fast turn's many
                    both["cpu_us_per_request"] = (sum(t["cpu_us_per_request"] * t["requests"] for t in ts)
                                                  / sum(t["requests"] for t in ts))
                turns.append(both)
            else:
                turns.append({"requests": 0, **{k: 0 for k in keys}})
        out.append({"turns": turns})
    return out


def latency_differences(rounds_a, rounds_b):
    """Median latency of gateway a minus gateway b's, microseconds, per cycle, per round."""
    return pairs_by_round(rounds_a, rounds_b, lambda x, y: x["p50_us"] - y["p50_us"])


def rps_ratios(rounds_a, rounds_b):
    """Requests/s of gateway a over gateway b's, per cycle, per round."""
    return pairs_by_round(rounds_a, rounds_b, lambda x, y: x["rps"] / y["rps"])


def cpu_ratios(rounds_a, rounds_b):
    """Gateway b's CPU time per request over gateway a's, per cycle, per round: what the
    requests/s ratio would be if each had a core to itself."""
    return pairs_by_round(rounds_a, rounds_b, lambda x, y: y["cpu_us_per_request"] / x["cpu_us_per_request"])




def rounds_ci(by_round, level=0.95, draws=4000, seed=1):
    """(low, high) of a block bootstrap over rounds: `draws` times, as many rounds as were run
    drawn with replacement, their pairs pooled and their median taken; the interval is the
    central `level` of those medians. Seeded, so a report is reproducible from its raw turns.
    With one round there is nothing to resample: that round's range."""
    rounds = [r for r in by_round if r]
    if not rounds:
        raise ValueError("no values")
    if len(rounds) == 1:
        return min(rounds[0]), max(rounds[0])
    rng = random.Random(seed)
    meds = sorted(statistics.median([v for _ in rounds for v in rng.choice(rounds)]) for _ in range(draws))
    tail = (1 - level) / 2
    return meds[int(tail * (draws - 1))], meds[int(round((1 - tail) * (draws - 1)))]


def summary(by_round, limit=None, higher_is_better=True, level=0.95):
    """median_ci of the pairs of every round (`by_round`, as latency_differences and the ratios
    give them) as a dict, with the number of pairs, the block-bootstrap interval over rounds
    (`rounds_low`, `rounds_high`) and, given a `limit`, the verdict against it by each interval
    (`verdict`: the pairs'; `rounds_verdict`: the rounds')."""
    values = flat(by_round)
    med, lo, hi, cov = ci = median_ci(values, level)
    rlo, rhi = rounds_ci(by_round, level)
    out = {"median": med, "low": lo, "high": hi, "coverage": cov, "pairs": len(values),
           "rounds": sum(1 for r in by_round if r), "rounds_low": rlo, "rounds_high": rhi}
    if limit is not None:
        out["verdict"] = verdict(ci, limit, higher_is_better)
        out["rounds_verdict"] = verdict((med, rlo, rhi, level), limit, higher_is_better)
    return out


def verdict(ci, limit, higher_is_better):
    """'met', 'missed' or 'undecided' for a median_ci result against `limit`: met when the whole
    interval is on the good side, missed when the whole interval is on the bad side."""
    _, lo, hi, _ = ci
    good, bad = (lo >= limit, hi < limit) if higher_is_better else (hi <= limit, lo > limit)
    return "met" if good else "missed" if bad else "undecided"
