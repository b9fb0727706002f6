"""Algorithm 4 of paper 000 for one layer of a multi-modal sample.

1. intra-modality search: each modality's rows x its own keys (identity frame: our kernels, grid too);
2. cross-modality search: rows of a x keys of b for every ordered pair a != b, plus the row regions
   (a, all) of the Q-boundary and the key regions (all, b) of the K-boundary (patterns/boundary.py);
3. inter-modality choice per head: each boundary type's approximation is composed from the patterns
   chosen in its regions (partials merged by lse), scored against the dense attention of the whole
   sequence, and the head takes the best type within the budget.

Every region is searched by the same kernel-aware search as a text layer (search/layer.py, the objective
uses V). A region's rows and keys are gathered into contiguous copies and run by the same kernels with
the region frame (row_pos): measured on a GPU, modelled on a CPU. A type's cost is the sum of its picks'
costs, its budget the global region's (the target's cost on the whole sequence, plus slack).

Region budgets: the regions of one type partition the causal matrix and each region belongs to one type
only, so the global budget is split over a type's regions in proportion to the target's cost on each
(``region_budgets``): they sum to the global budget, and a type whose picks fit their regions fits it.
(The target's own cost on each region, the earlier rule, re-applies its sink and window once per key
modality and rounds blocks per region: on the planted 2D layouts the four 2D regions' budgets summed to
1.6x the global one, so picks that fit their regions came out over the type's budget and 2D lost.)
No region carries the dense fallback of search/layer.py ``choose``: a region's output error is relative
to its own rows' share of the attention, which can be small, and a head the global patterns fail may be
served by a boundary type (a dense global pick, exact and first in the type order, would take every such
head). The types are judged by the composed error against the whole sequence's dense attention; a
"keep dense" outcome for multi-modal heads needs a dense type in the artifact's boundary rows (not here).


Choice rule: the types are tried in order none, k, q, 2d (the runtime cost of the permutations grows in
that order; paper 000 B.1: none and K cost nothing beyond intra-modality attention). A head takes the
first admissible type whose objective is within ``tolerance`` of the best admissible one — a more
complex boundary has to earn its place.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..execute import HeadGroup, run_region
from ..patterns import boundary as bd
from ..patterns._common import causal_entries
from .cost import CostModel
from .layer import Scored, Timings, _sync, choose, output_error, score_layer, space_reference, target_cost
from .space import SearchSpace

TOLERANCE = 0.05  # relative slack on the objective before a simpler boundary type loses to a complex one
ABS_TOLERANCE = 1e-4  # ... and an absolute one, for errors near zero


@dataclass
class ScopeResult:
    """One region's search: scored candidates, budget per head, timings."""

    scored: list[Scored]
    budget: torch.Tensor
    timings: Timings


def needed_scopes(space: SearchSpace, present: list[str]) -> list[tuple[str, str]]:
    """(q_mod, k_mod) of every region to search: the global one, each intra region (Alg. 4 step 1), and
    the regions of every boundary type the space allows. Ordered, without repeats."""
    scopes = [(bd.ALL, bd.ALL)] + [(m, m) for m in present]
    for kind in space.boundaries:
        scopes += [s for s in bd.region_scopes(kind, present) if s not in scopes]
    return scopes


def region_budgets(q, k, v, pos: dict, present: list[str], space: SearchSpace, costs: CostModel, whole: torch.Tensor, *,
                   head_space: str, scale: float) -> dict[str, torch.Tensor]:
    """{region name: float64 [H] ms} for every region of the space's boundary types but the global one:
    the global budget ``whole`` split over each type's regions in proportion to the target's cost there."""
    budgets = {}
    for kind in space.boundaries:
        regions = [r for r in (bd.make_region(a, b, pos) for a, b in bd.region_scopes(kind, present)) if r is not None]
        regions = [r for r in regions if r.name != bd.scope_name(bd.ALL, bd.ALL)]
        if not regions:
            continue
        costs_r = []
        for region in regions:
            q_r, k_r, v_r = region.gather(q, k, v)
            costs_r.append(target_cost(q_r, k_r, v_r, space, head_space, scale, costs, region.row_pos))
        total = torch.stack(costs_r).sum(0).clamp_min(1e-30)
        budgets.update({r.name: whole * c / total for r, c in zip(regions, costs_r)})
    return budgets


def search_scope(
    q, k, v, region: bd.Region, space: SearchSpace, costs: CostModel, *, head_space: str, present: list[str],
    frame_stride: int | None, scale: float, reference=None, budget: torch.Tensor | None = None,
) -> ScopeResult:
    """Kernel-aware search of one region (q/k/v: the whole layer, [1, H, N, D]; reference: the region's
    dense (out, lse) when already computed; budget: float64 [H], ``region_budget``, None for the global
    region, whose budget is the target's cost)."""
    q_r, k_r, v_r = region.gather(q, k, v)
    # Grid applicability follows the region's keys: a visual modality's own rows and keys only.
    modality = region.k_mod if region.k_mod != bd.ALL else ("video" if "video" in present else present[-1])
    scored, budget, timings = score_layer(q_r, k_r, v_r, space, costs, head_space=head_space, modality=modality,
                                          frame_stride=frame_stride, scale=scale, row_pos=region.row_pos, reference=reference,
                                          budget=budget, dense_fallback=False)
    return ScopeResult(scored, budget, timings)


def run_picks(q, k, v, region: bd.Region, picks: list[tuple[Scored, int]], head_space: str, block_m: int, block_n: int,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The region's attention with each head's chosen candidate: heads sharing (pattern, params) run as one
    group (execute.run_region). Returns out [1, Hq, Nq_r, D] and lse fp32 [1, Hq, Nq_r]."""
    groups: dict[tuple, list[int]] = {}
    for scored, head in picks:
        groups.setdefault((scored.candidate.pattern, scored.params[head]), []).append(head)
    heads = [HeadGroup(pattern, params, tuple(ids), block_m, block_n) for (pattern, params), ids in groups.items()]
    return run_region(q, k, v, region, heads, head_space, scale)


def pick_cost(picks: list[tuple[Scored, int]]) -> torch.Tensor:
    """Cost per head (float64 [H]) of the picks: each candidate's cost on its region (measured on a GPU,
    modelled on a CPU — the same scale as the global region's budget)."""
    return torch.tensor([float(s.cost_ms[h]) for s, h in picks], dtype=torch.float64)


def boundary_scores(
    q, k, v, modality: torch.Tensor, names: tuple[str, ...], results: dict[str, ScopeResult], space: SearchSpace, *,
    head_space: str, objective: str, scale: float, reference: tuple[torch.Tensor, torch.Tensor],
) -> dict:
    """Compose each boundary type from its regions' chosen patterns and score it against the dense
    attention of the whole sequence (``reference``: its out, lse). Returns {"budget_ms": [H], "types":
    {type: {"error", "recall", "cost_ms", "density": [H]}}} (density: computed entries of all its regions
    over the sequence's causal entries)."""
    n = q.shape[2]
    group = q.shape[1] // k.shape[1]
    ref_out, ref_lse = reference
    pos = bd.positions(modality, names)
    present = [m for m in names if m in pos]
    cache: dict[str, tuple] = {}
    types = {}
    total = causal_entries(n)
    for kind in space.boundaries:
        parts, cost, entries = [], None, None
        for q_mod, k_mod in bd.region_scopes(kind, present):
            region = bd.make_region(q_mod, k_mod, pos)
            if region is None:
                continue
            res = results[region.name]
            picks = choose(res.scored, res.budget, objective)
            if region.name not in cache:
                cache[region.name] = run_picks(q, k, v, region, picks, head_space, space.block_m, space.block_n, scale)
            parts.append((region, *cache[region.name]))
            c = pick_cost(picks)
            cost = c if cost is None else cost + c
            e = torch.tensor([float(s.density[h]) * region.causal_entries for s, h in picks], dtype=torch.float64)
            entries = e if entries is None else entries + e
        out, lse = bd.compose(parts, n)
        error, recall = output_error(out, lse, ref_out, ref_lse, head_space, group)
        types[kind] = {"error": error.tolist(), "recall": recall.tolist(), "cost_ms": cost.tolist(), "density": (entries / total).tolist()}
    # The budget of the whole sequence is the global region's: the target's cost there, plus slack.
    return {"budget_ms": results[bd.scope_name(bd.ALL, bd.ALL)].budget.tolist(), "types": types}


def choose_boundary(types: dict[str, dict], budget: list[float], objective: str, order: tuple[str, ...] = bd.BOUNDARIES,
                    tolerance: float = TOLERANCE) -> list[str]:
    """Per head: the first type (in ``order``) among the admissible ones (cost <= budget) whose objective is
    within tolerance of the best admissible; the cheapest type when none is admissible."""
    kinds = [t for t in order if t in types]
    heads = len(budget)
    chosen = []
    for h in range(heads):
        ok = [t for t in kinds if types[t]["cost_ms"][h] <= budget[h]]
        if not ok:
            chosen.append(min(kinds, key=lambda t: types[t]["cost_ms"][h]))
            continue
        if objective == "output_error":
            best = min(types[t]["error"][h] for t in ok)
            good = [t for t in ok if types[t]["error"][h] <= best * (1 + tolerance) + ABS_TOLERANCE]
        else:
            best = max(types[t]["recall"][h] for t in ok)
            good = [t for t in ok if types[t]["recall"][h] >= best * (1 - tolerance) - ABS_TOLERANCE]
        chosen.append(good[0])
    return chosen


def search_modal_layer(
    q, k, v, modality: torch.Tensor, names: tuple[str, ...], space: SearchSpace, costs: CostModel, *, head_space: str,
    objective: str, frame_stride: int | None = None, scale: float | None = None, cached: dict[str, ScopeResult] | None = None,
    on_scope=None,
) -> tuple[dict[str, ScopeResult], dict]:
    """All three steps for one layer. q [1, Hq, N, D], k/v [1, Hkv, N, D], modality int [N].

    cached: scope results already on disk (resume); on_scope(name, result) is called as each region
    finishes. Returns ({scope name: ScopeResult}, boundary scores — see ``boundary_scores``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pos = bd.positions(modality, names)
    present = [m for m in names if m in pos]
    results = dict(cached or {})
    # The whole sequence's dense attention, computed once: the global region's search and the boundary
    # scores both measure against it.
    start = time.perf_counter()
    reference = space_reference(q, k, v, space, head_space, scale)
    _sync(q)
    reference_s = time.perf_counter() - start
    whole = bd.scope_name(bd.ALL, bd.ALL)
    budgets = None
    for q_mod, k_mod in needed_scopes(space, present):  # the global region first: the others share its budget
        region = bd.make_region(q_mod, k_mod, pos)
        if region is None or region.name in results:
            continue
        if region.name != whole and budgets is None:
            budgets = region_budgets(q, k, v, pos, present, space, costs, results[whole].budget, head_space=head_space, scale=scale)
        budget = None if region.name == whole else budgets[region.name]
        results[region.name] = search_scope(q, k, v, region, space, costs, head_space=head_space, present=present,
                                            frame_stride=frame_stride, scale=scale,
                                            reference=reference if region.name == whole else None, budget=budget)
        if region.name == whole:
            results[whole].timings.kernel_s += reference_s  # its search's share of the dense pass
        if on_scope is not None:
            on_scope(region.name, results[region.name])
    scores = boundary_scores(q, k, v, modality, names, results, space, head_space=head_space, objective=objective, scale=scale,
                             reference=reference)
    return results, scores
