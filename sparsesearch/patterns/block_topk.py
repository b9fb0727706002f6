"""Block top-k attention (MInference "block_sparse"): each query block keeps the key blocks whose pooled
keys score highest against its pooled queries.

Selection per (batch, head, query block m), all at block level:

* pooled q = mean of the block's valid query rows, pooled k = mean of the block's valid keys;
* score[m, kb] = pooled_q[m] . pooled_k[kb]; for head_space "kv" each query head's scores go through a
  softmax over its candidate blocks (scale 1/sqrt(D)) and the GQA group's probabilities are summed, so
  the KV head's index serves every query head: a head's favourite block gets ~1 whatever its logit scale,
  where a sum of raw scores let one head's large or negative scores bury another's choice (planted
  groups of heads wanting different blocks: error 0.75 mean per query head with raw sums, see
  tests/test_planted_search.py);
* forced blocks: the first ``sink_blocks`` key blocks and every "diagonal" key block, i.e. every block that
  holds some row's own position (kb in [first // block_n, last // block_n]; one or two blocks when
  block_m == block_n), so no row is left without keys;
* plus the ``k_blocks`` best-scoring other causal blocks (kb * block_n <= last row position); ties go to
  the lower block id (a stable sort, not ``torch.topk``).

Key ``j`` is admitted for the query at absolute position ``pos`` iff ``j <= pos`` and ``j // block_n`` is
selected for the query's block. The index lists the selection: full where a block is wholly causal and
inside kv_len, partial otherwise (window off). Which blocks win depends on the data, but how many and
where the forced ones sit does not, so ``density`` is exact without data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import BlockIndex, num_blocks
from ._common import (
    ascii_blocks, ascii_mask, block_entries, causal_entries, check_head_space, check_int, check_lengths,
    check_qk, full_block, index_from_candidates, query_block_bounds, top_ids,
)

NAME = "block_topk"


@dataclass(frozen=True)
class BlockTopKParams:
    """k_blocks (>= 0): scored blocks per query block besides the forced ones; sink_blocks (>= 0)."""

    k_blocks: int = 16
    sink_blocks: int = 1

    def __post_init__(self) -> None:
        check_int("k_blocks", self.k_blocks, 0)
        check_int("sink_blocks", self.sink_blocks, 0)


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = BlockTopKParams
DYNAMIC = True  # index estimated from q/k at run time: build_index(params, q, k, ...)
REGION = True  # build_index takes a permuted region frame (row_pos)
STREAMING = False  # keeps keys beyond sinks + a recent window
COLOR = "#2ca02c"  # heads map (report/heads_map.py)
LABEL = "topk"  # its column header in tables that fit 80 columns (inspect)


def demo_params(tokens: int) -> BlockTopKParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    return BlockTopKParams(k_blocks=2, sink_blocks=1)


@dataclass(frozen=True)
class BlockSelection:
    """Selected key blocks: bool [B, H, QB, KB] (block level) and the geometry it was made for."""

    blocks: torch.Tensor
    q_len: int
    kv_len: int
    block_m: int
    block_n: int
    head_space: str
    row_pos: torch.Tensor | None = None  # a permuted region's frame (None: bottom-right causal)


def _pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over consecutive blocks of rows of x [B, H, N, D] (valid rows only): [B, H, ceil(N / block), D]."""
    batch, heads, length, dim = x.shape
    blocks = num_blocks(length, block)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, blocks * block - length))
    sums = padded.view(batch, heads, blocks, block, dim).sum(3)
    counts = torch.clamp(length - torch.arange(blocks, device=x.device) * block, max=block)
    return sums / counts[:, None].to(sums.dtype)


def select(
    params: BlockTopKParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    row_pos: torch.Tensor | None = None,
) -> BlockSelection:
    """Block selection from q [B, Hq, Nq, D] and k [B, Hkv, Nk, D]; memory O(QB x KB) per head.
    row_pos: a permuted region's frame; "diagonal" blocks are then those of each row's frontier."""
    check_head_space(head_space)
    q_heads, kv_heads, q_len, kv_len = check_qk(q, k, row_pos)
    batch, group = q.shape[0], q_heads // kv_heads
    pooled_q = _pool(q, block_m)  # [B, Hq, QB, D]
    pooled_k = _pool(k, block_n)  # [B, Hkv, KB, D]
    q_blocks, kv_blocks = pooled_q.shape[2], pooled_k.shape[2]
    scores = pooled_q.view(batch, kv_heads, group, q_blocks, -1) @ pooled_k[:, :, None].transpose(-1, -2)
    first, last = query_block_bounds(q_len, kv_len, block_m, q.device, row_pos)
    kb = torch.arange(kv_blocks, device=q.device)[None, :]
    causal = kb * block_n <= last[:, None]
    forced = ((kb < params.sink_blocks) | (kb >= (first.clamp(min=0) // block_n)[:, None])) & causal
    open_blocks = causal & ~forced  # [QB, KB]: what the top-k chooses from
    if head_space == "kv":
        # Per query head probabilities over its open blocks, summed over the group (a query block with no
        # open block has an all -inf row: nan -> 0, it chooses nothing anyway).
        scale = 1.0 / q.shape[-1] ** 0.5
        probs = torch.softmax((scores * scale).masked_fill(~open_blocks, float("-inf")), dim=-1).nan_to_num(0.0)
        scores = probs.sum(2)
    else:
        scores = scores.reshape(batch, q_heads, q_blocks, kv_blocks)
    candidates = scores.masked_fill(~open_blocks, float("-inf"))
    chosen = torch.zeros_like(causal).expand_as(scores).clone()
    take = min(params.k_blocks, kv_blocks)
    if take:
        ids = top_ids(candidates, take)
        chosen.scatter_(-1, ids, True)
    blocks = (chosen & causal & ~forced) | forced
    return BlockSelection(blocks, q_len, kv_len, block_m, block_n, head_space, row_pos)


def index_from_selection(selection: BlockSelection, static_widths: bool = False) -> BlockIndex:
    """BlockIndex of a selection (window off): full when wholly causal and in range, partial otherwise.
    static_widths: lists as wide as the key blocks instead of the largest count (no device sync: the
    build can be captured in a CUDA graph, graphed.GraphedIndexCache)."""
    s = selection
    first, _ = query_block_bounds(s.q_len, s.kv_len, s.block_m, s.blocks.device, s.row_pos)
    kv_blocks = s.blocks.shape[-1]
    kb = torch.arange(kv_blocks, device=s.blocks.device)
    is_full = full_block(kb[None, :], first[:, None], s.kv_len, s.block_n)
    return index_from_candidates(
        kb.expand_as(s.blocks), s.blocks, is_full.expand_as(s.blocks), kv_blocks, s.block_m, s.block_n,
        head_space=s.head_space, meta={"pattern": NAME, "selection": s}, width=kv_blocks if static_widths else None,
    )


def build_index(
    params: BlockTopKParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    row_pos: torch.Tensor | None = None,
    static_widths: bool = False,
) -> BlockIndex:
    """select + index_from_selection; ``meta["selection"]`` keeps the BlockSelection (for ``predicate``).
    static_widths: no device sync (``index_from_selection``). The torch build, the reference: the fused
    Triton build of the same index, and the choice between the two, are kernels/dynamic_index.py's."""
    selection = select(params, q, k, head_space=head_space, block_m=block_m, block_n=block_n, row_pos=row_pos)
    return index_from_selection(selection, static_widths)


def predicate(params: BlockTopKParams, selection: BlockSelection, group: int = 1):
    """mask_mod-style predicate over absolute positions for a given selection.

    group: query heads per selection head (the GQA group when the selection is in head_space "kv" and the
    predicate is evaluated per query head), else 1.
    """
    s = selection
    offset = s.kv_len - s.q_len

    def block_topk(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_block = torch.clamp(q_pos - offset, min=0) // s.block_m
        return (kv_idx <= q_pos) & s.blocks[b, h // group, q_block, kv_idx // s.block_n]

    block_topk.__name__ = f"block_topk_{params.k_blocks}_{params.sink_blocks}"
    return block_topk


def density(params: BlockTopKParams, q_len: int, *, kv_len: int | None = None, block_m: int = 64, block_n: int = 64) -> float:
    """Exact fraction of the causal matrix the kernel computes (independent of the data, see module doc)."""
    kv_len = check_lengths(q_len, kv_len)
    first, last = query_block_bounds(q_len, kv_len, block_m)
    rows = last - first + 1
    diag_lo, diag_hi = first // block_n, last // block_n
    # Diagonal blocks: closed-form causal count; below them every selected block is whole (rows x block_n).
    kb = torch.arange(num_blocks(kv_len, block_n))[None, :]
    in_diag = (kb >= diag_lo[:, None]) & (kb <= diag_hi[:, None])
    lo = kb * block_n
    hi = torch.clamp(lo + block_n - 1, max=kv_len - 1)
    diag_entries = torch.where(in_diag, block_entries(first[:, None], last[:, None], lo, hi), 0).sum(-1)
    below = diag_lo  # causal blocks strictly left of the diagonal ones
    sink_below = torch.clamp(below, max=params.sink_blocks)
    chosen = sink_below + torch.clamp(below - sink_below, max=params.k_blocks)
    computed = diag_entries + chosen * rows * block_n
    return int(computed.sum()) / causal_entries(q_len, kv_len)


def main() -> None:
    torch.manual_seed(0)
    params = BlockTopKParams(k_blocks=1, sink_blocks=1)
    q_len = kv_len = 64
    q, k = torch.randn(1, 1, q_len, 16), torch.randn(1, 1, kv_len, 16)
    # Plant: query block 3 looks for key block 1.
    q[:, :, 48:64, 0] += 4.0
    k[:, :, 16:32, 0] += 4.0
    index = build_index(params, q, k, block_m=16, block_n=16)
    selection = index.meta["selection"]
    zero = torch.zeros((), dtype=torch.int64)
    pos, cols = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    print(f"{predicate(params, selection).__name__}: sink block + diagonal + 1 scored block per query block")
    print(ascii_mask(predicate(params, selection)(zero, zero, pos, cols)))
    print("block index (block_m=16, block_n=16): F full, P partial")
    print(ascii_blocks(index, kv_len))
    print(f"density: {density(params, q_len, block_m=16, block_n=16):.3f}")


if __name__ == "__main__":
    main()
