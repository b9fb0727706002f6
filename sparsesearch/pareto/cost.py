"""Attention cost of an artifact on real prompts, as a fraction of the model's own attention.

Every point of a Pareto comparison (searched artifact or one-size baseline) is costed the same way, on the
same captured layers: the post-RoPE q/k/v of each layer of a held-out window (models.capture_qkv), run
through the plan the runtime builds from the artifact (runtime.plan.build_plan), so dynamic patterns are
costed at the density their online estimate really gives on that text, index build included.

- On a GPU (``measured``): the runtime's own call, ``Runner.attend`` for the layer, against causal SDPA on
  the same tensors, each as the GPU time of the kernels it launches (``kernel_ms``: profiler device time,
  mean of ``search.cost.KERNEL_REPS`` calls after warm-up). Its dynamic index builds run inside the measured call; host time
  between launches does not count (a short call is launch-bound: its wall time measures Python).
- On a CPU (``analytic``): the cost model of the search (search/cost.analytic_ms): computed entries at a
  nominal rate plus the last-queries estimate of dynamic patterns, per query head. The CPU's own torch
  backend is not timed: its speed says nothing about a GPU kernel's.

A sliding-window layer of a hybrid model costs the same on both sides (it runs the model's own window),
so it dilutes the fraction exactly as it dilutes the real prefill.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ..execute import build_group_index, grid_form, query_heads
from ..patterns import triangle
from ..patterns._common import causal_entries
from ..search.cost import analytic_ms, kernel_ms
from ..search.layer import head_density



def _per_query_head(dens: torch.Tensor, space: str, group: int) -> torch.Tensor:
    """Per index head densities [H] -> per query head [Hq] (a KV head's pattern serves its whole group)."""
    return dens.repeat_interleave(group) if space == "kv" else dens


def _group_densities(g, q, k, space: str) -> torch.Tensor:
    """Density per query head of one head group's index as the runtime builds it [len(query heads)]."""
    n = q.shape[2]
    if g.pattern == "grid":
        index, lines = grid_form(g, n, k.shape[2], space, q.device, batch=q.shape[0])
    else:
        index, lines = build_group_index(g, q, k, space), None
    return _per_query_head(head_density(index, n, k.shape[2], lines=lines), space, q.shape[1] // k.shape[1])


def analytic_layer(layer, q: torch.Tensor, k: torch.Tensor, space: str) -> tuple[float, float, float]:
    """(sparse ms, dense ms, mean density over query heads) of one layer under the cost model.

    layer: runtime.plan.LayerPlan; q [1, Hq, N, D], k [1, Hkv, N, D] (v is not needed to count)."""
    n, q_heads, dim = q.shape[2], q.shape[1], q.shape[-1]
    total = causal_entries(n)
    dense_ms = float(analytic_ms("dense", torch.full((q_heads,), float(total), dtype=torch.float64), dim, n).sum())
    density = torch.ones(q_heads, dtype=torch.float64)
    sparse_ms = torch.zeros(q_heads, dtype=torch.float64)
    covered = torch.zeros(q_heads, dtype=torch.bool)
    if layer.kind == "triangle":
        d = triangle.density(layer.triangle, n, block_m=triangle.LAYER_BLOCK, block_n=triangle.LAYER_BLOCK)
        density[:] = d
        sparse_ms[:] = analytic_ms("triangle", torch.full((q_heads,), d * total, dtype=torch.float64), dim, n)
        covered[:] = True
    for g in layer.groups:
        ids = query_heads(g.heads, space, q_heads // k.shape[1])
        d = _group_densities(g, q, k, space)
        density[ids] = d
        sparse_ms[ids] = analytic_ms(g.pattern, d * total, dim, n)
        covered[ids] = True
    rest = int((~covered).sum())
    sparse_ms[~covered] = analytic_ms("dense", torch.full((rest,), float(total), dtype=torch.float64), dim, n)
    if layer.kind == "window":  # the model's own attention: the same work on the dense side
        dense_ms = float(sparse_ms.sum())
    return float(sparse_ms.sum()), dense_ms, float(density.mean())


def measured_layer(runner, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                   space: str) -> tuple[float, float, float]:
    """(sparse ms, dense ms, mean density) of one layer on a GPU: the GPU time of the runtime's call (index
    builds included) against causal SDPA's on the same q [1, Hq, N, D], k/v [1, Hkv, N, D]; the density is
    the analytic one's (what was computed)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    sparse = kernel_ms(lambda: runner.attend(layer, q, k, v, scale=scale))
    if layer.kind == "window":
        dense = sparse
    else:
        gqa = q.shape[1] != k.shape[1]
        dense = kernel_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))
    return sparse, dense, analytic_layer(layer, q, k, space)[2]


def layer_cost(runner, layer, q, k, v, scale: float | None, space: str) -> tuple[float, float, float]:
    """``measured_layer`` on CUDA tensors, ``analytic_layer`` elsewhere."""
    if q.is_cuda:
        return measured_layer(runner, layer, q, k, v, scale, space)
    return analytic_layer(layer, q, k, space)
