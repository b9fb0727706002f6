"""The exact (cost, error) frontier of allocations: every point brute force finds, including those between the
Lagrangian path's hull points, and the --target-kl path built on it."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from sparsesearch.search.frontier import exact_frontier, frontier_kl_path, pareto_indices
from sparsesearch.search.targets import DENSE, Allocation, HeadCurve, lagrangian_path, search_target


def _error(curves, choices) -> float:
    return sum(c.error_of(i) for c, i in zip(curves, choices))


def _brute(curves) -> list[tuple[float, float]]:
    """Every allocation's (cost, error), reduced to the strictly-falling frontier by rising cost."""
    options = [c.usable() + [DENSE] for c in curves]
    points = sorted((Allocation(list(ch)).cost(curves), _error(curves, ch)) for ch in itertools.product(*options))
    out = []
    for cost, err in points:
        if not out or err < out[-1][1] - 1e-12:
            out.append((cost, err))
    return out


def _random_curves(rng: random.Random, layers=3, heads=2, candidates=3, split=False) -> list[HeadCurve]:
    curves = []
    for layer in range(layers):
        mix = rng.choice([0.0, rng.uniform(0.5, 3.0)])
        per_launch = rng.choice([0.0, rng.uniform(0.3, 2.0)]) if split else 0.0
        for head in range(heads):
            cost = tuple(rng.uniform(0.5, 9.5) for _ in range(candidates))
            error = tuple(rng.uniform(0.0, 0.6) for _ in range(candidates))
            curves.append(HeadCurve(layer, head, cost, error, 10.0, mix_cost=mix, split_cost=per_launch))
    return curves


@pytest.mark.parametrize("seed, launches", [(s, False) for s in range(12)] + [(100 + s, True) for s in range(8)])
def test_exact_frontier_is_the_brute_force_frontier(seed, launches):
    # with launch prices (split_cost) exact up to two heads a layer (frontier.layer_frontier)
    kw = dict(heads=2, candidates=4, split=True) if launches else {}
    curves = _random_curves(random.Random(seed), **kw)
    got = [(a.cost(curves), _error(curves, a.choices)) for a in exact_frontier(curves, bins=10**7)]
    want = _brute(curves)
    assert len(got) == len(want)
    assert [x for p in got for x in p] == pytest.approx([x for p in want for x in p])


@pytest.mark.parametrize("seed", range(6))
def test_with_launch_prices_every_one_launch_layer_is_held_past_two_heads(seed):
    # one layer of 4 heads: every allocation whose heads run as one launch is on the frontier or beaten by a point
    # of it
    curves = _random_curves(random.Random(200 + seed), layers=1, heads=4, candidates=4, split=True)
    got = [(a.cost(curves), _error(curves, a.choices), a.choices) for a in exact_frontier(curves, bins=10**7)]
    options = [c.usable() + [DENSE] for c in curves]
    one_launch = [ch for ch in itertools.product(*options) if len(set(ch) - {DENSE}) <= 1]
    for ch in one_launch:
        cost, err = Allocation(list(ch)).cost(curves), _error(curves, ch)
        assert any(c <= cost + 1e-9 and e <= err + 1e-12 for c, e, _ in got), ch
    # the frontier's points run in rising cost and falling error at their true prices
    assert [c for c, _, _ in got] == sorted(c for c, _, _ in got) and [e for _, e, _ in got] == sorted((e for _, e, _ in got), reverse=True)


def test_coarse_buckets_stay_within_one_bucket_per_layer_of_every_frontier_point():
    curves = _random_curves(random.Random(7), layers=3, heads=3)
    bins = 64
    step = sum(c.dense_cost for c in curves) / bins
    got = [(a.cost(curves), _error(curves, a.choices)) for a in exact_frontier(curves, bins=bins)]
    assert len(got) <= bins + 1
    for cost, err in _brute(curves):
        # some kept point is at most one bucket dearer per layer and no worse
        assert any(c <= cost + 3 * step + 1e-9 and e <= err + 1e-12 for c, e in got)


def test_a_layer_on_one_candidate_beats_cheaper_looking_shares_that_need_several_launches():
    # per-head shares say heads on candidates 0 and 1 cost 2 + 2; run as two launches they cost 2 + 2 + 3 = 7,
    # more than both heads on candidate 2 (3 + 3, one launch) at a lower error
    curves = [HeadCurve(0, h, (2.0, 2.0, 3.0) if h == 0 else (9.0, 2.0, 3.0), (0.2, 0.3, 0.1) if h == 0 else (0.3, 0.2, 0.1),
                        10.0, split_cost=3.0) for h in (0, 1)]
    points = {tuple(a.choices): a.cost(curves) for a in exact_frontier(curves, bins=10**6)}
    assert (0, 1) not in points and points[(2, 2)] == pytest.approx(6.0)
    assert Allocation([0, 1]).cost(curves) == pytest.approx(7.0)
    free = [replace(c, split_cost=0.0) for c in curves]  # without the price the split layer is the frontier's cheapest
    assert (0, 1) in {tuple(a.choices) for a in exact_frontier(free, bins=10**6)}


def test_the_frontier_holds_what_the_hull_skips():
    # layer 0 jumps (cost 1 -> 6), layer 1 is gradual: no multiplier picks "layer 0 dear, layer 1 cheap" (cost 8)
    curves = [HeadCurve(0, 0, (1.0, 6.0), (0.5, 0.05), 10.0), HeadCurve(1, 0, (2.0, 4.0), (0.3, 0.1), 10.0)]
    hull = {tuple(a.choices) for a in lagrangian_path(curves)}
    frontier = [tuple(a.choices) for a in exact_frontier(curves)]
    assert (1, 0) in frontier and (1, 0) not in hull and hull - {(DENSE, DENSE)} <= set(frontier)


def test_the_target_path_meets_a_target_between_hull_points_at_the_cheaper_point():
    # predicted KL = error^2 (sensitivity 1): the shares are the example above's errors, so "layer 0 on its dear
    # candidate, layer 1 on its cheap one" (cost 8, KL 0.35) is off the predicted hull
    root = lambda *xs: tuple(x ** 0.5 for x in xs)
    curves = [HeadCurve(0, 0, (1.0, 6.0), root(0.5, 0.05), 10.0), HeadCurve(1, 0, (2.0, 4.0), root(0.3, 0.1), 10.0)]
    sens = {0: 1.0, 1: 1.0}
    path, predicted = frontier_kl_path(curves, sens)
    assert path[-1].choices == [DENSE, DENSE] and predicted[-1] == 0
    assert all(a < b for a, b in zip(predicted[1:], predicted))  # falling along the path
    costs = [a.cost(curves) for a in path]
    assert costs == sorted(costs)
    kl = lambda a: sum(c.error_of(i) ** 2 for c, i in zip(curves, a.choices))
    found = search_target(path, kl, 0.36, predicted=predicted)
    chosen = path[found.chosen]
    assert chosen.choices == [1, 0] and chosen.cost(curves) == pytest.approx(8.0)  # the hull's answer costs 10
    assert chosen.lam is None  # no multiplier picks it
    between = next(a for a in path if a.choices == [DENSE, 1])  # also off the hull: cost 14, KL 0.1
    assert "exact (cost, predicted KL) frontier" in between.reasons[(0, 0)]


def test_pareto_indices_keep_the_lowest_error_per_bucket_and_drop_dominated_points():
    import numpy as np

    cost = np.array([1.0, 1.2, 2.0, 3.0, 3.5])
    err = np.array([0.5, 0.4, 0.45, 0.1, 0.2])
    assert pareto_indices(cost, err, 1.0).tolist() == [1, 3]  # 1.2 beats 1.0 in its bucket; 2.0 and 3.5 are beaten


def test_pareto_indices_without_buckets_keep_every_distinct_cost():
    import numpy as np

    cost = np.array([3.0, 1.0, 1.0, 2.0, 2.5])
    err = np.array([0.1, 0.5, 0.4, 0.45, 0.3])
    assert pareto_indices(cost, err, 0.0).tolist() == [2, 4, 0]  # 2.0 is beaten by 1.0's 0.4
