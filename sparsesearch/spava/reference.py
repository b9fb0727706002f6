"""SPAVA in one process, as dense attention under a mask over the whole sequence: the oracle of the
distributed version (tests/test_spava.py).

The mask is built from the definition (paper 001 Eq. 4-5), not from the exchange: anchor rows are causal
over the anchor; rows of virtual host j see the anchor, their own block causally and the passing keys
selected from every block h < j; query rows see the whole context and the query causally. Selection is
per KV head, so the mask is [B, Hkv, N, N] — test sizes only.
"""

from __future__ import annotations

import torch

from ..reference import masked_attention
from .attention import passing_indices, query_mean
from .layout import Layout


def spava_mask(q: torch.Tensor, k: torch.Tensor, layout: Layout) -> torch.Tensor:
    """q [B, Hq, N, D], k [B, Hkv, N, D] over the global sequence -> bool [B, Hkv, N, N] (True = attend)."""
    b, hkv, n, _ = k.shape
    pos = torch.arange(n, device=k.device)
    mask = (pos[None, :] <= pos[:, None]).repeat(b, hkv, 1, 1)  # causal everywhere, then cut
    qm = query_mean(q[:, :, layout.n_ctx :], hkv)
    ctx_allowed = torch.zeros(b, hkv, n, dtype=torch.bool, device=k.device)
    ctx_allowed[..., : layout.l_a] = True
    for j in range(layout.hosts):
        s, e = layout.block(j)
        allowed = ctx_allowed.clone()
        allowed[..., s:e] = True
        mask[:, :, s:e, : layout.n_ctx] &= allowed[:, :, None, : layout.n_ctx]
        idx = passing_indices(qm, k[:, :, s:e], layout.passing) + s
        ctx_allowed.scatter_(2, idx, True)  # vhosts after j see j's passing keys
    return mask


def spava_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float) -> torch.Tensor:
    """SPAVA over the global sequence in one process: q [B, Hq, N, D], k/v [B, Hkv, N, D] -> fp32 [B, Hq, N, D]."""
    group = q.shape[1] // k.shape[1]
    mask = spava_mask(q, k, layout).repeat_interleave(group, dim=1)
    return masked_attention(q, k, v, lambda rows: mask[:, :, rows], scale=scale)[0]
