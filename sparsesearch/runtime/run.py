"""Run: one layer's attention under a plan, per call. Independent of transformers.

``Runner.attend`` takes post-RoPE q [B, Hq, N, D], k/v [B, Hkv, N, D] (prefill, no padding) and returns
out [B, Hq, N, D] (a view of a [B, N, Hq, D] buffer, the layout the model reshapes next, so no copy
follows). Each head group costs one index build and one kernel launch (sparsesearch/execute.py: Triton on
CUDA, the index-driven torch backend on CPU); heads without a group run SDPA together. Static indices are
cached per shape.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..execute import (
    HeadGroup, StaticIndexCache, attend_boundary, attend_triangle, dense_heads, device_ids, query_heads, sparse_attend,
)
from ..patterns import triangle
from .plan import LayerPlan, Plan



class Runner:
    """Holds the plan and a small cache of static indices; one per model."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._static = StaticIndexCache()
        # When a dict, every sparse call also runs dense SDPA on the same q/k/v and appends the relative
        # output error under the layer id: the per-layer fidelity report of calibrate.
        self.audit: dict[int, list[float]] | None = None
        # Modality ids of the prompt being prefilled, int [N] or [B, N] (0 text, 1 image, 2 video), set by
        # the caller (runtime.set_modality): boundary heads run their region patterns only with them.
        self.modality: torch.Tensor | None = None
        # Grid heads in the form the search scored (execute.grid_form): lines read in place by index
        # arithmetic where they compute fewer tiles than the plain cover, else the cover. False runs the
        # plain cover always (it admits the same tokens; its extra ones differ from what was scored).
        self.permute_grid = True

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
            by_region = attend_boundary(layer.boundary, layer.region_groups, q, k, v, modality.flatten(), self.plan.head_space, scale, out)
            covered.update(query_heads(tuple(sorted(by_region)), self.plan.head_space, group))
        for g in layer.groups:
            if by_region:
                heads = tuple(h for h in g.heads if h not in by_region)
                if not heads:
                    continue
                g = dataclasses.replace(g, heads=heads)
            heads = device_ids(tuple(g.heads), q.device, torch.int32)
            if self.permute_grid and g.pattern == "grid":
                index, lines = self._static.permuted(g, q, k, self.plan.head_space)
                sparse_attend(q, k, v, index, scale, heads, out, lse, lines=lines)
            else:
                sparse_attend(q, k, v, self._static.index(g, q, k, self.plan.head_space), scale, heads, out, lse)
            covered.update(query_heads(g.heads, self.plan.head_space, group))
        rest = [h for h in range(q_heads) if h not in covered]
        if rest:
            dense_heads(q, k, v, rest, scale, out)

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

    def _triangle(self, params, q, k, v, scale, out, lse) -> None:
        """Every head by TriangleMix: one streaming index over the KV heads (cached per shape), one launch."""
        g = HeadGroup("triangle", params, tuple(range(k.shape[1])), triangle.LAYER_BLOCK, triangle.LAYER_BLOCK)
        attend_triangle(q, k, v, self._static.index(g, q, k, "kv"), params, scale, out, lse)
