"""search/targets.py: per-head budget allocation for a quality target. Plain data, exact answers."""

from __future__ import annotations

import itertools
import math

import pytest

from sparsesearch.search.targets import (
    DENSE, Allocation, HeadCurve, budget_allocation, cap_allocation, check_target, kl_model_curves, kl_model_path,
    kl_sensitivity, lagrangian_path, layer_extras, only_layer, predicted_kl, probe_allocation, search_target,
)

# Head (0, 0): a good cheap candidate; head (1, 0): only a poor one; head (1, 1): one pruned (inf) and
# one costing more than dense.
CURVES = [
    HeadCurve(0, 0, cost=(1.0, 2.0, 4.0), error=(0.30, 0.05, 0.01), dense_cost=10.0, names=("a", "b", "c")),
    HeadCurve(1, 0, cost=(1.0, 3.0), error=(0.60, 0.40), dense_cost=10.0, names=("a", "b")),
    HeadCurve(1, 1, cost=(2.0, 12.0), error=(math.inf, 0.001), dense_cost=10.0, names=("a", "b")),
]


def brute_force(curves, lam):
    """Min over every joint choice of sum(cost + lam * dense_cost * error): the separable optimum."""
    options = [[DENSE] + c.usable() for c in curves]
    score = lambda picks: sum(c.cost_of(i) + lam * c.dense_cost * c.error_of(i) for c, i in zip(curves, picks))
    return min(score(p) for p in itertools.product(*options)), score


def test_cap_takes_the_cheapest_within_the_cap_and_says_why_a_head_is_dense():
    a = cap_allocation(CURVES, 0.1)
    assert a.choices == [1, DENSE, DENSE]
    assert "no sparse candidate within output error 0.1" in a.reasons[(1, 0)]
    assert "best: b, error 0.4" in a.reasons[(1, 0)]
    assert "cheaper than dense" in a.reasons[(1, 1)]  # its only finite candidate costs more than dense
    assert cap_allocation(CURVES, 0.7).choices == [0, 0, DENSE]


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0, 3.0, 20.0, 100.0])
def test_each_path_point_is_the_lagrangian_optimum_and_cost_rises(lam):
    path = lagrangian_path(CURVES)
    assert path[0].choices == [0, 0, DENSE] and path[-1].choices == [DENSE] * 3
    costs = [a.cost(CURVES) for a in path]
    assert costs == sorted(costs)
    errors = [sum(c.error_of(i) for c, i in zip(CURVES, a.choices)) for a in path]
    assert errors == sorted(errors, reverse=True)
    best, score = brute_force(CURVES, lam)
    # The allocation the path holds for lam (the last point whose lam is <= lam) reaches the optimum.
    here = [a for a in path if a.lam <= lam][-1]
    assert score(here.choices) == pytest.approx(best)


def test_budget_allocation_is_the_lowest_error_point_within_the_budget():
    a = budget_allocation(CURVES, 0.5)  # 15 of the dense 30
    assert a.cost(CURVES) <= 15.0
    fits = [p for p in lagrangian_path(CURVES) if p.cost(CURVES) <= 15.0]
    assert a.choices == fits[-1].choices
    assert budget_allocation(CURVES, 0.1) is None  # the cheapest point costs 12/30


def test_search_target_finds_the_cheapest_point_that_meets_the_target():
    path = [Allocation([0]), Allocation([1]), Allocation([2]), Allocation([3]), Allocation([4]), Allocation([DENSE])]
    kl = {0: 0.5, 1: 0.2, 2: 0.04, 3: 0.01, 4: 0.001}
    calls = []

    def measure(a):
        calls.append(a.choices[0])
        return kl[a.choices[0]]

    found = search_target(path, measure, 0.05)
    assert found.chosen == 2 and found.measured[2] == 0.04
    assert DENSE not in calls and len(calls) <= 4  # never measures all-dense; bisection, not a sweep
    missed = search_target(path, measure, 1e-4)
    assert missed.chosen is None and missed.best == 4  # the densest sparse point is the best reachable
    assert search_target(path, measure, 1.0).chosen == 0
    calls.clear()
    coarse = search_target(path, measure, 0.005, costs=[0.1, 0.2, 0.3, 0.31, 0.32, 1.0], resolution=0.05)
    assert coarse.chosen == 4 and 3 not in calls  # the bracket (2, 4) spans 2% of dense: 3 is not worth a run
    assert search_target(path, measure, 0.005).chosen == 4 and 3 in calls


@pytest.mark.parametrize("guided", [False, True])
def test_search_target_starts_from_what_a_sweep_measured(guided):
    # KL not monotone along the path (RESULTS Run 40): an earlier target measured point 2 at 0.008, which meets
    # 0.01; this target's own search from scratch reads 3 (0.02, a miss) and settles on 4, never reading 2
    path = [Allocation([i]) for i in range(8)] + [Allocation([DENSE])]
    kl = {0: 0.5, 1: 0.03, 2: 0.008, 3: 0.02, 4: 0.009, 5: 0.006, 6: 0.004, 7: 0.002}
    predicted = [0.4, 0.03, 0.02, 0.015, 0.009, 0.006, 0.004, 0.002, 0.0] if guided else None
    calls = []

    def measure(a):
        calls.append(a.choices[0])
        return kl[a.choices[0]]

    fresh = search_target(path, measure, 0.01, predicted=predicted)
    assert fresh.chosen == 4 and 2 not in calls
    calls.clear()
    known = [None, None, 0.008, None, None, None, None, None, None]
    seeded = search_target(path, measure, 0.01, predicted=predicted, known=known)
    assert seeded.chosen == 2 and seeded.measured[2] == 0.008 and 2 not in calls  # read, not run again
    assert 1 in calls and 3 not in calls and 4 not in calls  # the point just cheaper confirms the miss; nothing dearer runs


@pytest.mark.parametrize("kind,value", [("target_kl", 0.0), ("target_kl", -1e-3), ("max_output_error", math.nan),
                                        ("latency_budget", 1.5), ("latency_budget", 0.0), ("loss", 0.1)])
def test_bad_targets_are_refused_with_the_value(kind, value):
    with pytest.raises(ValueError, match=str(value) if kind != "loss" else "target kind"):
        check_target(kind, value)


# ------------------------------------------------------------------------------ the KL model of --target-kl
def test_guided_search_meets_the_target_in_fewer_runs_than_bisection():
    """A path of 40 points whose true KL is 2x what the model predicts: the guided search corrects by the
    measured/predicted ratio and lands on the same point as bisection, in fewer measurements."""
    n = 40
    predicted = [0.1 * 0.8 ** i for i in range(n)] + [0.0]
    true = [2 * p for p in predicted]
    path = [Allocation([i]) for i in range(n)] + [Allocation([DENSE])]
    runs = {"guided": [], "bisect": []}

    def measure(kind):
        return lambda a: runs[kind].append(a.choices[0]) or true[a.choices[0]]

    guided = search_target(path, measure("guided"), 1e-3, predicted=predicted)
    plain = search_target(path, measure("bisect"), 1e-3)
    want = next(i for i in range(n) if true[i] <= 1e-3)
    assert guided.chosen == plain.chosen == want
    assert want - 1 in runs["guided"], "the point just cheaper was measured to miss: the cheapest that meets"
    assert len(runs["guided"]) <= 3 < len(runs["bisect"])
    assert DENSE not in runs["guided"]


def test_guided_search_with_a_wrong_model_still_finds_the_point_and_reports_unreachable():
    n = 30
    predicted = [1.0 / (i + 1) for i in range(n)] + [0.0]  # ordering right, scale and shape wrong
    true = [0.5 ** i for i in range(n)] + [0.0]
    path = [Allocation([i]) for i in range(n)] + [Allocation([DENSE])]
    calls = []
    found = search_target(path, lambda a: calls.append(a.choices[0]) or true[a.choices[0]], 1e-4, predicted=predicted)
    assert found.chosen == next(i for i in range(n) if true[i] <= 1e-4) and len(calls) <= 2 * 5 + 2
    missed = search_target(path, lambda a: true[a.choices[0]], 1e-12, predicted=predicted)
    assert missed.chosen is None and missed.best == n - 1 and n - 1 in missed.measured  # the densest sparse point missed


def test_kl_model_ranks_heads_by_measured_layer_sensitivity():
    # Two layers with identical per-head curves; layer 1 costs 10x the KL per squared error.
    curve = lambda layer, head: HeadCurve(layer, head, cost=(1.0, 3.0), error=(0.4, 0.1), dense_cost=10.0, names=("a", "b"))
    curves = [curve(0, 0), curve(0, 1), curve(1, 0), curve(1, 1)]
    path = lagrangian_path(curves)
    probe = probe_allocation(curves, path, 0.1)
    assert probe.choices == [0, 0, 0, 0]  # the cheapest point costs 4/40
    assert only_layer(probe, curves, 1).choices == [DENSE, DENSE, 0, 0]
    sens = kl_sensitivity(curves, probe, {0: 0.032, 1: 0.32})  # sum error^2 per layer = 0.32
    assert sens == pytest.approx({0: 0.1, 1: 1.0})
    kl_path, predicted = kl_model_path(curves, sens)
    assert predicted == sorted(predicted, reverse=True) and predicted[0] == pytest.approx(0.032 + 0.32)
    assert predicted[-1] == 0 and kl_path[-1].choices == [DENSE] * 4
    # The sensitive layer's heads move first: the first step up the path is in layer 1, not layer 0.
    first = kl_path[1].choices
    assert first[2:] != [0, 0] and first[:2] == [0, 0]
    assert "layer 1 costs 1 KL per squared output error" in next(iter(kl_path[-1].reasons.values())) or \
           any("costs 1 KL" in r for r in kl_path[-1].reasons.values())
    assert predicted_kl(kl_model_curves(curves, sens), kl_path[1]) == pytest.approx(predicted[1])


def test_a_layer_without_a_measured_kl_takes_the_largest_sensitivity():
    curves = [HeadCurve(0, 0, (1.0,), (0.2,), 10.0), HeadCurve(1, 0, (1.0,), (0.3,), 10.0), HeadCurve(2, 0, (1.0,), (0.0,), 10.0)]
    sens = kl_sensitivity(curves, Allocation([0, 0, 0]), {0: 0.004})
    assert sens == pytest.approx({0: 0.1, 1: 0.1, 2: 0.1})


# Two layers of two heads, each layer paying 3.0 once when its heads mix sparse and dense (MeasuredCost.mix_ms).
# Layer 0's head 1 has only a poor candidate, so at a middle lam head 0 alone would go sparse: a saving of
# at most 2.0 that the mix cost eats.
MIXED = [
    HeadCurve(0, 0, cost=(9.0, 8.0), error=(0.02, 0.01), dense_cost=10.0, mix_cost=3.0),
    HeadCurve(0, 1, cost=(2.0,), error=(0.5,), dense_cost=10.0, mix_cost=3.0),
    HeadCurve(1, 0, cost=(1.0,), error=(0.3,), dense_cost=10.0, mix_cost=3.0),
    HeadCurve(1, 1, cost=(1.0,), error=(0.3,), dense_cost=10.0, mix_cost=3.0),
]


def brute_force_mixed(curves, lam):
    """Min over every joint choice of the heads' cost + lam * dense_cost * error plus each mixed layer's mix_cost."""
    options = [[DENSE] + c.usable() for c in curves]
    score = lambda picks: sum(c.cost_of(i) + lam * c.dense_cost * c.error_of(i) for c, i in zip(curves, picks)) + layer_extras(curves, picks)
    return min(score(p) for p in itertools.product(*options)), score


def test_a_mixed_layer_pays_its_mix_cost_once():
    assert layer_extras(MIXED, [0, DENSE, 0, 0]) == 3.0
    assert layer_extras(MIXED, [0, DENSE, 0, DENSE]) == 6.0
    assert layer_extras(MIXED, [DENSE, DENSE, 0, 0]) == layer_extras(MIXED, [0, 0, 0, 0]) == 0.0
    assert Allocation([0, DENSE, 0, 0]).cost(MIXED) == 9.0 + 10.0 + 1.0 + 1.0 + 3.0
    # without a mix cost, the same allocation costs its heads only (a CPU's analytic costs)
    free = [HeadCurve(c.layer, c.head, c.cost, c.error, c.dense_cost) for c in MIXED]
    assert Allocation([0, DENSE, 0, 0]).cost(free) == 21.0


# The same with head (0, 0) saving up to 4.0 alone: there mixing pays for a range of lam.
MIX_PAYS = [HeadCurve(0, 0, cost=(8.0, 6.0), error=(0.02, 0.01), dense_cost=10.0, mix_cost=3.0)] + MIXED[1:]


# Layer 0's heads run as one launch on candidate 1 (2 + 2) or as two on candidates 0 and 1 (2 + 2 + 3 more for
# the second launch); candidate 2 is the low-error one both share. Layer 1 as in MIXED.
SPLIT = [HeadCurve(0, h, (2.0, 2.0, 3.0) if h == 0 else (9.0, 2.0, 3.0), (0.2, 0.3, 0.1) if h == 0 else (0.3, 0.2, 0.1),
                   10.0, split_cost=3.0) for h in (0, 1)] + MIXED[2:]


def test_a_layer_pays_for_each_launch_past_its_first():
    assert layer_extras(SPLIT, [0, 1, 0, 0]) == 3.0 and layer_extras(SPLIT, [1, 1, 0, 0]) == 0.0
    assert layer_extras(SPLIT, [0, DENSE, 0, 0]) == 0.0  # one launch, and this layer has no mix_cost
    assert Allocation([0, 1, DENSE, DENSE]).cost(SPLIT) == 2.0 + 2.0 + 3.0 + 20.0
    assert lagrangian_path(SPLIT)[0].choices[:2] == [1, 1]  # lam 0: the cheapest layer is one launch, not the own picks


@pytest.mark.parametrize("curves", [MIXED, MIX_PAYS, SPLIT], ids=["mixing never pays", "mixing pays", "launches priced"])
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0, 2.3, 4.0, 8.0, 12.0, 20.0, 60.0, 200.0])
def test_the_path_with_layer_extras_holds_the_optimum_and_cost_rises(curves, lam):
    path = lagrangian_path(curves)
    costs = [a.cost(curves) for a in path]
    assert costs == sorted(costs)
    best, score = brute_force_mixed(curves, lam)
    here = [a for a in path if a.lam <= lam][-1]
    # the grid between breakpoints is a sample: the point held for lam is optimal to within one grid step
    assert score(here.choices) == pytest.approx(best, rel=0.05)


def test_no_layer_mixes_where_mixing_costs_more_than_it_saves():
    for a in lagrangian_path(MIXED):
        for layer in (0, 1):
            kinds = {i == DENSE for c, i in zip(MIXED, a.choices) if c.layer == layer}
            assert len(kinds) == 1, (a.lam, a.choices)  # every head of a layer sparse, or every head dense
    # where head (0, 0) would be sparse alone, the reason says its layer is dense because of mixing
    reasons = [a.reasons[(0, 0)] for a in lagrangian_path(MIXED) if (0, 0) in a.reasons]
    assert any("mixing sparse and dense heads 3 ms" in r for r in reasons)


def test_a_layer_mixes_where_mixing_pays():
    mixed = [a.choices for a in lagrangian_path(MIX_PAYS) if a.choices[:2] in ([0, DENSE], [1, DENSE])]
    assert mixed  # head (0, 0) sparse, head (0, 1) dense: saving 4.0 - 3.0 at some lam


def test_the_cap_makes_a_mixed_layer_dense_when_mixing_costs_more_than_it_saves():
    # (0, 0) is within the cap at 8.0 of 10.0, (0, 1) is not: mixed, layer 0 costs 8 + 10 + 3 >= 20 dense
    a = cap_allocation(MIXED, 0.05)
    assert a.choices[:2] == [DENSE, DENSE] and "cost the layer 3 ms more than their shares" in a.reasons[(0, 0)]
    assert a.choices[2:] == [DENSE, DENSE]  # layer 1's candidates miss the cap anyway
    # with a mix the saving pays for ((0, 0) at 6.0: 6 + 10 + 3 < 20), the head stays sparse
    assert cap_allocation(MIX_PAYS, 0.05).choices[:2] == [1, DENSE]
    assert cap_allocation(MIXED, 0.35).choices == [DENSE, DENSE, 0, 0]  # a layer all within the cap is left alone
