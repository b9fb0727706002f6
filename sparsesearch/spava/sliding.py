"""Exact sliding-window attention on SPAVA's layout (a hybrid model's sliding layers, Gemma 3).

SPAVA approximates global attention only; a sliding layer's window is local already, so it runs exactly:
a row at position p needs keys in (p - window, p], which lie in the anchor, its own block, or the last
`window` tokens of earlier blocks. Each rank all-gathers those tails (the last min(window, len) keys of
both its blocks, padded to `window` with position -inf-like), then every local row attends
[its local tokens ; the other ranks' tails] under the causal window mask by global position.
"""

from __future__ import annotations

import torch

from ..reference import masked_attention
from .comm import gather_async
from .exact import position_mask
from .layout import Layout

_FAR = -(1 << 40)  # position of padding keys: outside every window


def _tails(k, v, layout: Layout, rank: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K‖V [B, Hkv, 2·window, 2D] and positions long [2·window] of the last `window` keys of rank r's blocks."""
    b, h, _, d = k.shape
    kv = torch.zeros(b, h, 2 * window, 2 * d, dtype=k.dtype, device=k.device)
    pos = torch.full((2 * window,), _FAR, dtype=torch.long, device=k.device)
    local = layout.l_a
    for slot, j in enumerate(layout.vhosts(rank)):
        s, e = layout.block(j)
        take = min(window, e - s)
        lo = local + (e - s) - take  # local index of the tail's first token
        kv[:, :, slot * window : slot * window + take] = torch.cat([k[:, :, lo : lo + take], v[:, :, lo : lo + take]], dim=-1)
        pos[slot * window : slot * window + take] = torch.arange(e - take, e, device=k.device)
        local += e - s
    return kv, pos


def sliding_attention(q, k, v, layout: Layout, rank: int, scale: float, window: int, group=None, stats: dict | None = None) -> torch.Tensor:
    """q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] over rank r's local tokens -> out [B, Hq, N_r, D], exact."""
    kv_tail, pos_tail = _tails(k, v, layout, rank, window)
    got_kv, w1 = gather_async(kv_tail.transpose(0, 2).contiguous(), group)  # [2·window, Hkv, B, 2D]: token-major
    got_pos, w2 = gather_async(pos_tail, group)
    w1.wait()
    w2.wait()
    others = [s for s in range(layout.world) if s != rank]
    d = k.shape[-1]
    pos = torch.tensor(layout.local_positions(rank), device=q.device)
    if others:
        tail = torch.cat([got_kv[s] for s in others], dim=0).transpose(0, 2)  # [B, Hkv, (W-1)·2·window, 2D]
        k_all = torch.cat([k, tail[..., :d]], dim=2)
        v_all = torch.cat([v, tail[..., d:]], dim=2)
        k_pos = torch.cat([pos, *(got_pos[s] for s in others)])
    else:
        k_all, v_all, k_pos = k, v, pos
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + (kv_tail.numel() * kv_tail.element_size() + pos_tail.numel() * 8) * len(others)
    return masked_attention(q, k_all, v_all, position_mask(pos, k_pos, window), scale=scale)[0].to(q.dtype)
