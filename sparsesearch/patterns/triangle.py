"""Triangle attention (TriangleMix, paper 002 §2.2-2.4): A-shape for most rows, dense for the last rows.

Sections (absolute positions, ``pos = i + kv_len - q_len`` for query row i):

* streaming: ``j < sink`` or ``pos - j < window`` (causal), for every row;
* last Q-K: the last ``last`` rows, ``pos >= kv_len - last``, attend every causal key.

So key ``j`` is admitted iff ``j <= pos`` and (``pos >= kv_len - last`` or ``j < sink`` or ``pos - j < window``).
The paper uses sink 8 (``si``), window 512 (``sl``), last 128; "Middle Q-K" is what this skips. (The
paper's 1-based inequalities ``j > si, i - j > sl`` describe the complement; we keep the A-shape
convention of ``ashape.py`` so that triangle rows before the split equal ``ashape(sink, window)``.)

How the kernels split the work (what ``build_index`` returns):

* ``split_row(params, q_len)`` = first query row of the dense section, ``max(0, q_len - last)``.
* ``build_index`` returns the STREAMING index only: the exact A-shape(sink, window) index (window and sink
  set on the BlockIndex) for every query block that has a row before the split, and zero counts for
  query blocks whose rows all lie in the dense section. Rows at or after the split inside the block that
  straddles it get the streaming result from the block-sparse kernel; a separate split-K kernel
  computes the dense rows [split_row, q_len) over all causal keys and the launcher overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import BlockIndex, num_blocks
from ._common import (
    ascii_blocks, ascii_mask, causal_entries, check_int, check_lengths, expand_heads, index_entries,
    index_from_candidates, predicate_grid,
)
from .ashape import stream_candidates

NAME = "triangle"


@dataclass(frozen=True)
class TriangleParams:
    """sink (>= 0) and window (>= 1) of the streaming section; last (>= 1): rows of the dense section."""

    sink: int = 8
    window: int = 512
    last: int = 128

    def __post_init__(self) -> None:
        check_int("sink", self.sink, 0)
        check_int("window", self.window, 1)
        check_int("last", self.last, 1)


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = TriangleParams
DYNAMIC = False  # index from the shape alone: build_index(params, q_len, kv_len, ...)
REGION = False  # no region form: intra-modality (identity frame) only
STREAMING = True  # attention sinks + a recent window only (a DuoAttention streaming head)
COLOR = "#8c564b"  # heads map (report/heads_map.py)
LABEL = "tri"  # its column header in tables that fit 80 columns (inspect)
# block_m = block_n of a TriangleMix layer's streaming index in the runtime (the artifact does not store
# one). H200, 32/8 heads, d 128, sink 64 / window 512 / last 128: 64-blocks cover the band with less
# waste than 128 and ran 1.2-1.3x faster at 32K-128K (benchmarks/RESULTS.md, session 10).
LAYER_BLOCK = 64


def demo_params(tokens: int) -> TriangleParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    return TriangleParams(sink=16, window=max(1, tokens // 4), last=min(64, tokens))


def split_row(params: TriangleParams, q_len: int) -> int:
    """First query row (0-based, within the q_len queries) of the dense last section."""
    check_int("q_len", q_len, 1)
    return max(0, q_len - params.last)


def predicate(params: TriangleParams, kv_len: int):
    """mask_mod-style predicate over absolute positions; needs kv_len to place the last section."""
    check_int("kv_len", kv_len, 1)
    sink, window, dense_from = params.sink, params.window, kv_len - params.last

    def triangle(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_pos) & ((q_pos >= dense_from) | (kv_idx < sink) | (q_pos - kv_idx < window))

    triangle.__name__ = f"triangle_{sink}_{window}_{params.last}"
    return triangle


def build_index(
    params: TriangleParams,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    block_m: int = 64,
    block_n: int = 64,
    head_space: str = "query",
    device: torch.device | str | None = None,
) -> BlockIndex:
    """Streaming-part index (see the module docstring): A-shape lists, zero counts for dense-only query blocks.

    ``meta["split_row"]`` holds ``split_row(params, q_len)``. Expanded views of [1, 1, QB, *].
    """
    kv_len = check_lengths(q_len, kv_len)
    split = split_row(params, q_len)
    ids, valid, is_full = stream_candidates(params.sink, params.window, q_len, kv_len, block_m, block_n, device)
    first_row = torch.arange(ids.shape[0], device=device, dtype=torch.int64) * block_m
    valid = valid & (first_row < split)[:, None]
    index = index_from_candidates(
        ids[None, None], valid[None, None], is_full[None, None], num_blocks(kv_len, block_n), block_m, block_n,
        head_space=head_space, window=params.window, sink=params.sink,
        meta={"pattern": NAME, "split_row": split},
    )
    return expand_heads(index, batch, heads)


def density(params: TriangleParams, q_len: int, *, kv_len: int | None = None, block_m: int = 64, block_n: int = 64) -> float:
    """Fraction of the causal matrix computed, each entry counted once: the streaming blocks' causal entries
    for rows before the split (block granularity) plus every causal entry of the dense rows."""
    kv_len = check_lengths(q_len, kv_len)
    split = split_row(params, q_len)
    index = build_index(params, q_len, kv_len, block_m=block_m, block_n=block_n)
    computed = index_entries(index, q_len, kv_len, row_stop=split) + causal_entries(q_len, kv_len, row_start=split)
    return computed / causal_entries(q_len, kv_len)


def main() -> None:
    params = TriangleParams(sink=4, window=6, last=16)
    q_len = kv_len = 64
    print(f"{predicate(params, kv_len).__name__}, q_len={q_len}, split_row={split_row(params, q_len)}")
    print(ascii_mask(predicate_grid(predicate(params, kv_len), q_len, kv_len)))
    index = build_index(params, q_len, kv_len, block_m=16, block_n=16)
    print("streaming index (block_m=16, block_n=16): F full, P partial; the last q block is left to split-K")
    print(ascii_blocks(index, kv_len))
    print(f"density: {density(params, q_len, block_m=16, block_n=16):.3f}")


if __name__ == "__main__":
    main()
