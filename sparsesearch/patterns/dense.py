"""Dense causal attention as a pattern: the baseline every sparse pattern is measured against.

Key ``j`` is admitted for the query at absolute position ``pos`` iff ``j <= pos``. The index lists every
causal key block: full when it lies wholly below the diagonal of its query block (and inside kv_len),
partial when it touches the diagonal or runs past kv_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import BlockIndex, num_blocks
from ._common import (
    ascii_blocks, ascii_mask, check_lengths, expand_heads, full_block, index_from_candidates,
    predicate_grid, query_block_bounds, check_frame,
)

NAME = "dense"


@dataclass(frozen=True)
class DenseParams:
    """Dense causal attention has no parameters."""


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = DenseParams
DYNAMIC = False  # index from the shape alone: build_index(params, q_len, kv_len, ...)
REGION = True  # build_index takes a permuted region frame (row_pos)
STREAMING = False  # keeps keys beyond sinks + a recent window
COLOR = "#4d4d4d"  # heads map (report/heads_map.py)
LABEL = "dense"  # its column header in tables that fit 80 columns (inspect)


def demo_params(tokens: int) -> DenseParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    return DenseParams()


def predicate(params: DenseParams | None = None):
    """mask_mod-style predicate over absolute positions: ``kv_idx <= q_pos``."""

    def causal(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx <= q_pos

    causal.__name__ = "causal"
    return causal


def build_index(
    params: DenseParams | None,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    block_m: int = 64,
    block_n: int = 64,
    head_space: str = "query",
    device: torch.device | str | None = None,
    row_pos: torch.Tensor | None = None,
) -> BlockIndex:
    """Causal block index, the same for every (batch, head): tensors are expanded views of [1, 1, QB, *].

    Lists are O(QB x KB) by nature (dense attention loads every causal block). row_pos: a permuted
    region's frame (see _common.query_block_bounds).
    """
    kv_len = check_frame(q_len, kv_len, row_pos)
    kv_blocks = num_blocks(kv_len, block_n)
    first, last = query_block_bounds(q_len, kv_len, block_m, device, row_pos)
    kb = torch.arange(kv_blocks, device=device, dtype=torch.int64)[None, :]
    ids = kb.expand(first.numel(), kv_blocks)
    valid = kb * block_n <= last[:, None]
    is_full = full_block(kb, first[:, None], kv_len, block_n)
    index = index_from_candidates(
        ids[None, None], valid[None, None], is_full[None, None], kv_blocks, block_m, block_n,
        head_space=head_space, meta={"pattern": NAME},
    )
    return expand_heads(index, batch, heads)


def density(params: DenseParams | None, q_len: int, *, kv_len: int | None = None, block_m: int = 64, block_n: int = 64) -> float:
    """Dense attention computes every causal entry: 1.0 (entries above the diagonal are not counted)."""
    check_lengths(q_len, kv_len)
    return 1.0


def main() -> None:
    q_len, kv_len = 24, 40
    print(f"dense causal, q_len={q_len}, kv_len={kv_len} (queries bottom-right aligned)")
    print(ascii_mask(predicate_grid(predicate(DenseParams()), q_len, kv_len)))
    index = build_index(DenseParams(), q_len, kv_len, block_m=16, block_n=16)
    print("block index (block_m=16, block_n=16): F full, P partial")
    print(ascii_blocks(index, kv_len))


if __name__ == "__main__":
    main()
