"""Merge partial attention results by their log-sum-exp (plain torch, no kernel).

Two partials over disjoint key sets, (o_a, lse_a) and (o_b, lse_b), combine exactly into the attention
over the union: lse = logaddexp(lse_a, lse_b), o = σ(lse_a − lse_b)·o_a + σ(lse_b − lse_a)·o_b. Used by
the triangle kernel's split-K tail (kernels/triangle.py), the boundary heads' regions (patterns/boundary.py)
and later SPAVA's cross-rank merge.
A partial with lse = −inf (no admitted key) contributes nothing; if every partial is empty the result is
o = 0, lse = −inf, never NaN.
"""

from __future__ import annotations

import torch


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partials stacked along ``dim``.

    outs [..., S, ..., D] (any float dtype), lses [..., S, ...] natural-log, same leading shape as outs
    without D. Returns (out fp32 [... without S, D], lse fp32 [... without S]).
    """
    if outs.dim() != lses.dim() + 1 or outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {tuple(outs.shape)} must be lses {tuple(lses.shape)} plus a head_dim axis")
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=dim)
    # Empty merged rows have lse = -inf; shift by 0 there so the weights come out 0 instead of NaN.
    weights = torch.exp(lses - lse.nan_to_num(neginf=0.0).unsqueeze(dim))
    out = (weights.unsqueeze(-1) * outs.float()).sum(dim=dim)
    return out, lse


def merge_two(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials of the same shape: o [..., D], lse [...]. Returns fp32 (out, lse)."""
    return merge_partials(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
