"""Run: one layer's attention under a plan, per call. Independent of transformers.

``Runner.attend`` takes post-RoPE q [B, Hq, N, D], k/v [B, Hkv, N, D] (prefill, no padding) and returns
out [B, Hq, N, D] (a view of a [B, N, Hq, D] buffer, the layout the model reshapes next, so no copy
follows). Each head group costs one index build and one kernel launch (Triton on CUDA, the index-driven
torch backend on CPU); heads without a group run SDPA together. Static indices are cached per shape.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..index import BlockIndex
from ..patterns import ashape, block_topk, dense, grid, triangle, vertical_slash
from .plan import HeadGroup, LayerPlan, Plan

STATIC = {"dense": dense, "ashape": ashape, "grid": grid, "triangle": triangle}
DYNAMIC = {"vertical_slash": vertical_slash, "block_topk": block_topk}
CACHE_LIMIT = 64


class Runner:
    """Holds the plan and a small cache of static indices; one per model."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._static: dict[tuple, BlockIndex] = {}
        # When a dict, every sparse call also runs dense SDPA on the same q/k/v and appends the relative
        # output error under the layer id: the per-layer fidelity report of calibrate.
        self.audit: dict[int, list[float]] | None = None
        # Modality ids of the prompt being prefilled, int [N] or [B, N] (0 text, 1 image, 2 video), set by
        # the caller (runtime.set_modality): boundary heads run their region patterns only with them.
        self.modality: torch.Tensor | None = None

    def _modality_for(self, layer: LayerPlan, batch: int, n: int) -> torch.Tensor | None:
        """The ids for a call of [batch, n] tokens, or None when unset or of another shape (a padded
        batch's per-sequence calls pass their own slice instead)."""
        m = self.modality
        if m is None or not layer.boundary:
            return None
        m = m if m.dim() == 2 else m[None].expand(batch, -1)
        return m if tuple(m.shape) == (batch, n) else None

    def attend(self, layer: LayerPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
               modality: torch.Tensor | None = None) -> torch.Tensor:
        """modality: int [N] ids of this call's tokens (a padded batch's per-sequence call), else the
        runner's own ``modality`` when its shape fits the call."""
        batch, q_heads, n, dim = q.shape
        scale = 1.0 / math.sqrt(dim) if scale is None else scale
        buf = torch.empty(batch, n, q_heads, dim, dtype=q.dtype, device=q.device)
        out = buf.transpose(1, 2)
        if layer.kind == "triangle":
            self._triangle(layer.triangle, q, k, v, scale, out, torch.empty(batch, q_heads, n, dtype=torch.float32, device=q.device))
        else:
            modality = self._modality_for(layer, batch, n) if modality is None else modality[None]
            # Regions differ per sequence: boundary layers run one batch row at a time (not one head).
            rows = [slice(b, b + 1) for b in range(batch)] if layer.boundary and modality is not None and batch > 1 else [slice(None)]
            for sl in rows:
                self._sparse(layer, q[sl], k[sl], v[sl], scale, None if modality is None else modality[sl], out[sl])
        self._audit(layer, q, k, v, scale, out)
        return out

    def _sparse(self, layer: LayerPlan, q, k, v, scale: float, modality: torch.Tensor | None, out) -> None:
        """Head groups (and, with modality ids [B, N] for one batch row, boundary heads) into out."""
        q_heads = q.shape[1]
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        group = q_heads // k.shape[1]
        covered: set[int] = set()
        by_region: set[int] = set()
        if layer.boundary and modality is not None:
            by_region = attend_boundary(layer, q, k, v, modality.flatten(), self.plan.head_space, scale, out)
            covered.update(_query_heads(tuple(sorted(by_region)), self.plan.head_space, group))
        for g in layer.groups:
            if by_region:
                heads = tuple(h for h in g.heads if h not in by_region)
                if not heads:
                    continue
                g = dataclasses.replace(g, heads=heads)
            index = self._index(g, q, k)
            heads = torch.tensor(g.heads, dtype=torch.int32, device=q.device)
            sparse_attend(q, k, v, index, scale, heads, out, lse)
            covered.update(_query_heads(g.heads, self.plan.head_space, group))
        rest = [h for h in range(q_heads) if h not in covered]
        if rest:
            _dense_heads(q, k, v, rest, group, scale, out)

    def attend_last_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """Only the final query row attends (every key); other rows are zeros. Returns [B, Hq, N, D] view."""
        batch, q_heads, n, dim = q.shape
        buf = torch.zeros(batch, n, q_heads, dim, dtype=q.dtype, device=q.device)
        last = F.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=scale, enable_gqa=q_heads != k.shape[1])
        buf[:, -1] = last[:, :, 0]
        return buf.transpose(1, 2)

    def _audit(self, layer: LayerPlan, q, k, v, scale, out) -> None:
        # A window layer runs the model's own attention (its kernel is checked against transformers' sliding
        # SDPA in the tests); a causal reference would report the window itself as error.
        if self.audit is None or layer.kind == "window":
            return
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
        self.audit.setdefault(layer.layer, []).append(err)

    def _index(self, g: HeadGroup, q: torch.Tensor, k: torch.Tensor) -> BlockIndex:
        if g.pattern in STATIC:
            key = (g.pattern, g.params, q.shape[2], q.shape[0], len(g.heads), g.block_m, g.block_n, self.plan.head_space, q.device)
            if key not in self._static:
                if len(self._static) >= CACHE_LIMIT:
                    self._static.pop(next(iter(self._static)))
                self._static[key] = build_group_index(g, q, k, self.plan.head_space)
            return self._static[key]
        return build_group_index(g, q, k, self.plan.head_space)

    def _triangle(self, params, q, k, v, scale, out, lse) -> None:
        n, kv_heads = q.shape[2], k.shape[1]
        key = ("triangle", params, n, q.shape[0], kv_heads, 64, 64, "kv", q.device)
        if key not in self._static:
            self._static[key] = triangle.build_index(params, n, batch=q.shape[0], heads=kv_heads, block_m=64, block_n=64, head_space="kv", device=q.device)
        index = self._static[key]
        if q.is_cuda:
            from ..kernels import triangle_attention

            res, _ = triangle_attention(q, k, v, index, params.last, scale=scale)
            out.copy_(res)
            return
        from ..kernels.torch_sparse import block_sparse_attention_torch
        from ..reference import masked_attention

        block_sparse_attention_torch(q, k, v, index, scale=scale, out=out, lse=lse)
        rows = min(params.last, n)
        # The dense last rows: `rows` x N scores at most, chunked by the oracle.
        tail, _ = masked_attention(q[:, :, n - rows :], k, v, scale=scale)
        out[:, :, n - rows :] = tail.to(out.dtype)


def attend_boundary(layer: LayerPlan, q, k, v, modality: torch.Tensor, space: str, scale: float, out) -> set[int]:
    """The layer's boundary heads, each by its type's regions (patterns/boundary.py): per region, one index
    build and one launch per head group on the region's gathered rows/keys (the region frame row_pos for
    permuted ones), partials merged by lse into ``out``. q [1, Hq, N, D],
    modality int [N]. Returns the heads (plan space) done; a head lacking a row for one of its regions
    (a modality its calibration never saw) is left to its global pattern."""
    from ..models.modality import MODALITIES
    from ..patterns import boundary as bd

    n, group = q.shape[2], q.shape[1] // k.shape[1]
    pos = bd.positions(modality.to(q.device), MODALITIES)
    present = [m for m in MODALITIES if m in pos]
    if len(present) < 2:
        return set()  # one modality: every type reduces to the global pattern
    done: set[int] = set()
    for kind in sorted({kind for _, kind in layer.boundary}):
        scopes = bd.region_scopes(kind, present)
        heads = [h for h, t in layer.boundary if t == kind
                 and all(any(h in g.heads for g in layer.region_groups(bd.scope_name(*s))) for s in scopes)]
        if not heads:
            continue
        parts = []
        for q_mod, k_mod in scopes:
            region = bd.make_region(q_mod, k_mod, pos)
            if region is None:
                continue
            groups = [dataclasses.replace(g, heads=tuple(h for h in g.heads if h in heads)) for g in layer.region_groups(region.name)]
            parts.append((region, *run_region(q, k, v, region, [g for g in groups if g.heads], space, scale)))
        merged, _ = bd.compose(parts, n)
        q_ids = torch.tensor(_query_heads(tuple(heads), space, group), device=q.device)
        out[:, q_ids] = merged[:, q_ids].to(out.dtype)
        done.update(heads)
    return done


def run_region(q, k, v, region, groups: list[HeadGroup], space: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One region's attention (patterns/boundary.py Region) for the heads of ``groups``: its rows and keys
    gathered, one index build and one launch per group in the region's frame. q [1, Hq, N, D], k/v
    [1, Hkv, N, D]. Returns out [1, Hq, Nq_r, D] and lse fp32 [1, Hq, Nq_r] over the region's rows; heads
    no group serves stay (0, -inf)."""
    q_r, k_r, v_r = region.gather(q, k, v)
    out = torch.zeros_like(q_r)
    lse = torch.full(q_r.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for g in groups:
        index = build_group_index(g, q_r, k_r, space, region.row_pos)
        ids = torch.tensor(g.heads, dtype=torch.int32, device=q.device)
        sparse_attend(q_r, k_r, v_r, index, scale, ids, out, lse, region.row_pos)
    return out, lse


def build_group_index(g: HeadGroup, q: torch.Tensor, k: torch.Tensor, space: str, row_pos: torch.Tensor | None = None) -> BlockIndex:
    """The index one head group runs with: static patterns from the shape, dynamic ones estimated from
    the group's own q/k heads (q [B, Hq, Nq, D], k [B, Hkv, Nk, D]; the result has len(g.heads) heads).
    row_pos: a permuted modality region's frame (patterns/boundary.py); grid needs the identity frame."""
    n, batch = q.shape[2], q.shape[0]
    if row_pos is not None and g.pattern in ("grid", "triangle"):
        raise ValueError(f"{g.pattern} has no region form; it applies to intra-modality regions only")
    frame = {} if row_pos is None else {"row_pos": row_pos}
    if g.pattern in STATIC:
        return STATIC[g.pattern].build_index(
            g.params, n, k.shape[2], batch=batch, heads=len(g.heads), block_m=g.block_m, block_n=g.block_n,
            head_space=space, device=q.device, **frame,
        )
    group = q.shape[1] // k.shape[1]
    q_ids = torch.tensor(_query_heads(g.heads, space, group), device=q.device)
    # kv space: the group's KV heads; query space: each query head's own KV head (estimates see pairs).
    kv_ids = torch.tensor(g.heads, device=q.device) if space == "kv" else q_ids // group
    return DYNAMIC[g.pattern].build_index(
        g.params, q.index_select(1, q_ids), k.index_select(1, kv_ids), head_space=space, block_m=g.block_m, block_n=g.block_n, **frame
    )


def _query_heads(heads: tuple[int, ...], space: str, group: int) -> list[int]:
    if space == "query":
        return list(heads)
    return [h * group + i for h in heads for i in range(group)]


def sparse_attend(q, k, v, index, scale, heads, out, lse, row_pos=None) -> None:
    """One launch over the heads of `heads`: Triton on CUDA, the index-driven torch backend on CPU.
    row_pos: a permuted region's frame (q/k/v are the region's gathered rows and keys)."""
    if q.is_cuda:
        from ..kernels import block_sparse_attention

        block_sparse_attention(q, k, v, index, scale=scale, heads=heads, out=out, lse=lse, row_pos=row_pos)
    else:
        from ..kernels.torch_sparse import block_sparse_attention_torch

        block_sparse_attention_torch(q, k, v, index, scale=scale, heads=heads.cpu(), out=out, lse=lse, row_pos=row_pos)


def _dense_heads(q, k, v, heads: list[int], group: int, scale: float, out) -> None:
    """Causal SDPA for the heads no sparse group covers (GQA handled by SDPA, K/V not repeated)."""
    q_ids = torch.tensor(heads, device=q.device)
    if len(heads) == q.shape[1]:
        res = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        kv_ids = q_ids // group
        res = F.scaled_dot_product_attention(q.index_select(1, q_ids), k.index_select(1, kv_ids), v.index_select(1, kv_ids), is_causal=True, scale=scale)
    out[:, q_ids] = res.to(out.dtype)
