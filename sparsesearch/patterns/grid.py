"""Grid attention (MMInference, paper 000 §2.2, §3.1, Alg. 1, App. C.4, Table 3).

Video/image tokens give heads whose attention is a grid of evenly spaced lines plus a local band. With
``stride`` (the grid period, e.g. tokens per frame) and ``phase`` (where the lines sit), key ``j`` is
admitted for the query at absolute position ``pos`` iff ``j <= pos`` and any of

* local band:       ``pos - j < local``;
* vertical lines:   ``use_vline`` and ``j % stride == phase``;
* horizontal lines: ``use_hline`` and ``pos % stride == phase`` (those rows attend every causal key);
* slash lines:      ``use_slash`` and ``(pos - j) % stride == 0``.

Table 3 searches (stride, use_hline, use_vline, use_slash) with local 1024, stride = the frame stride or a
searched stride; Alg. 1 picks stride and phase online from the last queries (``estimate_stride_phase``).

``build_index`` returns the plain (un-permuted) block cover: every key block holding an admitted token,
full when it is wholly causal and inside kv_len, partial otherwise (window off, so a listed block is
computed whole). ``build_lines_index`` is Alg. 1's permutation read in place (Alg. 5) by index arithmetic:
keys stay in place (so the band's blocks stay contiguous tiles), the vertical-line keys are read as
strided columns and the horizontal-line rows are computed apart, split over keys; the kernels apply it
in their loads and stores, with no map and no permuted copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from ..index import BlockIndex, GridLines, num_blocks
from ._common import (
    ascii_blocks, ascii_mask, causal_entries, check_bool, check_int, check_lengths, expand_heads, full_block,
    index_entries, index_from_candidates, last_q_sums, predicate_grid, query_block_bounds,
)

NAME = "grid"


@dataclass(frozen=True)
class GridParams:
    """stride >= 1, 0 <= phase < stride, which line families are on, local band width >= 1."""

    stride: int
    phase: int = 0
    use_hline: bool = True
    use_vline: bool = True
    use_slash: bool = False
    local: int = 1024

    def __post_init__(self) -> None:
        check_int("stride", self.stride, 1)
        check_int("phase", self.phase, 0)
        if self.phase >= self.stride:
            raise ValueError(f"phase must be < stride ({self.stride}), got {self.phase}")
        for name in ("use_hline", "use_vline", "use_slash"):
            check_bool(name, getattr(self, name))
        check_int("local", self.local, 1)


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = GridParams
# Static: an estimated stride/phase (Alg. 1) is found at search time (search/layer.py) and stored in the
# params, so the runtime builds the index from the shape alone and pays no estimate.
DYNAMIC = False
REGION = False  # no region form: intra-modality (identity frame) only
STREAMING = False  # keeps keys beyond sinks + a recent window
COLOR = "#9467bd"  # heads map (report/heads_map.py)
LABEL = "grid"  # its column header in tables that fit 80 columns (inspect)


def demo_params(tokens: int) -> GridParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    return GridParams(stride=max(2, tokens // 32), phase=0, use_hline=True, use_vline=True, use_slash=True, local=max(1, tokens // 4))


def predicate(params: GridParams):
    """mask_mod-style predicate over absolute positions."""
    p = params

    def grid(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        admitted = q_pos - kv_idx < p.local
        if p.use_vline:
            admitted = admitted | (kv_idx % p.stride == p.phase)
        if p.use_hline:
            admitted = admitted | (q_pos % p.stride == p.phase)
        if p.use_slash:
            admitted = admitted | ((q_pos - kv_idx) % p.stride == 0)
        return (kv_idx <= q_pos) & admitted

    lines = "".join(flag for flag, on in (("h", p.use_hline), ("v", p.use_vline), ("s", p.use_slash)) if on) or "none"
    grid.__name__ = f"grid_{p.stride}_{p.phase}_{lines}_{p.local}"
    return grid


def block_cover(
    params: GridParams, q_len: int, kv_len: int, block_m: int, block_n: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(any, is_full) bool [QB, KB]: blocks holding an admitted token, and blocks needing no mask.

    Exact per-block arithmetic (query block rows at positions [p0, p1], keys [k0, k1] cut at kv_len):
    the local band meets the block iff the offset range [max(0, p0 - k1), p1 - k0] meets [0, local); a
    vertical line iff the first key >= k0 on phase is <= min(k1, p1); a horizontal line iff the last
    row <= p1 on phase is >= max(p0, k0); a slash line iff a multiple of stride lies in the offset range.
    """
    p = params
    kv_blocks = num_blocks(kv_len, block_n)
    p0, p1 = query_block_bounds(q_len, kv_len, block_m, device)
    p0, p1 = p0[:, None], p1[:, None]
    k0 = torch.arange(kv_blocks, device=device, dtype=torch.int64)[None, :] * block_n
    k1 = torch.clamp(k0 + block_n - 1, max=kv_len - 1)
    causal = k0 <= p1
    d_lo = torch.clamp(p0 - k1, min=0)
    d_hi = p1 - k0
    hit = d_lo <= torch.clamp(d_hi, max=p.local - 1)
    if p.use_vline:
        first_line = k0 + (p.phase - k0) % p.stride
        hit = hit | (first_line <= torch.minimum(k1, p1))
    if p.use_hline:
        last_row = p1 - (p1 - p.phase) % p.stride
        hit = hit | (last_row >= torch.maximum(p0, k0))
    if p.use_slash:
        first_mult = (d_lo + p.stride - 1) // p.stride * p.stride
        hit = hit | (first_mult <= d_hi)
    hit = hit & causal
    return hit, full_block(k0 // block_n, p0, kv_len, block_n)


def build_index(
    params: GridParams,
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
    """Block cover of the grid pattern (un-permuted), the same for every (batch, head): views of [1, 1, QB, *].

    Block-level [QB, KB] arithmetic: a query block with a horizontal line loads every causal block anyway.
    """
    kv_len = check_lengths(q_len, kv_len)
    hit, is_full = block_cover(params, q_len, kv_len, block_m, block_n, device)
    return _cover_index(hit, is_full, block_m, block_n, head_space, batch, heads, {"pattern": NAME})


def _cover_index(hit: torch.Tensor, is_full: torch.Tensor, block_m: int, block_n: int, head_space: str, batch: int, heads: int,
                 meta: dict) -> BlockIndex:
    """A BlockIndex of a [QB, KB] block cover (hit, is_full bool), the same for every (batch, head): views."""
    kv_blocks = hit.shape[1]
    ids = torch.arange(kv_blocks, device=hit.device, dtype=torch.int64)[None, :].expand_as(hit)
    index = index_from_candidates(
        ids[None, None], hit[None, None], is_full.expand_as(hit)[None, None], kv_blocks, block_m, block_n,
        head_space=head_space, meta=meta,
    )
    return expand_heads(index, batch, heads)


def lines_cover(
    params: GridParams, q_len: int, kv_len: int, block_m: int, block_n: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GridLines]:
    """Block cover of the grid read in place by arithmetic (Alg. 1's permutation without a permuted copy):
    (hit, is_full) bool [QB, KB], line_cols int64 [QB], and the GridLines (line_cols unset).

    Every row lists its local band (a suffix of its causal key blocks, exact block arithmetic as in
    ``block_cover``) and its slash blocks. Keys stay in place, so band blocks are contiguous tiles; the
    vertical-line keys below the band come as strided columns (line_cols per block), and any listed block
    below the band is partial so the kernel can mask the line keys it holds (the columns have them). The
    horizontal-line rows (row_phase + stride * s) attend every causal key and are not in the cover: the
    kernels compute them apart. Causality is by original position everywhere.
    """
    p = params
    if p.stride > kv_len:
        raise ValueError(f"grid stride {p.stride} is longer than the sequence ({kv_len} keys): no line repeats")
    offset = kv_len - q_len
    row_phase = (p.phase - offset) % p.stride
    row_lines = max(0, -(-(q_len - row_phase) // p.stride)) if p.use_hline else 0
    k0 = torch.arange(num_blocks(kv_len, block_n), device=device, dtype=torch.int64)[None, :] * block_n
    k1 = torch.clamp(k0 + block_n - 1, max=kv_len - 1)
    p0, p1 = query_block_bounds(q_len, kv_len, block_m, device)
    p0, p1 = p0[:, None], p1[:, None]
    causal = k0 <= p1
    d_lo = torch.clamp(p0 - k1, min=0)
    band = (d_lo <= p.local - 1) & causal
    hit, full = band, (k1 <= p0) & (k0 + block_n <= kv_len)
    if p.use_slash:
        first_mult = (d_lo + p.stride - 1) // p.stride * p.stride
        hit = hit | ((first_mult <= p1 - k0) & causal)
    line_cols = torch.zeros(hit.shape[0], dtype=torch.int64, device=device)
    if p.use_vline:
        # The band is a suffix of the causal blocks (d_lo grows leftwards) holding the row's own block.
        col_hi = band.long().argmax(-1) * block_n
        line_cols = torch.clamp((col_hi - p.phase + p.stride - 1) // p.stride, min=0)
        full = full & (k0 >= col_hi[:, None])
    return hit, full & hit, line_cols, GridLines(p.stride, row_phase, row_lines, p.phase, None, q_len, kv_len)


def build_lines_index(
    params: GridParams,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    block_m: int = 64,
    block_n: int = 64,
    head_space: str = "query",
    device: torch.device | str | None = None,
) -> tuple[BlockIndex, GridLines]:
    """The grid read in place (``lines_cover``) as a BlockIndex (views of [1, 1, QB, *]) and the GridLines
    the kernels apply by arithmetic: ``block_sparse_attention(..., lines=)``. No map and no
    memory proportional to the sequence beyond the index and one int32 per query block."""
    kv_len = check_lengths(q_len, kv_len)
    hit, is_full, line_cols, lines = lines_cover(params, q_len, kv_len, block_m, block_n, device)
    index = _cover_index(hit, is_full, block_m, block_n, head_space, batch, heads, {"pattern": NAME, "lines": True})
    cols = line_cols.to(torch.int32) if params.use_vline else None
    return index, dataclasses.replace(lines, line_cols=cols)


def lines_mask(params: GridParams, q_len: int, kv_len: int | None = None, *, block_m: int = 64, block_n: int = 64,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """bool [len(rows), kv_len] in original positions: the tokens the grid read in place computes for q rows
    ``rows`` (default all; line rows: every causal key; other rows: their listed blocks and the line keys
    below the band). For tests and drawings: it is token x token."""
    kv_len = check_lengths(q_len, kv_len)
    device = None if rows is None else rows.device
    hit, _, line_cols, lines = lines_cover(params, q_len, kv_len, block_m, block_n, device)
    rows = torch.arange(q_len, device=device) if rows is None else rows.long()
    keys = torch.arange(kv_len, device=device)
    block = rows // block_m
    mask = hit[block][:, keys // block_n]
    if params.use_vline:
        col_hi = params.phase + params.stride * line_cols[block]
        mask = mask | (((keys[None, :] - params.phase) % params.stride == 0) & (keys[None, :] < col_hi[:, None]))
    mask = mask | lines.is_line_row(rows)[:, None]
    return mask & (keys[None, :] <= rows[:, None] + (kv_len - q_len))


def density(params: GridParams, q_len: int, *, kv_len: int | None = None, block_m: int = 64, block_n: int = 64) -> float:
    """Fraction of the causal matrix the un-permuted block cover computes (block granularity)."""
    kv_len = check_lengths(q_len, kv_len)
    index = build_index(params, q_len, kv_len, block_m=block_m, block_n=block_n)
    return index_entries(index, q_len, kv_len) / causal_entries(q_len, kv_len)


def estimate_stride_phase(
    q: torch.Tensor,
    k: torch.Tensor,
    strides: Sequence[int],
    *,
    last_q: int = 64,
    head_space: str = "query",
    scale: float | None = None,
    keep: float = 0.75,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online stride and phase search of Alg. 1 from the last queries' attention.

    q [B, Hq, Nq, D], k [B, Hkv, Nk, D]. Â = softmax(Q[-last_q:] K^T * scale) with the causal corner masked
    (summed over the GQA group for head_space "kv"); its column mass is viewed as [Nk / s, s] for every
    candidate stride s (Alg. 1's view). Two numbers per (s, phase), over the columns j with j % s == phase:

    * excess = their share of the mass - their share of the columns (0 for flat attention): how much of
      the lines' mass the class holds. At the true stride the phase class holds every line; at a multiple
      m·s it holds about 1/m of them (excess drops to ~1/m), at a divisor s/m all of them again;
    * lift = mean mass of their columns / mean column mass: at a divisor s/m the lines are diluted by
      (m - 1)/m empty columns (lift drops to ~1/m), at the true stride it is largest.

    Each stride takes its phase of largest excess. The strides whose excess is within a factor ``keep`` of
    the best stride's keep the lines (the true stride and its divisors, never a multiple, whose excess is
    about half or less); among them the largest lift wins (the true stride: its divisors dilute), ties to
    the smaller stride. So on a planted grid the result is the true stride (when it is a candidate) and
    its exact phase. Alg. 1 itself keeps the largest maximum of the view, which prefers multiples whenever
    the lines are uneven (a multiple keeps the heavier half); a local band near the last rows is such an
    unevenness, which is why that rule returned 512 or 1024 with the phase right only modulo the stride.

    Only vertical lines are visible from the last rows; horizontal lines cannot be estimated this way.
    Returns stride, phase (int64 [B, H]) and the chosen (stride, phase)'s lift (float32 [B, H]).
    """
    if not strides:
        raise ValueError("strides must list at least one candidate stride, got none")
    for s in strides:
        check_int("stride", s, 1)
    check_int("last_q", last_q, 1)
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    columns, _ = last_q_sums(q, k, last_q, head_space=head_space, scale=scale, diagonals=False)
    kv_len = columns.shape[-1]
    total = columns.sum(-1, keepdim=True).clamp_min(1e-30)
    order = sorted(set(strides))
    excesses, lifts, phases = [], [], []
    for stride in order:  # a handful of candidates: the loop is over the search space, not heads or blocks
        folds = num_blocks(kv_len, stride)
        padded = torch.nn.functional.pad(columns, (0, folds * stride - kv_len))
        share = padded.view(*columns.shape[:2], folds, stride).sum(-2) / total  # [B, H, s]
        count = (kv_len - torch.arange(stride, device=q.device) + stride - 1) // stride  # columns per phase
        excess = (share - count / kv_len).masked_fill(count == 0, float("-inf"))
        best_excess, phase = excess.max(dim=-1)
        lift = share.gather(-1, phase[..., None]).squeeze(-1) * kv_len / count[phase].clamp(min=1)
        excesses.append(best_excess)
        lifts.append(lift)
        phases.append(phase)
    excess, lift, phase = torch.stack(excesses), torch.stack(lifts), torch.stack(phases)  # [S, B, H], ascending stride
    eligible = excess >= keep * excess.max(dim=0).values
    first = lift.masked_fill(~eligible, float("-inf")).argmax(dim=0)  # argmax keeps the first (smallest) of ties
    stride_values = torch.tensor(order, dtype=torch.int64, device=q.device)
    best_stride = stride_values[first]
    best_phase = phase.gather(0, first[None]).squeeze(0)
    best_lift = lift.gather(0, first[None]).squeeze(0)
    return best_stride, best_phase.long(), best_lift.float()


def main() -> None:
    params = GridParams(stride=40, phase=7, use_hline=True, use_vline=True, use_slash=False, local=3)
    q_len = kv_len = 64
    print(f"{predicate(params).__name__}, q_len={q_len}")
    print(ascii_mask(predicate_grid(predicate(params), q_len, kv_len)))
    index = build_index(params, q_len, kv_len, block_m=16, block_n=16)
    print("block cover (block_m=16, block_n=16): F full, P partial")
    print(ascii_blocks(index, kv_len))
    print(f"density of the cover: {density(params, q_len, block_m=16, block_n=16):.3f}")


if __name__ == "__main__":
    main()
