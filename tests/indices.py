"""Random block indices for kernel tests: every legal combination the kernel must handle."""

from __future__ import annotations

import torch

from sparsesearch.index import BlockIndex, from_block_masks, num_blocks


def random_index(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    block_m: int,
    block_n: int,
    *,
    density: float = 0.5,
    full_share: float = 0.7,
    columns: int = 0,
    window: int = -1,
    sink: int = 0,
    head_space: str = "query",
    seed: int = 0,
    device: str = "cpu",
) -> BlockIndex:
    """Random causal block selection (some full, some partial) plus up to ``columns`` gathered columns per
    query block, uncovered by the selected blocks. With a window every block is partial (its mask applies)."""
    gen = torch.Generator().manual_seed(seed)
    qb, kb = num_blocks(q_len, block_m), num_blocks(kv_len, block_n)
    offset = kv_len - q_len
    qi = torch.arange(qb)[:, None]
    ki = torch.arange(kb)[None, :]
    first_pos = qi * block_m + offset
    last_pos = torch.clamp((qi + 1) * block_m, max=q_len) - 1 + offset
    reachable = ki * block_n <= last_pos
    whole = ((ki + 1) * block_n - 1 <= first_pos) & ((ki + 1) * block_n <= kv_len)
    shape = (batch, heads, qb, kb)
    pick = (torch.rand(shape, generator=gen) < density) & reachable
    full = pick & whole & (torch.rand(shape, generator=gen) < full_share)
    if window >= 0:
        full = torch.zeros_like(full)
    partial = pick & ~full
    cols = None
    if columns:
        tok = torch.arange(kv_len)
        covered = (full | partial).repeat_interleave(block_n, dim=-1)[..., :kv_len]
        allowed = (tok[None, :] <= last_pos) & ~covered
        scores = torch.rand(batch, heads, qb, kv_len, generator=gen).masked_fill(~allowed, -1.0)
        top = scores.topk(min(columns, kv_len), dim=-1)
        cols = torch.zeros(batch, heads, qb, kv_len, dtype=torch.bool)
        cols.scatter_(-1, top.indices, top.values > 0)
    index = from_block_masks(full, partial, block_m, block_n, head_space=head_space, columns=cols, window=window, sink=sink)
    return index.to(device)


def dense_causal_index(batch: int, heads: int, q_len: int, kv_len: int, block_m: int, block_n: int, device: str = "cpu") -> BlockIndex:
    """Every causal block: full below the diagonal, partial where a mask is needed."""
    return random_index(batch, heads, q_len, kv_len, block_m, block_n, density=1.1, full_share=1.1, device=device)
