"""Kernel-aware per-head search for one layer (paper 000 Alg. 4, KernelAwareSearch).

For one layer's post-RoPE q [1, Hq, N, D], k/v [1, Hkv, N, D] of a calibration sample:
1. the dense output and lse come from the same kernels with an all-causal index (no n x n matrix);
2. every candidate of the search space is resolved at length N, its index built for all heads at once
   (one build, one launch through sparsesearch/execute.py, the runtime's own path) and scored per head:
   relative L2 error of the attention output (this is where V enters) and the attention mass kept, exp(lse_sparse − lse_dense);
3. each candidate's cost per head comes from the cost model (measured kernel time on a GPU, an analytic
   FLOP model on a CPU); candidates above the target's cost x (1 + slack) are pruned;
4. each head takes the admissible candidate with the best objective (``choose``: near-ties go to the
   cheaper candidate, then to a fixed order of kinds); a head whose best admissible candidate still has an
   output error above ``max_error`` keeps dense attention (the dense entry every scored list carries:
   error 0, recall 1, costed like a candidate), and says so.

A triangle candidate is scored as the runtime runs it (execute.attend_triangle): its streaming index,
then every causal key for the last rows, so its recall, density and error count the dense tail.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..artifacts.columns import row_from_params
from ..execute import HeadGroup, build_group_index, device_ids, grid_form, query_heads, sparse_attend
from ..index import BlockIndex, GridLines
from ..patterns import grid, index_entries
from ..patterns import triangle
from ..patterns._common import causal_entries, region_causal_entries
from ..patterns.boundary import split_scope
from ..patterns.dense import DenseParams
from ..patterns.registry import REGISTRY
from .cost import CostModel, analytic_ms
from .space import Candidate, SearchSpace

OBJECTIVES = ("output_error", "mass_recall")
GRID_LINES = "grid_lines"  # the cost model's name for a grid launch read in place (execute.grid_form)
# A head whose best admissible sparse candidate errs by more than this (relative L2 of the attention
# output) keeps dense attention: at 0.5 half the output's norm is wrong; the dense-like heads came
# out at 0.7-0.9 with every candidate, planted sparse heads below 0.1.
MAX_ERROR = 0.5
# Score a candidate that lists every causal block (and masks no tokens) from the dense reference instead of
# running it (score_candidate); a switch so that tests can compare it with the run.
_DENSE_COVER = True
# Objectives this close count as equal (0.1% of the output norm plus 5%, as the boundary choice's
# tolerance): the cheaper candidate wins, then the earlier kind of KIND_ORDER. Precisely: candidate c ties
# the best admissible objective b when objective(c) <= b + TIE_ABS + TIE_REL x |b| (objectives as losses,
# ``_rank``). Where a candidate of another kind ties the pick, the head's row records that kind
# (``choose_head``'s tie, heads.parquet ``tie``): the pick then won on cost, not on quality, so the
# kind is a coin toss between the two; at ~zero error (planted A-shape heads that a vertical-slash
# candidate also holds) every kind that keeps the mass ties within TIE_ABS.
TIE_ABS, TIE_REL = 1e-3, 0.05
DENSE = Candidate("dense", {})  # the fallback entry of every scored list
# Fixed order of kinds for ties at equal cost: static before dynamic (no estimate at run time; the
# registry's DYNAMIC fact), then registry order (ashape, triangle, grid, vertical_slash, block_topk).
KIND_ORDER = tuple(sorted((name for name in REGISTRY if name != DENSE.pattern), key=lambda name: REGISTRY[name].DYNAMIC))


@dataclass
class Scored:
    """One candidate's per-head results (tensors over the heads of the head space, on the CPU)."""

    candidate: Candidate
    params: list  # params dataclass per head
    error: torch.Tensor
    recall: torch.Tensor
    density: torch.Tensor
    cost_ms: torch.Tensor


@dataclass
class Timings:
    index_s: float = 0.0
    kernel_s: float = 0.0
    objective_s: float = 0.0

    def add(self, other: "Timings") -> None:
        self.index_s += other.index_s
        self.kernel_s += other.kernel_s
        self.objective_s += other.objective_s


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def head_density(index: BlockIndex, n: int, kv_len: int | None = None, row_pos: torch.Tensor | None = None,
                 tail: int = 0, lines: GridLines | None = None) -> torch.Tensor:
    """Computed fraction of the causal matrix (of a region's, with row_pos), per index head: float64 [H].
    tail: last rows computed densely besides the index (a triangle's), whose index entries do not count.
    lines: a grid read in place (execute.grid_form), whose line columns and line rows count too."""
    total = causal_entries(n, kv_len) if row_pos is None else region_causal_entries(row_pos)
    split = n - tail
    line_entries = 0 if lines is None else lines.entries(index.block_m)  # the same for every head
    out = []
    for h in range(index.heads):
        one = BlockIndex(
            index.full_count[:, h : h + 1], index.full_idx[:, h : h + 1], index.partial_count[:, h : h + 1],
            index.partial_idx[:, h : h + 1], index.block_m, index.block_n, index.head_space,
            None if index.col_count is None else index.col_count[:, h : h + 1],
            None if index.col_idx is None else index.col_idx[:, h : h + 1], index.window, index.sink,
        )
        entries = index_entries(one, n, kv_len, row_pos=row_pos, row_stop=split if tail else None)
        entries += line_entries
        out.append((entries + causal_entries(n, kv_len, row_start=split)) / max(1, total))
    return torch.tensor(out, dtype=torch.float64)


def dense_reference(q, k, v, space: str, block: int, scale: float, row_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal (out, lse): out [1, Hq, Nq, D], lse fp32 [1, Hq, Nq]. On a GPU through our kernel with an
    all-causal index; on a CPU through torch's own flash kernel (which also returns lse, ~5x faster here
    than the index-driven torch backend on a dense index). A permuted region (row_pos) takes the torch
    reference path with its dense index, blockwise."""
    cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if row_pos is None and not q.is_cuda and cpu_flash is not None:
        group = q.shape[1] // k.shape[1]
        # The CPU op has no GQA mode; K/V are repeated for this one reference call (not a kernel path).
        k_rep, v_rep = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
        out, lse = cpu_flash(q, k_rep, v_rep, 0.0, True, scale=scale)[:2]
        return out, lse.float()
    heads = k.shape[1] if space == "kv" else q.shape[1]
    g = HeadGroup("dense", DenseParams(), tuple(range(heads)), block, block)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    ids = torch.arange(heads, dtype=torch.int32, device=q.device)
    sparse_attend(q, k, v, build_group_index(g, q, k, space, row_pos), scale, ids, out, lse, row_pos)
    return out, lse


def space_reference(q, k, v, space: SearchSpace, head_space: str, scale: float, row_pos: torch.Tensor | None = None):
    """``dense_reference`` with the search space's block size (64 when block_m != block_n)."""
    block = space.block_m if space.block_m == space.block_n else 64
    return dense_reference(q, k, v, head_space, block, scale, row_pos)


def _per_space_head(x: torch.Tensor, space: str, group: int) -> torch.Tensor:
    """[Hq] per-query-head sums -> [H] per head of the space (a KV head sums its group)."""
    return x.view(-1, group).sum(-1) if space == "kv" else x


def score_candidate(
    candidate: Candidate, resolved, q, k, v, ref_out, ref_lse, space: str, block_m: int, block_n: int,
    scale: float, costs: CostModel, timings: Timings, budget: torch.Tensor | None = None, row_pos: torch.Tensor | None = None,
) -> Scored:
    """Build, cost, run and score one candidate for every head of the layer (or of one permuted region,
    row_pos given: q are its rows, k/v its keys).

    Pruning comes first: the index alone gives each head's cost, and heads over `budget` are not run —
    when no head is within budget the candidate's attention is never computed (error inf, recall 0).
    With ref_out None only the cost is wanted (the target pattern)."""
    n, q_heads, kv_heads = q.shape[2], q.shape[1], k.shape[1]
    kv_len = k.shape[2]
    group = q_heads // kv_heads
    heads = kv_heads if space == "kv" else q_heads
    groups = _head_groups(candidate, resolved, q, k, space, heads, block_m, block_n)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    density = torch.zeros(heads, dtype=torch.float64)
    cost = torch.zeros(heads, dtype=torch.float64)
    params = [None] * heads
    ran = torch.zeros(heads, dtype=torch.bool)
    for g in groups:
        start = time.perf_counter()
        lines = None
        if g.pattern == "grid" and row_pos is None:
            # The form the runtime runs (lines read in place where they compute less), so scored = run.
            index, lines = grid_form(g, n, kv_len, space, q.device, batch=q.shape[0])
        else:
            index = build_group_index(g, q, k, space, row_pos)
        _sync(q)
        build_s = time.perf_counter() - start
        timings.index_s += build_s
        ids = torch.tensor(g.heads, dtype=torch.int32, device=q.device)
        dens = head_density(index, n, kv_len, row_pos, tail=_dense_tail(g, n), lines=lines)
        density[list(g.heads)] = dens
        run = lambda: _attend(g, index, q, k, v, scale, ids, out, lse, space, row_pos, lines)  # noqa: B023 (called at once)
        if row_pos is not None and costs.kind == "analytic":  # the model counts a region's own entries
            cost[list(g.heads)] = analytic_ms(g.pattern, dens * region_causal_entries(row_pos), q.shape[-1], kv_len)
        else:
            # The lines form is its own launch family in the cost table (its line columns and rows are
            # work that the plain cover's block counts do not describe).
            build = lambda: build_group_index(g, q, k, space, row_pos)  # noqa: B023 (a dynamic index's rebuild, timed at once)
            cost[list(g.heads)] = costs.cost_ms(GRID_LINES if lines is not None else g.pattern, dens, kv_len, q, index, run, build_s,
                                                build=build if lines is None else None)
        for h in g.heads:
            params[h] = g.params
        within = budget is None or bool((cost[list(g.heads)] <= budget[list(g.heads)]).any())
        if ref_out is None or not within:
            continue
        start = time.perf_counter()
        if _DENSE_COVER and lines is None and row_pos is None and index.window < 0 and bool((dens >= 1.0 - 1e-9).all()):
            # Every causal block listed and no token-level window in the partial ones (density counts blocks:
            # an A-shape's partial blocks mask tokens): the output is dense attention's, which the reference
            # holds already (at 4K, 7 of the bundled space's 9 vertical-slash candidates cover every block).
            qh = device_ids(tuple(query_heads(g.heads, space, group)), q.device)
            out[:, qh], lse[:, qh] = ref_out[:, qh].to(out.dtype), ref_lse[:, qh]
        else:
            run()
            _sync(q)
        timings.kernel_s += time.perf_counter() - start
        ran[list(g.heads)] = True
    if ref_out is None or not bool(ran.any()):
        inf = torch.full((heads,), float("inf"), dtype=torch.float64)
        return Scored(candidate, params, inf, torch.zeros(heads, dtype=torch.float64), density, cost)
    start = time.perf_counter()
    error, recall = output_error(out, lse, ref_out, ref_lse, space, group)
    error[~ran], recall[~ran] = float("inf"), 0.0  # heads of groups that were pruned
    timings.objective_s += time.perf_counter() - start
    return Scored(candidate, params, error, recall, density, cost)


def _dense_tail(g: HeadGroup, n: int) -> int:
    """Last rows a group computes densely besides its index: a triangle's ``last`` rows, else 0."""
    return n - triangle.split_row(g.params, n) if g.pattern == "triangle" else 0


def _attend(g: HeadGroup, index: BlockIndex, q, k, v, scale: float, ids: torch.Tensor, out, lse, space: str,
            row_pos: torch.Tensor | None, lines: GridLines | None = None) -> None:
    """One group's attention into out [1, Hq, N, D] / lse [1, Hq, N], as the runtime runs it: the index,
    and for a triangle its last rows over every causal key (execute.attend_triangle's split), here through
    the same kernels with a dense index over those rows so that their lse comes back too."""
    sparse_attend(q, k, v, index, scale, ids, out, lse, row_pos, lines=lines)
    tail = _dense_tail(g, q.shape[2])
    if not tail:
        return
    n = q.shape[2]
    rows = q[:, :, n - tail:].contiguous()
    dense = HeadGroup("dense", DenseParams(), g.heads, g.block_m, g.block_n)
    tail_out = torch.empty_like(rows)
    tail_lse = torch.empty(rows.shape[:3], dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    sparse_attend(rows, k, v, build_group_index(dense, rows, k, space), scale, ids, tail_out, tail_lse)
    q_ids = torch.tensor(query_heads(g.heads, space, group), device=q.device)
    out[:, q_ids, n - tail:] = tail_out[:, q_ids]
    lse[:, q_ids, n - tail:] = tail_lse[:, q_ids]


def output_error(out, lse, ref_out, ref_lse, space: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head of the space (float64 [H], CPU): relative L2 error of out [1, Hq, N, D] against the dense
    ref_out, and the attention mass kept, mean over rows of exp(lse - ref_lse) (rows the dense attention
    gives no key, lse -inf on both sides, count as kept)."""
    diff = (out.float() - ref_out.float()).pow(2).sum(dim=(0, 2, 3))
    norm = ref_out.float().pow(2).sum(dim=(0, 2, 3))
    error = (_per_space_head(diff, space, group) / _per_space_head(norm, space, group).clamp_min(1e-30)).sqrt()
    kept = torch.exp((lse - ref_lse).clamp(max=0.0)).nan_to_num(1.0).mean(dim=(0, 2))
    recall = _per_space_head(kept, space, group) / (group if space == "kv" else 1)
    return error.double().cpu(), recall.double().cpu()


def _head_groups(candidate, resolved, q, k, space, heads, block_m, block_n) -> list[HeadGroup]:
    """Static/dynamic candidates: one group of all heads. Grid with an estimated stride: heads grouped by
    their own (stride, phase) from the online estimate (paper 000 Alg. 1)."""
    if not (isinstance(resolved, tuple) and resolved[0] == "estimate"):
        return [HeadGroup(candidate.pattern, resolved, tuple(range(heads)), block_m, block_n)]
    values = {k: v for k, v in resolved[1].items() if k not in ("stride", "phase")}  # estimated below
    strides = [s for s in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if s < q.shape[2] // 2] or [2]
    stride, phase, _ = grid.estimate_stride_phase(q, k, strides, head_space=space)
    by_params: dict = {}
    for h in range(heads):
        p = grid.GridParams(stride=int(stride.flatten()[h]), phase=int(phase.flatten()[h]), **values)
        by_params.setdefault(p, []).append(h)
    return [HeadGroup("grid", p, tuple(hs), block_m, block_n) for p, hs in by_params.items()]


def _rank(s: Scored, h: int, objective: str) -> float:
    """The head's objective as a loss (lower is better)."""
    return float(s.error[h]) if objective == "output_error" else -float(s.recall[h])


def _kind_rank(s: Scored) -> int:
    return KIND_ORDER.index(s.candidate.pattern) if s.candidate.pattern in KIND_ORDER else len(KIND_ORDER)


def choose_head(scored: list[Scored], budget: torch.Tensor, h: int, objective: str,
                max_error: float = MAX_ERROR) -> tuple[Scored, str | None, str | None]:
    """Head h's pick; when it is not the best admissible sparse candidate, why (else None); and the kind
    that tied it (else None).

    Among the admissible sparse candidates (cost <= budget) those whose objective is within TIE_ABS +
    TIE_REL x |best| of the best tie; of those the cheapest wins, then the earlier kind of KIND_ORDER,
    then search-space order, and the best of the tied candidates of another kind is the tie (``_tie``).
    With none admissible the cheapest candidate is taken (unrun when it was pruned: error inf). An
    admissible pick whose output error exceeds max_error gives way to the dense entry (when the list has
    one, see ``score_layer``). Neither of those two has a tie: no cost decided between equals."""
    sparse = [s for s in scored if s.candidate.pattern != DENSE.pattern]
    dense = next((s for s in scored if s.candidate.pattern == DENSE.pattern), None)
    if not sparse:  # a space of dense alone
        return dense, None, None
    cost = lambda s: float(s.cost_ms[h])  # noqa: E731
    admissible = [s for s in sparse if cost(s) <= float(budget[h])]
    if not admissible:
        return min(sparse, key=lambda s: (cost(s), _kind_rank(s))), "no candidate within budget: the cheapest", None
    best = min(_rank(s, h, objective) for s in admissible)
    tied = [s for s in admissible if _rank(s, h, objective) <= best + TIE_ABS + TIE_REL * abs(best)]
    pick = min(tied, key=lambda s: (cost(s), _kind_rank(s)))  # min keeps search-space order on full ties
    error = float(pick.error[h])
    if dense is not None and not error <= max_error:
        why = f"dense: the best admissible sparse candidate ({pick.candidate.pattern}) has output error {error:.3g} > max_error {max_error:g}"
        return dense, why, None
    return pick, None, _tie(pick, tied, h, objective)


def _tie(pick: Scored, tied: list[Scored], h: int, objective: str) -> str | None:
    """The pattern of the best candidate of another kind among ``tied`` (objective, then cost, then
    KIND_ORDER), or None when every tied candidate is of the pick's kind."""
    others = [s for s in tied if s.candidate.pattern != pick.candidate.pattern]
    if not others:
        return None
    return min(others, key=lambda s: (_rank(s, h, objective), float(s.cost_ms[h]), _kind_rank(s))).candidate.pattern


def choose(scored: list[Scored], budget: torch.Tensor, objective: str, max_error: float = MAX_ERROR) -> list[tuple[Scored, int]]:
    """Per head: ``choose_head``'s pick. Returns (scored, head) pairs."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return [(choose_head(scored, budget, h, objective, max_error)[0], h) for h in range(budget.numel())]


def target_cost(q, k, v, space: SearchSpace, head_space: str, scale: float, costs: CostModel, row_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The space's target pattern's cost per head on these inputs (float64 [H], ms): modelled on a CPU,
    timed on a GPU (the only run)."""
    n = k.shape[2]
    s = score_candidate(space.target, space.resolve(space.target, n), q, k, v, None, None, head_space,
                        space.block_m, space.block_n, scale, costs, Timings(), row_pos=row_pos)
    return s.cost_ms


def dense_scored(q, k, v, space: SearchSpace, head_space: str, scale: float, costs: CostModel, row_pos: torch.Tensor | None = None,
                 candidate: Candidate = DENSE) -> Scored:
    """The dense entry (the fallback, or ``candidate``: a space's own dense entry): error 0, recall 1,
    density and cost of the dense index (costed like a candidate: timed on a GPU, modelled on a CPU); its
    output is the reference, so it is neither run nor pruned."""
    s = score_candidate(DENSE, DenseParams(), q, k, v, None, None, head_space, space.block_m, space.block_n,
                        scale, costs, Timings(), row_pos=row_pos)
    heads = s.cost_ms.numel()
    return Scored(candidate, s.params, torch.zeros(heads, dtype=torch.float64), torch.ones(heads, dtype=torch.float64), s.density, s.cost_ms)


def score_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, space: SearchSpace, costs: CostModel, *,
    head_space: str = "query", modality: str = "text", frame_stride: int | None = None, scale: float | None = None,
    row_pos: torch.Tensor | None = None, reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    budget: torch.Tensor | None = None, dense_fallback: bool = True, prune: bool = True,
) -> tuple[list[Scored], torch.Tensor, Timings]:
    """Score every applicable candidate of the space on one layer, or on one permuted modality region of
    it (q rows [1, Hq, Nq, D] and keys k/v [1, Hkv, Nk, D] gathered, row_pos their frame: grid candidates
    do not apply there, token counts scale with Nk, the budget is the target's cost on the same region).
    reference: the dense (out, lse) of these inputs when the caller has it already (``space_reference``).
    budget: float64 [H] ms to prune against instead of the target's cost here x (1 + slack) (a region's
    share of the whole sequence's budget, search/boundary.py).
    With dense_fallback the list ends with the dense entry (``dense_scored``; ``choose`` takes it only past
    max_error). A space that lists dense itself gets that entry in its place (not run, not pruned: scored
    and pruned like a candidate it came out unrun over the budget, error inf and recall 0, and was the
    first dense entry ``choose_head`` found), and no second one. The boundary search leaves the fallback
    out of its regions (search/boundary.py says why).
    prune=False runs (and so measures the error of) candidates over the budget too: a quality target
    (calibrate --target-kl / --max-output-error) chooses across budgets, and a head that only a denser
    candidate serves would otherwise have nothing between the budget and dense.
    Returns (scored, budget_ms [H], times)."""
    n = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    timings = Timings()
    start = time.perf_counter()
    ref_out, ref_lse = reference or space_reference(q, k, v, space, head_space, scale, row_pos)
    _sync(q)
    timings.kernel_s += time.perf_counter() - start
    if budget is None:
        budget = target_cost(q, k, v, space, head_space, scale, costs, row_pos) * (1.0 + space.budget_slack)
    scored = []
    for cand in space.candidates:
        if not space.applies_to(cand, modality) or (row_pos is not None and not REGISTRY[cand.pattern].REGION):
            continue
        if cand.pattern == DENSE.pattern:
            scored.append(dense_scored(q, k, v, space, head_space, scale, costs, row_pos, candidate=cand))
            continue
        resolved = space.resolve(cand, n, frame_stride=frame_stride)
        if resolved is None:
            continue
        scored.append(score_candidate(cand, resolved, q, k, v, ref_out, ref_lse, head_space, space.block_m, space.block_n,
                                      scale, costs, timings, budget if prune else None, row_pos))
    if not scored:
        raise ValueError(f"no candidate of search space {space.name!r} applies to modality {modality!r}")
    _score_fallbacks(scored, budget, q, k, v, ref_out, ref_lse, space, head_space, scale, costs, timings, frame_stride, row_pos)
    if dense_fallback and not any(s.candidate.pattern == DENSE.pattern for s in scored):
        scored.append(dense_scored(q, k, v, space, head_space, scale, costs, row_pos))
    return scored, budget, timings


def _score_fallbacks(scored: list[Scored], budget: torch.Tensor, q, k, v, ref_out, ref_lse, space: SearchSpace, head_space: str,
                     scale: float, costs: CostModel, timings: Timings, frame_stride: int | None, row_pos: torch.Tensor | None) -> None:
    """Heads no sparse candidate serves within budget fall back to the cheapest (``choose_head``), which
    pruning left unrun (error inf): run it for them so the pick carries its measured error and recall. On
    a GPU this is common in small regions, whose timed costs are launch-bound; the costs stay the first ones."""
    n = k.shape[2]
    sparse = [i for i, s in enumerate(scored) if s.candidate.pattern != DENSE.pattern]
    unserved: dict[int, list[int]] = {}
    for h in range(budget.numel()):
        if not sparse or any(float(scored[i].cost_ms[h]) <= float(budget[h]) for i in sparse):
            continue
        i = min(sparse, key=lambda i: (float(scored[i].cost_ms[h]), _kind_rank(scored[i])))
        if not math.isfinite(float(scored[i].error[h])):
            unserved.setdefault(i, []).append(h)
    for i, heads in unserved.items():
        cand = scored[i].candidate
        again = score_candidate(cand, space.resolve(cand, n, frame_stride=frame_stride), q, k, v, ref_out, ref_lse, head_space,
                                space.block_m, space.block_n, scale, costs, timings, None, row_pos)
        scored[i].error[heads] = again.error[heads]
        scored[i].recall[heads] = again.recall[heads]


def head_rows(scored: list[Scored], budget: torch.Tensor, objective: str, max_error: float = MAX_ERROR) -> list[dict]:
    """One dict per head for the chosen candidate: pattern, params, density, recall, output_error,
    latency_ms, score, admissible, reason (None, or why the pick is not the best admissible candidate),
    tie (None, or the kind whose objective tied the pick's: ``choose_head``)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    rows = []
    for h in range(budget.numel()):
        s, reason, tie = choose_head(scored, budget, h, objective, max_error)
        rows.append({
            "head": h, "pattern": s.candidate.pattern, "params": s.params[h],
            "density": float(s.density[h]), "recall": float(s.recall[h]), "output_error": float(s.error[h]),
            "latency_ms": float(s.cost_ms[h]), "score": float(s.error[h] if objective == "output_error" else s.recall[h]),
            "admissible": float(s.cost_ms[h]) <= float(budget[h]), "reason": reason, "tie": tie,
        })
    return rows


def artifact_row(layer: int, scope: str, r: dict, space, boundary: str = "none") -> dict:
    """A ``head_rows`` dict (or one of the same keys) as a heads-table row of ``layer`` in region ``scope``."""
    q_mod, k_mod = split_scope(scope)
    row = {
        "layer": layer, "head": r["head"], "q_modality": q_mod, "k_modality": k_mod, "boundary": boundary,
        "pattern": r["pattern"], "block_m": space.block_m, "block_n": space.block_n,
        "density": r["density"], "recall": r["recall"], "output_error": r["output_error"],
        "latency_ms": r["latency_ms"], "score": r["score"], "reason": r.get("reason"), "tie": r.get("tie"),
    }
    row.update(row_from_params(r["params"]))
    return row


def mean_scored(per_sample: list[list[Scored]]) -> list[Scored]:
    """Average several samples' scores candidate by candidate (same space, same order); params of the
    first sample are kept (static patterns have the same params; dynamic ones re-estimate at run time)."""
    if len(per_sample) == 1:
        return per_sample[0]
    out = []
    for parts in zip(*per_sample):
        first = parts[0]
        mean = lambda name: torch.stack([getattr(p, name) for p in parts]).mean(0)
        out.append(Scored(first.candidate, first.params, mean("error"), mean("recall"), mean("density"), mean("cost_ms")))
    return out
