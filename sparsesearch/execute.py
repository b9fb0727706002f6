"""Execute: the one place that turns a head group into an index and a kernel launch.

The search (search/layer.py, search/boundary.py), the runtime (runtime/run.py), the FlexAttention export
(export/flex.py) and ``sparsesearch check`` (selfcheck.py) all build indices and launch kernels through
these functions, so what the search scores is what the runtime runs and what the exports describe.
Plain torch: no transformers import, direct or transitive (tests/test_imports.py).

Shapes: q [B, Hq, N, D] post-RoPE, k/v [B, Hkv, Nk, D]; a head group's ids live in the head space
("query": query heads; "kv": KV heads, each standing for its GQA group of query heads). Launches are
Triton on CUDA tensors and the index-driven torch backend elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .index import BlockIndex, GridLines, RegionMaps
from .patterns.registry import REGISTRY, pattern

CACHE_LIMIT = 64  # static indices kept per StaticIndexCache (one model's distinct call shapes)


@dataclass(frozen=True)
class HeadGroup:
    """Heads (ids in the head space) sharing one pattern + params + block shape: one index build and one
    kernel launch."""

    pattern: str
    params: object
    heads: tuple[int, ...]
    block_m: int
    block_n: int


@functools.lru_cache(maxsize=4096)
def device_ids(ids: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """ids [len(ids)] on device, made once per (ids, device, dtype) and shared, so read-only. Copying a host list
    to a CUDA device waits for the stream to drain (pageable memory), so a copy per launch kept the host from
    running ahead of the GPU: 98 of the 139 waits of one 8B-stack prefill (H200, RESULTS.md)."""
    return torch.tensor(ids, dtype=dtype, device=device)


def query_heads(heads: tuple[int, ...], space: str, group: int) -> list[int]:
    """Query head ids of head-space ids: themselves in "query" space, each KV head's group in "kv" space."""
    if space == "query":
        return list(heads)
    return [h * group + i for h in heads for i in range(group)]


def static_index(g: HeadGroup, q_len: int, kv_len: int, space: str, device, *, batch: int = 1,
                 row_pos: torch.Tensor | None = None) -> BlockIndex:
    """The index of a static pattern's group (registry fact DYNAMIC False): from the shape alone, the same
    for every head, len(g.heads) heads. row_pos: a permuted region's frame (patterns/boundary.py)."""
    module = pattern(g.pattern)
    if module.DYNAMIC:
        raise ValueError(f"{g.pattern} is estimated from q and k; it has no index from the shape alone")
    return module.build_index(g.params, q_len, kv_len, batch=batch, heads=len(g.heads), block_m=g.block_m, block_n=g.block_n,
                              head_space=space, device=device, **_frame(g.pattern, row_pos))


def build_group_index(g: HeadGroup, q: torch.Tensor, k: torch.Tensor, space: str, row_pos: torch.Tensor | None = None) -> BlockIndex:
    """The index one head group runs with: static patterns from the shape, dynamic ones estimated from
    the group's own q/k heads (q [B, Hq, Nq, D], k [B, Hkv, Nk, D]; the result has len(g.heads) heads).
    row_pos: a permuted modality region's frame (patterns/boundary.py); patterns without a region form
    (registry fact REGION False) refuse it."""
    from .kernels.dynamic_index import build  # Triton loads on the first dynamic build, not with the executor

    module = pattern(g.pattern)
    if not module.DYNAMIC:
        return static_index(g, q.shape[2], k.shape[2], space, q.device, batch=q.shape[0], row_pos=row_pos)
    q_ids, kv_ids = estimate_heads(g, q.shape[1] // k.shape[1], space)
    q_ids, kv_ids = device_ids(tuple(q_ids), q.device), device_ids(tuple(kv_ids), q.device)
    # Through the kernels' choice: the fused Triton build where it takes the inputs, else the pattern's torch build.
    return build(g.pattern, g.params, q.index_select(1, q_ids), k.index_select(1, kv_ids), head_space=space,
                 block_m=g.block_m, block_n=g.block_n, **_frame(g.pattern, row_pos))


def estimate_heads(g: HeadGroup, group: int, space: str) -> tuple[list[int], list[int]]:
    """(query head ids, KV head ids) whose q/k slices a dynamic group's index is estimated from: in kv space
    the group's KV heads; in query space each query head with its own KV head (estimates see pairs)."""
    q_ids = query_heads(g.heads, space, group)
    return q_ids, list(g.heads) if space == "kv" else [h // group for h in q_ids]


def _frame(name: str, row_pos: torch.Tensor | None) -> dict:
    """build_index's frame argument: none in the identity frame; row_pos only where the pattern has one."""
    if row_pos is None:
        return {}
    if not REGISTRY[name].REGION:
        raise ValueError(f"{name} has no region form; it applies to intra-modality regions only")
    return {"row_pos": row_pos}


def permuted_grid_index(g: HeadGroup, q_len: int, kv_len: int, space: str, device, *, batch: int = 1
                        ) -> tuple[BlockIndex, GridLines]:
    """A grid group's permuted form (patterns/grid.py build_lines_index: Alg. 1's stride/phase read in place
    by index arithmetic) and its GridLines, for ``sparse_attend(..., lines=)``. Static like the plain
    cover: stride and phase live in the params."""
    if g.pattern != "grid":
        raise ValueError(f"only grid heads have a permuted form, got {g.pattern!r}")
    from .patterns import grid

    return grid.build_lines_index(g.params, q_len, kv_len, batch=batch, heads=len(g.heads), block_m=g.block_m,
                                  block_n=g.block_n, head_space=space, device=device)


def grid_form(g: HeadGroup, q_len: int, kv_len: int, space: str, device, *, batch: int = 1
              ) -> tuple[BlockIndex, GridLines | None]:
    """The form a grid group runs in, and the one the search scores: ``permuted_grid_index`` (lines read in
    place) when it computes fewer key tiles than the plain cover (its listed blocks, line columns and line
    rows), else the plain cover and None (slash lines, which the arithmetic leaves spread, can make the
    lines form compute more). A function of the params and shape alone, so search and runtime agree."""
    index, lines = permuted_grid_index(g, q_len, kv_len, space, device, batch=batch)
    plain = static_index(g, q_len, kv_len, space, device, batch=batch)
    return (index, lines) if _blocks(index, lines) < _blocks(plain) else (plain, None)


class StaticIndexCache:
    """Static indices by (group, shape, head space, device): they depend on nothing else, so the calls of
    one length share them. Bounded: past ``limit`` entries the oldest goes first. Dynamic indices are
    rebuilt per call, through CUDA-graph replays where ``graphed.usable`` (``graphs=False``: never)."""

    def __init__(self, limit: int = CACHE_LIMIT, graphs: bool = True):
        from .graphed import GraphedIndexCache

        self.limit = limit
        self._entries: dict[tuple, BlockIndex] = {}
        self._graphs = GraphedIndexCache() if graphs else None

    def index(self, g: HeadGroup, q: torch.Tensor, k: torch.Tensor, space: str) -> BlockIndex:
        """``build_group_index`` (identity frame), cached when the pattern is static; a dynamic one from a
        graph replay when it may (valid until the group's next call: consume it first)."""
        if REGISTRY[g.pattern].DYNAMIC:
            from .graphed import usable
            from .kernels.dynamic_index import fused_refusal, wants_fused

            # A fused Triton build (kernels/index_build.py, 2-4 launches) beats a graph replay of the torch
            # build, whose two index_select copies alone cost more (H200, 8K: 0.11 vs 0.22 ms, RESULTS). The
            # question is the one dynamic_index.build itself asks (same rule: a graph only where it would not fuse).
            refusal = lambda: fused_refusal(g.pattern, g.params, q, k, block_n=g.block_n)  # noqa: E731
            if wants_fused(None, refusal, q):
                return build_group_index(g, q, k, space)
            if self._graphs is not None and usable(q, k):
                return self._graphs.index(g, q, k, space)
            return build_group_index(g, q, k, space)
        key = (g.pattern, g.params, q.shape[2], k.shape[2], q.shape[0], len(g.heads), g.block_m, g.block_n, space, q.device)
        if key not in self._entries:
            if len(self._entries) >= self.limit:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = build_group_index(g, q, k, space)
        return self._entries[key]

    def permuted(self, g: HeadGroup, q: torch.Tensor, k: torch.Tensor, space: str) -> tuple[BlockIndex, GridLines | None]:
        """A grid group's ``grid_form``, cached."""
        key = ("permuted", g.pattern, g.params, q.shape[2], k.shape[2], q.shape[0], len(g.heads), g.block_m, g.block_n, space, q.device)
        if key not in self._entries:
            if len(self._entries) >= self.limit:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = grid_form(g, q.shape[2], k.shape[2], space, q.device, batch=q.shape[0])
        return self._entries[key]


def _blocks(index: BlockIndex, lines: GridLines | None = None) -> int:
    """Key blocks an index computes (full + partial, every batch row and head), with a grid's line columns
    and line rows (over their causal keys) counted in blocks of the same area."""
    blocks = int(index.full_count.sum() + index.partial_count.sum())
    if lines is None:
        return blocks
    return blocks + lines.entries(index.block_m) * index.batch * index.heads // (index.block_m * index.block_n)


def sparse_attend(q, k, v, index: BlockIndex, scale: float, heads: torch.Tensor, out, lse, row_pos=None, *,
                  maps: RegionMaps | None = None, lines: GridLines | None = None) -> None:
    """One launch over the query heads the index serves (``heads``: int32 head-space ids, one per index head)
    into out [B, Hq, Nq, D] and lse fp32 [B, Hq, Nq]. row_pos: a gathered region's frame. maps: the region
    read in place from the whole q/k/v (index.RegionMaps, its frame inside; kernels/block_sparse.py); out/lse
    with the whole q's rows are written at row_map, with the region's rows compactly. Without maps q/k/v
    are the region's gathered rows and keys. lines: a grid group read in place by arithmetic
    (``permuted_grid_index``)."""
    if q.is_cuda:
        from .kernels import block_sparse_attention

        block_sparse_attention(q, k, v, index, scale=scale, heads=heads, out=out, lse=lse, row_pos=row_pos, maps=maps, lines=lines)
    else:
        from .kernels.torch_sparse import block_sparse_attention_torch

        block_sparse_attention_torch(q, k, v, index, scale=scale, heads=heads.cpu(), out=out, lse=lse, row_pos=row_pos,
                                     maps=maps, lines=lines)


def attend_triangle(q, k, v, index: BlockIndex, params, scale: float, out, lse) -> None:
    """TriangleMix attention of every head (paper 002 §2.2) into out [B, Hq, N, D]: on CUDA the triangle
    kernel (streaming index + split-K dense last rows); elsewhere the torch backend on the streaming index,
    then the last rows densely. index: ``triangle`` over every KV head (kv space); lse fp32 [B, Hq, N]."""
    n = q.shape[2]
    if q.is_cuda:
        from .kernels import triangle_attention

        triangle_attention(q, k, v, index, params.last, scale=scale, out=out, lse=lse)
        return
    from .kernels.torch_sparse import block_sparse_attention_torch
    from .reference import masked_attention

    block_sparse_attention_torch(q, k, v, index, scale=scale, out=out, lse=lse)
    rows = min(params.last, n)
    # The dense last rows: `rows` x N scores at most, chunked by the oracle.
    tail, _ = masked_attention(q[:, :, n - rows :], k, v, scale=scale)
    out[:, :, n - rows :] = tail.to(out.dtype)


def dense_heads(q, k, v, heads: list[int], scale: float, out) -> None:
    """Causal SDPA for the query heads ``heads`` into out [B, Hq, N, D] (GQA handled by SDPA, K/V not
    repeated): the heads no sparse group covers.

    A layer that mixes sparse and dense heads used to cost 0.25-0.55 ms more than the sum of its parts at
    Gemma 3's shape (H200, 16K-32K, benchmarks/mixed_layer.py): the dense heads' K/V were gathered once per
    query head and the result scattered into ``out`` by advanced indexing (an index_put kernel, 0.2 ms on
    64 MB). Now K/V are read once per KV head (SDPA's own GQA when every selected KV head serves the same
    number of selected query heads) and the result lands by strided copies of contiguous head runs."""
    group = q.shape[1] // k.shape[1]
    heads = sorted(heads)
    if len(heads) == q.shape[1]:
        res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        q_sel = _select_heads(q, heads)
        per_kv = Counter(h // group for h in heads)  # selected query heads per KV head
        kv = sorted(per_kv)
        if len(set(per_kv.values())) == 1:  # SDPA's GQA: query head j reads KV head j // (len(heads) // len(kv))
            res = F.scaled_dot_product_attention(q_sel, _select_heads(k, kv), _select_heads(v, kv), is_causal=True,
                                                 scale=scale, enable_gqa=len(kv) != len(heads))
        else:
            kv_ids = [h // group for h in heads]
            res = F.scaled_dot_product_attention(q_sel, _select_heads(k, kv_ids), _select_heads(v, kv_ids), is_causal=True, scale=scale)
    _write_heads(out, heads, res)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as maximal runs of consecutive values, [(first, end)) each: [0, 1, 3] -> [(0, 2), (3, 4)]."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _select_heads(x: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """x [B, H, N, D] restricted to heads ``ids`` (sorted): a view for one run of consecutive heads, else a gather."""
    runs = _runs(ids)
    if len(runs) == 1:
        return x[:, runs[0][0] : runs[0][1]]
    return x.index_select(1, device_ids(tuple(ids), x.device))


def _write_heads(out: torch.Tensor, ids: list[int], res: torch.Tensor) -> None:
    """out[:, ids] = res, one strided copy per run of consecutive heads (ids sorted, res [B, len(ids), N, D])."""
    at = 0
    for first, end in _runs(ids):
        out[:, first:end].copy_(res[:, at : at + end - first])
        at += end - first


def region_index(g: HeadGroup, q, k, region, space: str) -> BlockIndex:
    """The index of one group in a region's frame (q [1, Hq, N, D], k [1, Hkv, N, D]: the whole layer).
    Static patterns need only the region's shape; dynamic ones estimate from the region's own last
    queries and keys, so only they read a gathered copy (of q and k: the estimate, never the attention)."""
    if not REGISTRY[g.pattern].DYNAMIC:
        return static_index(g, region.q_idx.numel(), region.k_idx.numel(), space, q.device, batch=q.shape[0],
                            row_pos=region.row_pos)
    q_r = q if region.q_mod == "all" else q.index_select(2, region.q_idx.to(q.device))
    k_r = k if region.k_mod == "all" else k.index_select(2, region.k_idx.to(q.device))
    return build_group_index(g, q_r, k_r, space, region.row_pos)


def run_region(q, k, v, region, groups: list[HeadGroup], space: str, scale: float, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One region's attention (patterns/boundary.py Region) for the heads of ``groups``: one index build and
    one launch per group in the region's frame, its rows and keys read in place (Region.maps); a grid
    group in the form the search scored it in (``grid_form``, ``_attend_grid_lines``).
    q [1, Hq, N, D], k/v [1, Hkv, N, D]. Returns out [1, Hq, Nq_r, D] and lse fp32 [1, Hq, Nq_r] over the
    region's rows (heads no group serves stay (0, -inf)); or, given out [1, Hq, N, D] and lse [1, Hq, N],
    writes the served heads' rows there at their original positions and returns them."""
    region = region.to(q.device)  # regions follow the modality ids' device; the launch needs q's
    maps = region.maps(q.device, q.shape[2])
    if out is None:
        rows = region.q_idx.numel()
        out = q.new_zeros(q.shape[0], q.shape[1], rows, q.shape[3])
        lse = torch.full((q.shape[0], q.shape[1], rows), float("-inf"), dtype=torch.float32, device=q.device)
    for g in groups:
        ids = device_ids(tuple(g.heads), q.device, torch.int32)
        lines = None
        if g.pattern == "grid" and region.row_pos is None:  # grid has no region form (region_index refuses one)
            index, lines = grid_form(g, region.q_idx.numel(), region.k_idx.numel(), space, q.device, batch=q.shape[0])
        else:
            index = region_index(g, q, k, region, space)
        if lines is not None:
            _attend_grid_lines(q, k, v, region, maps, g, index, lines, space, scale, ids, out, lse)
        else:
            sparse_attend(q, k, v, index, scale, ids, out, lse, None if maps is not None else region.row_pos, maps=maps)
    return out, lse


def _attend_grid_lines(q, k, v, region, maps: RegionMaps | None, g: HeadGroup, index: BlockIndex, lines: GridLines,
                       space: str, scale: float, ids: torch.Tensor, out, lse) -> None:
    """A grid group of an identity-frame region in its lines form (``grid_form``): the form the search scored
    and costed it in (search/layer.py score_candidate), so the boundary composition and the runtime run
    what the search measured (issue P11 §2: the plain cover ran here, error 0.000 at density 1.0 while costed
    at 0.11-0.33). The kernels read lines only over a dense [B, H, N, D] layout, not through region maps,
    so a modality's own rows and keys are gathered first: O(N_r x D) copies against attention's
    O(N_r^2 x density x D). The whole sequence (maps None) needs none. out/lse as ``run_region``'s."""
    if maps is None:
        sparse_attend(q, k, v, index, scale, ids, out, lse, lines=lines)
        return
    q_r, k_r, v_r = region.gather(q, k, v)
    out_r = torch.empty_like(q_r)
    lse_r = torch.empty(q_r.shape[:3], dtype=torch.float32, device=q.device)
    sparse_attend(q_r, k_r, v_r, index, scale, ids, out_r, lse_r, lines=lines)
    q_ids = device_ids(tuple(query_heads(g.heads, space, q.shape[1] // k.shape[1])), q.device)
    if out.shape[2] == q_r.shape[2]:  # out over the region's rows
        out[:, q_ids] = out_r[:, q_ids].to(out.dtype)
        lse[:, q_ids] = lse_r[:, q_ids]
        return
    rows = region.q_idx[None, :]  # out over the whole sequence: the region's rows at their positions
    out[:, q_ids[:, None], rows] = out_r[:, q_ids].to(out.dtype)
    lse[:, q_ids[:, None], rows] = lse_r[:, q_ids]


def attend_boundary(boundary: tuple[tuple[int, str], ...], region_groups: Callable[[str], tuple[HeadGroup, ...]], q, k, v,
                    modality: torch.Tensor, space: str, scale: float, out) -> set[int]:
    """Boundary heads, each by its type's regions (patterns/boundary.py): per region, one index build and
    one launch per head group reading the region's rows/keys in place (the region frame row_pos for permuted
    ones); Q-boundary launches write ``out`` directly, K/2D partials are merged by lse into it. boundary: (head, type) pairs; region_groups: scope name ->
    the groups of that region (() for none; runtime.plan.LayerPlan.region_groups). q [1, Hq, N, D], modality int [N]. Returns the heads (head space) done; a
    head lacking a group in one of its regions (a modality its calibration never saw) is left to its
    global pattern."""
    from .patterns import boundary as bd

    n, group = q.shape[2], q.shape[1] // k.shape[1]
    if modality.numel() != n:
        raise ValueError(f"modality ids hold {modality.numel()} tokens, the sequence {n}: one id per token is needed")
    pos = bd.positions(modality.to(q.device), bd.MODALITIES)
    present = [m for m in bd.MODALITIES if m in pos]
    if len(present) < 2:
        return set()  # one modality: every type reduces to the global pattern
    done: set[int] = set()
    for kind in sorted({kind for _, kind in boundary}):
        scopes = bd.region_scopes(kind, present)
        heads = [h for h, t in boundary if t == kind
                 and all(any(h in g.heads for g in region_groups(bd.scope_name(*s))) for s in scopes)]
        if not heads:
            continue
        # Q-boundary: every row lies in exactly one region (a, all), so each launch writes its rows of
        # ``out`` in place and nothing is merged; K and 2D regions share rows and merge by lse.
        direct = kind == "q"
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device) if direct else None
        parts = []
        for q_mod, k_mod in scopes:
            region = bd.make_region(q_mod, k_mod, pos)
            if region is None:
                continue
            groups = [dataclasses.replace(g, heads=tuple(h for h in g.heads if h in heads)) for g in region_groups(region.name)]
            groups = [g for g in groups if g.heads]
            if direct:
                run_region(q, k, v, region, groups, space, scale, out, lse)
            else:
                parts.append((region, *run_region(q, k, v, region, groups, space, scale)))
        if not direct:
            merged, _ = bd.compose(parts, n)
            q_ids = device_ids(tuple(query_heads(tuple(heads), space, group)), q.device)
            out[:, q_ids] = merged[:, q_ids].to(out.dtype)
        done.update(heads)
    return done
