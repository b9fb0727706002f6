"""A-shape (StreamingLLM) attention: attention sinks plus a sliding local window.

Key ``j`` is admitted for the query at absolute position ``pos`` iff ``j <= pos`` and
(``j < sink`` or ``pos - j < local``). MMInference (paper 000, App. C.3, Table 3) searches
(sink, local) in {(128, 1024), (128, 2048), (128, 4096)}; it is a static pattern (no estimation).

The index is exact: it sets ``BlockIndex.window = local`` and ``sink = sink`` so the kernel's token mask in
partial blocks reproduces the predicate; a key block is full when it lies wholly inside the sink
(``(kb + 1) * block_n <= sink``) or wholly inside every row's window, and is causal and inside kv_len
for every row of its query block. A block that is fully admitted only because the sink covers one part
of it and the window the other is listed as partial (the rule ``index.validate`` enforces); the token
mask then admits all of it, so the result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import BlockIndex, num_blocks
from ._common import (
    ascii_blocks, ascii_mask, causal_entries, check_int, check_lengths, expand_heads, full_block,
    check_frame, index_entries, index_from_candidates, max_block_span, predicate_grid, query_block_bounds,
)

NAME = "ashape"


@dataclass(frozen=True)
class AShapeParams:
    """sink: leading keys every query attends (>= 0); local: window width, pos - j < local (>= 1)."""

    sink: int = 128
    local: int = 1024

    def __post_init__(self) -> None:
        check_int("sink", self.sink, 0)
        check_int("local", self.local, 1)


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = AShapeParams
DYNAMIC = False  # index from the shape alone: build_index(params, q_len, kv_len, ...)
REGION = True  # build_index takes a permuted region frame (row_pos)
STREAMING = True  # attention sinks + a recent window only (a DuoAttention streaming head)
COLOR = "#1f77b4"  # heads map (report/heads_map.py)
LABEL = "A-shp"  # its column header in tables that fit 80 columns (inspect)


def demo_params(tokens: int) -> AShapeParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    return AShapeParams(sink=16, local=max(1, tokens // 4))


def predicate(params: AShapeParams):
    """mask_mod-style predicate over absolute positions."""
    sink, local = params.sink, params.local

    def ashape(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_pos) & ((kv_idx < sink) | (q_pos - kv_idx < local))

    ashape.__name__ = f"ashape_{sink}_{local}"
    return ashape


def stream_candidates(
    sink: int, local: int, q_len: int, kv_len: int, block_m: int, block_n: int, device: torch.device | str | None,
    row_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidate key blocks of the sink + window pattern per query block: (ids, valid, is_full), [QB, C].

    Per query block (rows at positions [first, last]) the admitted blocks are two intervals: the sink
    blocks [0, ceil(sink / block_n)) and the window blocks [max(first - local + 1, 0) // block_n, ...],
    both cut at the causal edge last // block_n. The window interval starts after the sink interval, so
    the concatenation is ascending and repeat-free. C = O((sink + local) / block_n): no [QB, KB] tensor.
    In a region (row_pos) a query block can span more than block_m positions; the window widens to match.
    """
    kv_blocks = num_blocks(kv_len, block_n)
    first, last = query_block_bounds(q_len, kv_len, block_m, device, row_pos)
    span = max_block_span(first, last, block_m)
    first, last = first[:, None], last[:, None]
    edge = last // block_n  # last key block with a causal key
    sink_blocks = min(num_blocks(sink, block_n), kv_blocks)
    sink_ids = torch.arange(sink_blocks, device=device, dtype=torch.int64)[None, :].expand(first.shape[0], sink_blocks)
    window_start = torch.clamp(torch.clamp(first - local + 1, min=0) // block_n, min=sink_blocks)
    window_width = min(kv_blocks, (local + span - 2) // block_n + 2)
    window_ids = window_start + torch.arange(window_width, device=device, dtype=torch.int64)[None, :]
    ids = torch.cat([sink_ids, window_ids], dim=1)
    valid = ids <= edge
    in_sink = (ids + 1) * block_n <= sink
    in_window = last - ids * block_n < local
    is_full = full_block(ids, first, kv_len, block_n) & (in_sink | in_window)
    return ids, valid, is_full


def build_index(
    params: AShapeParams,
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
    """Exact A-shape index (window/sink set), the same for every (batch, head): expanded views of [1, 1, QB, *].
    row_pos: a permuted region's frame — the window then counts keys back from each row's frontier."""
    kv_len = check_frame(q_len, kv_len, row_pos)
    ids, valid, is_full = stream_candidates(params.sink, params.local, q_len, kv_len, block_m, block_n, device, row_pos)
    index = index_from_candidates(
        ids[None, None], valid[None, None], is_full[None, None], num_blocks(kv_len, block_n), block_m, block_n,
        head_space=head_space, window=params.local, sink=params.sink, meta={"pattern": NAME},
    )
    return expand_heads(index, batch, heads)


def density(params: AShapeParams, q_len: int, *, kv_len: int | None = None, block_m: int = 64, block_n: int = 64) -> float:
    """Fraction of the causal matrix the kernel computes: causal entries of every listed block (block granularity)."""
    kv_len = check_lengths(q_len, kv_len)
    index = build_index(params, q_len, kv_len, block_m=block_m, block_n=block_n)
    return index_entries(index, q_len, kv_len) / causal_entries(q_len, kv_len)


def main() -> None:
    params = AShapeParams(sink=4, local=8)
    q_len = kv_len = 64
    print(f"{predicate(params).__name__}, q_len={q_len}")
    print(ascii_mask(predicate_grid(predicate(params), q_len, kv_len)))
    index = build_index(params, q_len, kv_len, block_m=16, block_n=16)
    print("block index (block_m=16, block_n=16): F full, P partial (token mask: window=8, sink=4)")
    print(ascii_blocks(index, kv_len))
    print(f"density at block granularity: {density(params, q_len, block_m=16, block_n=16):.3f}")


if __name__ == "__main__":
    main()
