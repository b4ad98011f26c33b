"""scripts/paired.py: the paired per-turn comparison bench-envoy reports its verdict with."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import paired  # noqa: E402


def test_median_ci_matches_the_binomial_tables():
    # n = 9: x(2)..x(8), coverage 1 - 2 * 10/512; n = 100: x(40)..x(61) (any table of
    # order-statistic intervals for the median)
    med, lo, hi, cov = paired.median_ci([9, 1, 8, 2, 7, 3, 6, 4, 5])
    assert (med, lo, hi) == (5, 2, 8)
    assert cov == pytest.approx(1 - 20 / 512)
    med, lo, hi, cov = paired.median_ci(range(1, 101))
    assert (med, lo, hi) == (50.5, 40, 61)
    assert 0.95 <= cov < 0.97
    # a lower level gives a narrower interval
    _, lo80, hi80, cov80 = paired.median_ci(range(1, 101), level=0.8)
    assert 40 < lo80 and hi80 < 61 and 0.8 <= cov80 < cov


def test_too_few_values_give_the_whole_range_and_say_what_it_covers():
    med, lo, hi, cov = paired.median_ci([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (med, lo, hi) == (3.0, 1.0, 5.0)
    assert cov == pytest.approx(1 - 2 / 32)  # under the 95% asked
    assert paired.median_ci([7]) == (7, 7, 7, 0.0)
    with pytest.raises(ValueError):
        paired.median_ci([])
    with pytest.raises(ValueError):
        paired.median_ci([1, 2], level=1.5)


def test_the_interval_covers_the_true_median_as_often_as_it_says():
    rng = random.Random(7)
    hits, trials = 0, 2000
    for _ in range(trials):
        # skewed values (exponential, median ln 2), as latency differences can be
        xs = [rng.expovariate(1.0) for _ in range(40)]
        _, lo, hi, _ = paired.median_ci(xs)
        hits += lo <= 0.6931471805599453 <= hi
    assert 0.94 <= hits / trials <= 0.99, hits / trials


def turn(requests, p50_us=100, rps=1000.0, cpu=40.0):
    return {"requests": requests, "p50_us": p50_us, "rps": rps, "cpu_us_per_request": cpu}


def test_turns_are_paired_within_each_cycle_of_each_round():
    # two rounds of three turns; the host slows down in round 2, both gateways alike
    rounds = {
        "plain": [{"turns": [turn(10, 200, 1000, 40), turn(10, 210, 990, 41), turn(10, 190, 1010, 39)]},
                  {"turns": [turn(10, 400, 500, 80), turn(10, 420, 480, 82), turn(10, 380, 520, 78)]}],
        "filter": [{"turns": [turn(10, 250, 750, 50), turn(10, 262, 740, 52), turn(10, 240, 760, 49)]},
                   {"turns": [turn(10, 450, 380, 100), turn(10, 470, 360, 103), turn(0, 0, 0, 0)]}],
    }
    # the cycle where the filter answered nothing is left out: 5 pairs, differences 50 52 50 50 50
    diffs = paired.latency_differences(rounds["filter"], rounds["plain"])
    assert diffs == [[50, 52, 50], [50, 50]]
    s = paired.summary(diffs, 100, higher_is_better=False)
    assert (s["median"], s["low"], s["high"], s["pairs"], s["rounds"], s["verdict"]) == (50, 50, 52, 5, 2, "met")
    assert s["rounds_verdict"] == "met" and 50 <= s["rounds_low"] <= s["rounds_high"] <= 52
    assert paired.flat(paired.rps_ratios(rounds["filter"], rounds["plain"])) == pytest.approx(
        [0.75, 740 / 990, 760 / 1010, 380 / 500, 360 / 480])
    assert paired.flat(paired.cpu_ratios(rounds["filter"], rounds["plain"])) == pytest.approx(
        [0.8, 41 / 52, 39 / 49, 0.8, 82 / 103])
    # the whole-run medians would mix the slow round with the fast one; the pairs do not
    with pytest.raises(ValueError):
        paired.pairs(rounds["filter"][:1], rounds["plain"], lambda x, y: 0)
    with pytest.raises(ValueError):
        paired.pairs([{"turns": [turn(1)]}], [{"turns": [turn(1), turn(1)]}], lambda x, y: 0)


def test_a_verdict_needs_the_whole_interval_on_one_side():
    assert paired.verdict((80, 70, 95, 0.95), 100, higher_is_better=False) == "met"
    assert paired.verdict((98, 90, 104, 0.95), 100, higher_is_better=False) == "undecided"
    assert paired.verdict((120, 101, 130, 0.95), 100, higher_is_better=False) == "missed"
    assert paired.verdict((0.8, 0.76, 0.83, 0.95), 0.75, higher_is_better=True) == "met"
    assert paired.verdict((0.75, 0.73, 0.77, 0.95), 0.75, higher_is_better=True) == "undecided"
    assert paired.verdict((0.71, 0.70, 0.72, 0.95), 0.75, higher_is_better=True) == "missed"


def test_two_runs_of_one_build_pool_turn_by_turn():
    a = [{"turns": [turn(10, 200, 1000, 40), turn(10, 300, 800, 50)]}]
    b = [{"turns": [turn(20, 220, 900, 44), turn(0, 0, 0, 0)]}]
    plain = [{"turns": [turn(10, 100, 1900, 20), turn(10, 100, 1900, 20)]}]
    both = paired.pooled(a, b)
    # CPU per request: (40 * 10 + 44 * 20) / 30
    assert both[0]["turns"][0] == pytest.approx({"requests": 15, "rps": 950, "p50_us": 210,
                                                 "cpu_us_per_request": (400 + 880) / 30})
    # the cycle where one of them answered nothing is skipped, not half-counted
    assert paired.rps_ratios(both, plain) == [[pytest.approx(0.5)]]
    assert paired.latency_differences(both, plain) == [[110]]
    # turns without CPU figures (the latency runs) pool what they have
    lat = paired.pooled([{"turns": [{"requests": 5, "p50_us": 100, "rps": 10.0}]}],
                        [{"turns": [{"requests": 5, "p50_us": 120, "rps": 12.0}]}])
    assert lat[0]["turns"][0] == {"requests": 5, "p50_us": 110, "rps": 11.0}
    with pytest.raises(ValueError):
        paired.pooled(a, a + a)
    with pytest.raises(ValueError):
        paired.pooled(a, [{"turns": [turn(1)]}])


def test_the_rounds_interval_widens_with_what_a_round_shares():
    """Rounds that each share a shift (a slow or fast spell) make the pairs' interval far too
    narrow; the block bootstrap over rounds covers the true median close to what it says."""
    rng = random.Random(3)
    pairs_hits = rounds_hits = trials = 0
    for _ in range(200):
        by_round = []
        for _ in range(9):
            shift = rng.gauss(0, 1)
            by_round.append([shift + rng.gauss(0, 1) for _ in range(18)])
        _, lo, hi, _ = paired.median_ci(paired.flat(by_round))
        rlo, rhi = paired.rounds_ci(by_round, draws=500, seed=rng.random())
        pairs_hits += lo <= 0 <= hi
        rounds_hits += rlo <= 0 <= rhi
        trials += 1
    assert pairs_hits / trials < 0.75, pairs_hits / trials
    assert rounds_hits / trials >= 0.83, rounds_hits / trials


def test_the_rounds_interval_without_round_effects_and_at_the_edges():
    rng = random.Random(5)
    hits = 0
    for _ in range(100):
        by_round = [[rng.gauss(0, 1) for _ in range(18)] for _ in range(9)]
        rlo, rhi = paired.rounds_ci(by_round, draws=500, seed=rng.random())
        hits += rlo <= 0 <= rhi
    assert hits >= 85, hits
    # reproducible from its seed; one round: that round's range; empty rounds are not rounds
    by_round = [[1.0, 2.0, 3.0], [2.0, 4.0], []]
    assert paired.rounds_ci(by_round) == paired.rounds_ci(by_round)
    assert paired.rounds_ci([[], [3.0, 1.0, 2.0]]) == (1.0, 3.0)
    with pytest.raises(ValueError):
        paired.rounds_ci([[], []])
