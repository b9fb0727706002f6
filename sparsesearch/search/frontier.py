"""The exact lower-left frontier of (cost, error) allocations, not only its convex hull.

The Lagrangian path (targets.lagrangian_path) minimises cost + lam x error for each lam, so it visits only the
allocations on the convex hull of the (cost, error) set. Between two hull points the set can hold allocations
that no lam picks yet beat the straight line between them: on Gemma 3 270M at 16K (3 global layers of 4 heads,
RESULTS Run 36) the predicted path jumps from layer 17 alone on 64/512 windows (0.78 of dense, predicted KL 0.0065)
to layers 11 and 17 sparse (0.73, 0.021), skipping layer 17 alone on narrower windows, where DuoAttention 1/3 sits
(and a --target-kl between the two paid for the dearer one). Mixing prices make the set less convex still.

``exact_frontier`` finds every allocation on the frontier, as a multiple-choice knapsack by dynamic programming:
- per layer, the frontier of its heads' joint choices (candidates and dense), kept apart by regime (all sparse,
  all dense, mixed) until the layer's mix_cost is added to the mixed one (and, where the layer pays per launch,
  by how many candidates it launches: ``layer_frontier``);
- across layers, the running frontier combined with each layer's, pruned after every layer.
Costs are bucketed at ``BINS`` per all-dense cost (one allocation per bucket, the lowest error): the frontier has at
most that many points, and a point is at most 1/BINS of dense cost from the exact one.
"""

from __future__ import annotations

import numpy as np

from .targets import DENSE, Allocation, HeadCurve, _by_layer, _dense_reason, kl_model_curves, kl_model_path, predicted_kl

BINS = 4096  # cost buckets per all-dense cost: frontier resolution and size bound


def exact_frontier(curves: list[HeadCurve], bins: int = BINS) -> list[Allocation]:
    """The allocations on the (cost incl. mix_cost, sum of error) frontier, by rising cost and falling error; the
    first is the cheapest allocation, the last the lowest-error one at the least cost. ``lam`` is None on each."""
    step = sum(c.dense_cost for c in curves) / bins
    layers = _by_layer(curves)
    options = [layer_frontier([curves[k] for k in ks], step) for ks in layers]
    cost, err = np.zeros(1), np.zeros(1)
    back = []  # per layer: (index into the previous frontier, option index) of each point kept
    for opts in options:
        o_cost = np.array([o[0] for o in opts])
        o_err = np.array([o[1] for o in opts])
        c_all = (cost[:, None] + o_cost[None, :]).ravel()
        e_all = (err[:, None] + o_err[None, :]).ravel()
        keep = pareto_indices(c_all, e_all, step)
        back.append((keep // len(opts), keep % len(opts)))
        cost, err = c_all[keep], e_all[keep]
    return [Allocation(_choices(j, layers, options, back, len(curves))) for j in range(len(cost))]


def _choices(point: int, layers: list[list[int]], options: list[list[tuple]], back: list[tuple], n: int) -> list[int]:
    """One frontier point's choice per head (curve order), read back layer by layer from the last."""
    choices = [DENSE] * n
    for li in reversed(range(len(layers))):
        prev, opt = back[li][0][point], back[li][1][point]
        for k, choice in zip(layers[li], options[li][opt][2]):
            choices[k] = choice
        point = int(prev)
    return choices


def layer_frontier(layer: list[HeadCurve], step: float) -> list[tuple[float, float, tuple[int, ...]]]:
    """(cost, error sum, choice per head) on one layer's frontier, mix_cost included where heads mix and
    split_cost for each sparse candidate past the first (each its own launch: targets.layer_extra).

    Without a split_cost this is exact. With one, keeping every set of launches apart grows combinatorially
    (Gemma 3's 3 layers of 4 heads on 60 candidates: 126 s, against 0.02 s without), so partial layers are kept
    apart by how many launches they run, and each candidate's one-launch layers (every head on it or dense) are
    added whole; every point is priced exactly. Exact for layers of up to two heads (a partial point pruned for
    a cheaper, better one on another candidate loses to it again, or ends on its own candidate alone, which the
    one-launch layers hold); past two heads a split layer may be missed, never a one-launch one."""
    if layer[0].split_cost <= 0:
        points = _joint_points(layer, [[*c.usable(), DENSE] for c in layer], step)
    else:
        points = _joint_points(layer, [[*c.usable(), DENSE] for c in layer], step, by_launches=True)
        for i in set().union(*(c.usable() for c in layer)):
            points += _joint_points(layer, [[i, DENSE] if i in c.usable() else [DENSE] for c in layer], step)
    return _pareto_list(points, step)


def _joint_points(layer: list[HeadCurve], options: list[list[int]], step: float, by_launches: bool = False) -> list[tuple]:
    """The (cost, error sum, picks) frontier of the layer's heads over ``options`` (choice indices per head),
    extras included (targets.layer_extra): partial layers kept apart by (any sparse, any dense) and, with
    ``by_launches``, by the number of candidates launched so far, each point paying split_cost as it adds one."""
    split = layer[0].split_cost
    states: dict[tuple, list[tuple]] = {(False, False, 0): [(0.0, 0.0, ())]}
    for c, opts in zip(layer, options):
        grown: dict[tuple, list[tuple]] = {}
        for (sparse, dense, launches), points in states.items():
            for i in opts:
                o_cost, o_err = c.cost_of(i), c.error_of(i)
                for p_cost, p_err, p in points:
                    new = i != DENSE and i not in p
                    key = (sparse or i != DENSE, dense or i == DENSE, launches + new if by_launches else 0)
                    grown.setdefault(key, []).append((p_cost + o_cost + (split if new and sparse else 0.0), p_err + o_err, p + (i,)))
        states = {key: _pareto_list(points, step) for key, points in grown.items()}
    mix = layer[0].mix_cost
    return [(p_cost + (mix if sparse and dense else 0.0), p_err, p) for (sparse, dense, _), points in states.items()
            for p_cost, p_err, p in points]


def _pareto_list(points: list[tuple], step: float) -> list[tuple]:
    """``pareto_indices`` over (cost, error, ...) tuples."""
    if not points:
        return points
    keep = pareto_indices(np.array([p[0] for p in points]), np.array([p[1] for p in points]), step)
    return [points[i] for i in keep]


def pareto_indices(cost: np.ndarray, err: np.ndarray, step: float) -> np.ndarray:
    """Indices of the points left after keeping the lowest error per cost bucket (width ``step``; step <= 0: one
    bucket per distinct cost; the cheaper point on equal error) and dropping every point whose error is not
    below all cheaper buckets' — by rising cost."""
    buckets = np.floor(cost / step).astype(np.int64) if step > 0 else np.unique(cost, return_inverse=True)[1].reshape(-1)
    order = np.lexsort((cost, err, buckets))  # by bucket, then error, then cost
    first = np.ones(len(order), dtype=bool)
    first[1:] = buckets[order][1:] != buckets[order][:-1]
    best = order[first]  # one per bucket, buckets rising
    e = err[best]
    keep = np.ones(len(best), dtype=bool)
    keep[1:] = e[1:] < np.minimum.accumulate(e)[:-1]
    return best[keep]


def frontier_kl_path(curves: list[HeadCurve], sensitivity: dict[int, float], bins: int = BINS) -> tuple[list[Allocation], list[float]]:
    """``targets.kl_model_path`` with the exact frontier's points between the Lagrangian path's: every allocation on
    the (cost, predicted KL) frontier, by rising cost and falling predicted KL, ending all-dense; and the predicted
    KL of each. A hull point keeps its multiplier and reasons; a point between gets its own reasons."""
    path, predicted = kl_model_path(curves, sensitivity)
    model = kl_model_curves(curves, sensitivity)
    known = {tuple(a.choices) for a in path}
    extra = [a for a in exact_frontier(model, bins) if tuple(a.choices) not in known]
    for a in extra:
        a.reasons = {(c.layer, c.head): _between_reason(c, sensitivity[c.layer]) for c, i in zip(curves, a.choices) if i == DENSE}
    allocs = path[:-1] + extra
    kls = predicted[:-1] + [predicted_kl(model, a) for a in extra]
    # what the buckets let through and a cheaper point beats is off the frontier
    keep = pareto_indices(np.array([a.cost(curves) for a in allocs]), np.array(kls), 0.0).tolist()
    return [allocs[i] for i in keep] + [path[-1]], [kls[i] for i in keep] + [predicted[-1]]


def _between_reason(c: HeadCurve, sensitivity: float) -> str:
    return _dense_reason(c, f"layer {c.layer} costs {sensitivity:.3g} KL per squared output error: dense at this point of "
                            "the exact (cost, predicted KL) frontier, which no multiplier picks (between two of its hull points)")
