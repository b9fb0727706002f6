"""Dense masked attention in torch: the oracle of every kernel and pattern test.

Queries are processed in chunks so that an 8K-token sequence runs on a CPU without an n x n matrix in
memory at once. Everything is computed in float32 (or float64 when the inputs are float64).

Layout follows torch SDPA: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D], Hq a multiple of Hkv (GQA).
Queries are bottom-right aligned: query row i sits at key position i + Nk - Nq.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .index import BlockIndex, num_blocks

# mask_fn(rows) -> bool [B or 1, Hq or 1, len(rows), Nk]: which keys each query row in `rows` admits.
MaskFn = Callable[[torch.Tensor], torch.Tensor]
# mask_mod-style predicate over absolute positions: (b, h, q_pos, kv_idx) -> bool, broadcasting.
Predicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_fn: MaskFn | None = None,
    *,
    scale: float | None = None,
    chunk: int = 256,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the admitted keys. Returns out [B, Hq, Nq, D] and natural-log lse [B, Hq, Nq].

    mask_fn None means causal (bottom-right aligned). A row with no admitted key gives out 0, lse -inf.
    upcast=False computes in the inputs' own (low) precision: its error against the upcast result is the
    yardstick kernel errors are measured by (STYLE.md, habit 4).
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    compute = compute if upcast else q.dtype
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = q_heads // kv_heads
    # The oracle may repeat K/V: it is the slow, obviously-right path, not a kernel.
    k_full = k.to(compute).repeat_interleave(group, dim=1)
    v_full = v.to(compute).repeat_interleave(group, dim=1)
    mask_fn = mask_fn or causal_mask_fn(q_len, kv_len)
    out = torch.empty(batch, q_heads, q_len, dim, dtype=compute, device=q.device)
    lse = torch.empty(batch, q_heads, q_len, dtype=compute, device=q.device)
    for start in range(0, q_len, chunk):
        rows = torch.arange(start, min(q_len, start + chunk), device=q.device)
        scores = q[:, :, rows].to(compute) @ k_full.transpose(-1, -2) * scale
        scores = scores.masked_fill(~mask_fn(rows), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse.nan_to_num(neginf=0.0).unsqueeze(-1)).to(compute)
        out[:, :, rows] = probs @ v_full
        lse[:, :, rows] = row_lse
    return out, lse


def admitted_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    mask_fn: MaskFn,
    *,
    scale: float | None = None,
    chunk: int = 8,
) -> torch.Tensor:
    """Recall of a sparse pattern: the share of each row's causal softmax mass on its admitted keys.

    q [B, Hq, Nq, D], k [B, Hkv, Nk, D], rows int64 [R] (query rows to score), mask_fn as for
    ``masked_attention``. Returns float32 [B, Hq, R] in [0, 1]. Scores are float32 for ``chunk`` rows at a
    time against every key ([B, Hq, chunk, Nk]); a GQA group shares its K rows through a view, so K is
    never repeated (at 1M keys a repeated float32 K is 16 GiB).
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    causal_fn = causal_mask_fn(q_len, kv_len)
    k32 = k.float()
    out = torch.empty(batch, q_heads, rows.numel(), dtype=torch.float32, device=q.device)
    for start in range(0, rows.numel(), chunk):
        part = rows[start: start + chunk]
        qg = q[:, :, part].float().view(batch, kv_heads, group * part.numel(), dim)
        scores = (qg @ k32.transpose(-1, -2) * scale).view(batch, q_heads, part.numel(), kv_len)
        causal = causal_fn(part)
        total = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)
        kept = torch.logsumexp(scores.masked_fill(~(mask_fn(part) & causal), float("-inf")), dim=-1)
        out[:, :, start: start + part.numel()] = torch.exp(kept - total)
    return out


def causal_mask_fn(q_len: int, kv_len: int, device: torch.device | str | None = None) -> MaskFn:
    offset = kv_len - q_len

    def mask(rows: torch.Tensor) -> torch.Tensor:
        cols = torch.arange(kv_len, device=rows.device)
        return (cols[None, :] <= rows[:, None] + offset)[None, None]

    return mask


def predicate_mask_fn(predicate: Predicate, batch: int, heads: int, q_len: int, kv_len: int) -> MaskFn:
    """Adapt a mask_mod-style predicate (over absolute positions) to ``masked_attention``."""
    offset = kv_len - q_len

    def mask(rows: torch.Tensor) -> torch.Tensor:
        device = rows.device
        b = torch.arange(batch, device=device)[:, None, None, None]
        h = torch.arange(heads, device=device)[None, :, None, None]
        pos = (rows + offset)[None, None, :, None]
        cols = torch.arange(kv_len, device=device)[None, None, None, :]
        admitted = predicate(b, h, pos, cols).expand(batch, heads, rows.numel(), kv_len)
        return admitted & (cols <= pos)

    return mask


def index_mask_fn(index: BlockIndex, q_len: int, kv_len: int, group: int = 1, row_pos: torch.Tensor | None = None) -> MaskFn:
    """Token-level mask an index admits (see index.py for the rules), per query head.

    group: query heads per index head when ``index.head_space == "kv"`` (1 otherwise).
    row_pos: a permuted region's frame (row i admits keys j <= row_pos[i]); None: bottom-right causal.
    """
    offset = kv_len - q_len
    kv_blocks = num_blocks(kv_len, index.block_n)
    from .index import select_q_blocks, to_block_masks, to_column_mask  # local: keeps the oracle's imports short

    def mask(rows: torch.Tensor) -> torch.Tensor:
        device = rows.device
        q_block = rows // index.block_m
        # Only the rows' query blocks are expanded to keys: [B, H, R, Nk], never [B, H, QB, Nk] (at 1M keys
        # the whole column mask would be terabytes).
        sub = select_q_blocks(index, q_block.to(index.device))
        full, partial = (t.to(device) for t in to_block_masks(sub, kv_blocks))
        in_cols = to_column_mask(sub, kv_len).to(device)
        cols = torch.arange(kv_len, device=device)
        k_block = cols // index.block_n
        pos = (rows + offset if row_pos is None else row_pos.to(device)[rows])[:, None]
        causal = cols[None, :] <= pos
        token = torch.ones_like(causal)
        if index.window >= 0:
            token = (pos - cols[None, :] < index.window) | (cols[None, :] < index.sink)
        admitted = full[..., k_block] | (partial[..., k_block] & token) | in_cols
        if index.head_space == "kv" and group > 1:
            admitted = admitted.repeat_interleave(group, dim=1)
        return admitted & causal

    return mask


def pool_mask(mask: torch.Tensor, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool a token mask to blocks: the slow, obviously-right twin of every fast index builder.

    mask: bool [B, H, Nq, Nk] (already including causality). Returns (full, partial) bool [B, H, QB, KB]:
    a block is full when every key of every valid row is admitted *and* the block lies wholly inside the
    causal region and kv range (the kernel applies no mask there), partial when some key is admitted.
    """
    batch, heads, q_len, kv_len = mask.shape
    qb, kb = num_blocks(q_len, block_m), num_blocks(kv_len, block_n)
    # Padding rows (past q_len) must not spoil "all": pad them True for `all`, False for `any`.
    padded_all = torch.ones(batch, heads, qb * block_m, kb * block_n, dtype=torch.bool, device=mask.device)
    padded_all[:, :, :, kv_len:] = False
    padded_all[:, :, :q_len, :kv_len] = mask
    padded_any = torch.zeros_like(padded_all)
    padded_any[:, :, :q_len, :kv_len] = mask
    shape = (batch, heads, qb, block_m, kb, block_n)
    every = padded_all.view(shape).all(dim=5).all(dim=3)
    some = padded_any.view(shape).any(dim=5).any(dim=3)
    return every, some & ~every


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def error_floor(dtype: torch.dtype, device) -> float:
    """The absolute part of a kernel's error budget (the rest is twice the low-precision oracle's own
    error). fp32 dots run as TF32 on a GPU (Triton's default input precision), ~1e-3 relative, so fp32
    gets the CPU interpreter's 1e-5 only off the GPU."""
    if dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 2e-3
    return 1e-3 if dtype == torch.float16 else 4e-3
