"""Kernel-aware per-head search for one layer (paper 000 Alg. 4, KernelAwareSearch).

For one layer's post-RoPE q [1, Hq, N, D], k/v [1, Hkv, N, D] of a calibration sample:
1. the dense output and lse come from the same kernels with an all-causal index (no n x n matrix);
2. every candidate of the search space is resolved at length N, its index built for all heads at once
   (one build, one launch through sparsesearch/execute.py, the runtime's own path) and scored per head:
   relative L2 error of the attention output (this is where V enters) and the attention mass kept, exp(lse_sparse − lse_dense);
3. each candidate's cost per head comes from the cost model (measured kernel time on a GPU, an analytic
   FLOP model on a CPU); candidates above the target's cost x (1 + slack) are pruned;
4. each head takes the admissible candidate with the best objective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..execute import HeadGroup, build_group_index, sparse_attend
from ..index import BlockIndex
from ..patterns import grid, index_entries
from ..patterns._common import causal_entries, region_causal_entries
from ..patterns.dense import DenseParams
from ..patterns.registry import REGISTRY
from .cost import CostModel, analytic_ms
from .space import Candidate, SearchSpace

OBJECTIVES = ("output_error", "mass_recall")


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


def head_density(index: BlockIndex, n: int, kv_len: int | None = None, row_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Computed fraction of the causal matrix (of a region's, with row_pos), per index head: float64 [H]."""
    total = causal_entries(n) if row_pos is None else region_causal_entries(row_pos)
    out = []
    for h in range(index.heads):
        one = BlockIndex(
            index.full_count[:, h : h + 1], index.full_idx[:, h : h + 1], index.partial_count[:, h : h + 1],
            index.partial_idx[:, h : h + 1], index.block_m, index.block_n, index.head_space,
            None if index.col_count is None else index.col_count[:, h : h + 1],
            None if index.col_idx is None else index.col_idx[:, h : h + 1], index.window, index.sink,
        )
        out.append(index_entries(one, n, kv_len, row_pos=row_pos) / max(1, total))
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
        index = build_group_index(g, q, k, space, row_pos)
        _sync(q)
        build_s = time.perf_counter() - start
        timings.index_s += build_s
        ids = torch.tensor(g.heads, dtype=torch.int32, device=q.device)
        dens = head_density(index, n, kv_len, row_pos)
        density[list(g.heads)] = dens
        if row_pos is not None and costs.kind == "analytic":  # the model counts a region's own entries
            cost[list(g.heads)] = analytic_ms(g.pattern, dens * region_causal_entries(row_pos), q.shape[-1], kv_len)
        else:
            run = lambda: sparse_attend(q, k, v, index, scale, ids, out, lse, row_pos)  # noqa: B023 (called at once)
            cost[list(g.heads)] = costs.cost_ms(g.pattern, dens, kv_len, q, index, run, build_s)
        for h in g.heads:
            params[h] = g.params
        within = budget is None or bool((cost[list(g.heads)] <= budget[list(g.heads)]).any())
        if ref_out is None or not within:
            continue
        start = time.perf_counter()
        sparse_attend(q, k, v, index, scale, ids, out, lse, row_pos)
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


def choose(scored: list[Scored], budget: torch.Tensor, objective: str) -> list[tuple[Scored, int]]:
    """Per head: the admissible candidate (cost <= budget) with the best objective; if none is admissible,
    the cheapest candidate. Ties keep the earlier candidate (search-space order). Returns (scored, head)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    heads = budget.numel()
    picks = []
    for h in range(heads):
        admissible = [s for s in scored if float(s.cost_ms[h]) <= float(budget[h])]
        if not admissible:
            picks.append((min(scored, key=lambda s: float(s.cost_ms[h])), h))
            continue
        if objective == "output_error":
            best = min(admissible, key=lambda s: float(s.error[h]))
        else:
            best = max(admissible, key=lambda s: float(s.recall[h]))
        picks.append((best, h))
    return picks


def score_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, space: SearchSpace, costs: CostModel, *,
    head_space: str = "query", modality: str = "text", frame_stride: int | None = None, scale: float | None = None,
    row_pos: torch.Tensor | None = None, reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[Scored], torch.Tensor, Timings]:
    """Score every applicable candidate of the space on one layer, or on one permuted modality region of
    it (q rows [1, Hq, Nq, D] and keys k/v [1, Hkv, Nk, D] gathered, row_pos their frame: grid candidates
    do not apply there, token counts scale with Nk, the budget is the target's cost on the same region).
    reference: the dense (out, lse) of these inputs when the caller has it already (``space_reference``).
    Returns (scored, budget_ms [H], times)."""
    n = k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    timings = Timings()
    start = time.perf_counter()
    ref_out, ref_lse = reference or space_reference(q, k, v, space, head_space, scale, row_pos)
    _sync(q)
    timings.kernel_s += time.perf_counter() - start
    target = score_candidate(space.target, space.resolve(space.target, n), q, k, v, None, None, head_space,
                             space.block_m, space.block_n, scale, costs, Timings(), row_pos=row_pos)
    budget = target.cost_ms * (1.0 + space.budget_slack)
    scored = []
    for cand in space.candidates:
        if not space.applies_to(cand, modality) or (row_pos is not None and not REGISTRY[cand.pattern].REGION):
            continue
        resolved = space.resolve(cand, n, frame_stride=frame_stride)
        if resolved is None:
            continue
        scored.append(score_candidate(cand, resolved, q, k, v, ref_out, ref_lse, head_space, space.block_m, space.block_n,
                                      scale, costs, timings, budget, row_pos))
    if not scored:
        raise ValueError(f"no candidate of search space {space.name!r} applies to modality {modality!r}")
    return scored, budget, timings


def head_rows(scored: list[Scored], budget: torch.Tensor, objective: str) -> list[dict]:
    """One dict per head for the chosen candidate: pattern, params, density, recall, output_error,
    latency_ms, score, admissible."""
    rows = []
    for s, h in choose(scored, budget, objective):
        rows.append({
            "head": h, "pattern": s.candidate.pattern, "params": s.params[h],
            "density": float(s.density[h]), "recall": float(s.recall[h]), "output_error": float(s.error[h]),
            "latency_ms": float(s.cost_ms[h]), "score": float(s.error[h] if objective == "output_error" else s.recall[h]),
            "admissible": float(s.cost_ms[h]) <= float(budget[h]),
        })
    return rows


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
