"""Vertical-slash attention (MInference; MMInference paper 000 App. C.3, Table 3).

Estimate (per batch and head, from the last ``last_q`` queries, O(last_q x Nk)):

1. Â = softmax(Q[-last_q:] K^T * scale), causally masked in the last_q x last_q corner;
2. vertical score of key j = sum of Â over the rows, less its largest row; the first
   ``forced(force_vertical, vertical_size)`` columns get +inf (MInference: ``vertical[..., :30] = inf``);
   the ``vertical_size`` best columns win;
3. slash score of offset d = sum of Â along the diagonal pos - j = d, less its largest row, and 0 below
   ``slash_floor``; the ``forced(force_slash, slash_size)`` nearest offsets get +inf (MInference: the last
   100 diagonals); the ``slash_size`` best offsets win. Ties go to the lower column / offset (stable
   sort), so offsets scored 0 are taken nearest first. Budgets are cut at kv_len.

Forced lines never take more than half of their budget: ``forced(force, size) = min(force, max(1, size //
2))`` (0 when force is 0). MInference forces the nearest 100 diagonals and the first 30 columns with
budgets of 1000-6096 lines at 32K-128K tokens (``minference_forward.py``: at most 10% of the budget); a
search space scales the budgets down with the length (``scaled_params``) but not the forced counts, so at
a few thousand tokens a slash budget of 32 was all forced and only offsets 0..99 were ever kept. Capping
the forced share at half the budget keeps MInference's behaviour at its own sizes and scales the forced
count with the budget, hence with the length; the other half is always chosen by the data.

Two rules keep that half from buying blocks that hold nothing (``line_scores``; issue P11 §2: an exactly
vertical-slash head of 8 verticals and 2 slashes at 2K-4K tokens had every candidate of the bundled space
1.07-2.5x over its budget, at block density 0.35-0.85 where its lines need 0.13-0.20, with error <= 2e-3
either way; tests/test_planted_search.py):

* the discount: a vertical crosses every diagonal in exactly one of the estimate rows (and a slash every
  column), so plain sums score each of the 64 offsets a vertical crosses with one row's mass of it. Those
  shadows won the data-chosen slash slots and each cost two key blocks per query block for mass the
  vertical column already holds. Each sum less its largest row scores a shadow 0 and a real line, which
  holds mass in many rows, one row's share less.
* the floor: a slash scored below what attention spread evenly puts on a line (``slash_floor``) holds
  nothing the estimate can tell from noise; such offsets score 0, so the tie rule fills those slots with the
  nearest offsets, which share the forced band's blocks, instead of noise scattered over the whole
  matrix (two key blocks per query block each). Verticals need no floor: a column costs its rows wherever
  it lies.

For head_space "kv" the estimates of a GQA group are summed (each query head's softmax first) and one
selection is made per KV head.

Key ``j`` is admitted for the query at absolute position ``pos`` iff ``j <= pos`` and (``j`` is a vertical or
``pos - j`` is a slash offset). The index is a block cover, as in MInference's ``vertical_slash_index.cu``:
per query block (rows at positions [p0, p1]) a slash offset d touches keys [p0 - d, p1 - d] ∩ [0, p1], i.e.
key blocks (p0 - d) // block_n .. (p1 - d) // block_n (at most (block_m - 1) // block_n + 2 of them); these
blocks are listed (full when wholly causal and inside kv_len, partial otherwise; window off, so they are
computed whole). Verticals that are causal for the block's last row and fall in no listed block become
gathered columns. Working memory: the estimate O(Hq x last_q x Nk), a few bytes per block pair
[B, H, QB, KB] (far below rows x budget: QB x KB = Nq x Nk / (block_m x block_n)) and the per-block vertical
lists [B, H, QB, vertical_size]; never a token x token tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import BlockIndex, ColumnTable, list_width, num_blocks, pack_bits, pack_lists
from ._common import (
    ascii_blocks, ascii_mask, causal_entries, check_head_space, check_int, check_lengths, check_qk, full_block,
    check_frame, index_entries, last_q_sums, query_block_bounds, top_ids,
)

NAME = "vertical_slash"


@dataclass(frozen=True)
class VerticalSlashParams:
    """vertical_size, slash_size (>= 1): lines kept; last_q (>= 1): estimation rows; force_* (>= 0)."""

    vertical_size: int = 1000
    slash_size: int = 6096
    last_q: int = 64
    force_vertical: int = 30
    force_slash: int = 100

    def __post_init__(self) -> None:
        check_int("vertical_size", self.vertical_size, 1)
        check_int("slash_size", self.slash_size, 1)
        check_int("last_q", self.last_q, 1)
        check_int("force_vertical", self.force_vertical, 0)
        check_int("force_slash", self.force_slash, 0)


# Registry facts (patterns/registry.py): what every consumer reads instead of keeping its own list.
Params = VerticalSlashParams
DYNAMIC = True  # index estimated from q/k at run time: build_index(params, q, k, ...)
REGION = True  # build_index takes a permuted region frame (row_pos)
STREAMING = False  # keeps keys beyond sinks + a recent window
COLOR = "#ff7f0e"  # heads map (report/heads_map.py)
LABEL = "v-slash"  # its column header in tables that fit 80 columns (inspect)


def demo_params(tokens: int) -> VerticalSlashParams:
    """Parameters scaled to a length so the pattern is sparse but not empty (``sparsesearch check``)."""
    lines = max(1, tokens // 16)
    return VerticalSlashParams(vertical_size=lines, slash_size=lines, last_q=16, force_vertical=4, force_slash=8)


@dataclass(frozen=True)
class VSLines:
    """Selected lines: vertical key ids and slash offsets (pos - j), int64 [B, H, V] and [B, H, S], ascending."""

    vertical: torch.Tensor
    slash: torch.Tensor
    q_len: int
    kv_len: int
    head_space: str
    row_pos: torch.Tensor | None = None  # a permuted region's frame (None: bottom-right causal)


def forced(force: int, size: int) -> int:
    """Lines forced into a budget of ``size``: ``force``, at most half the budget (>= 1 unless force is 0)."""
    return min(force, max(1, size // 2))


def slash_floor(last_q: int, q: torch.Tensor, k: torch.Tensor, head_space: str, row_pos: torch.Tensor | None = None) -> float:
    """The slash score below which an offset counts as no line: the mass that attention spread evenly over
    each estimate row's visible keys (1 / (pos + 1) per key) puts on a line every row sees, summed over the
    min(last_q, Nq) last rows of q [B, Hq, Nq, D] (and over a GQA group's Hq / Hkv heads in kv head space).
    k [B, Hkv, Nk, D]; row_pos: a region's frame, whose rows may see far fewer than Nk keys."""
    rows = min(last_q, q.shape[2])
    pos = torch.arange(k.shape[2] - rows, k.shape[2]) if row_pos is None else row_pos[q.shape[2] - rows:].cpu().long()
    group = q.shape[1] // k.shape[1] if head_space == "kv" else 1
    return group * float((1.0 / (pos[pos >= 0] + 1).double()).sum())


def line_scores(params: VerticalSlashParams, q: torch.Tensor, k: torch.Tensor, *, head_space: str = "query",
                scale: float | None = None, row_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns, diagonals) float32 [B, H, Nk]: the scores the top-k ranks, before the forced lines (module
    docstring): last-row sums less their largest row, slashes 0 below ``slash_floor``."""
    columns, diagonals = last_q_sums(q, k, params.last_q, head_space=head_space, scale=scale, row_pos=row_pos, discount=True)
    floor = slash_floor(params.last_q, q, k, head_space, row_pos)
    return columns, torch.where(diagonals < floor, 0.0, diagonals)


def estimate(
    params: VerticalSlashParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    scale: float | None = None,
    row_pos: torch.Tensor | None = None,
) -> VSLines:
    """Vertical and slash lines from q [B, Hq, Nq, D] and k [B, Hkv, Nk, D] (see the module docstring).
    row_pos: a permuted region's frame; slash offsets are then counted back from each row's frontier."""
    columns, diagonals = line_scores(params, q, k, head_space=head_space, scale=scale, row_pos=row_pos)
    q_len, kv_len = q.shape[2], k.shape[2]
    columns[..., : forced(params.force_vertical, params.vertical_size)] = float("inf")
    diagonals[..., : forced(params.force_slash, params.slash_size)] = float("inf")
    vertical = top_ids(columns, min(params.vertical_size, kv_len))
    slash = top_ids(diagonals, min(params.slash_size, kv_len))
    return VSLines(vertical, slash, q_len, kv_len, head_space, row_pos)


def list_widths(n_slash: int, kv_blocks: int, block_m: int, block_n: int) -> tuple[int, int]:
    """Static widths of the (full, partial) block lists, exact upper bounds of every query block's counts.

    A slash offset meets the keys [p0 - d, p1 - d] of a query block at positions [p0, p1] (at most block_m
    keys), so at most ``reach`` = ceil(block_m / block_n) + 1 key blocks; and a block is partial only where
    it reaches past p0, i.e. overlaps [p0, p1]: again at most ``reach``. At 1M keys with 1024 slashes the
    full list is 3072 wide instead of 16K key blocks, which is what lets a static-width build run there.
    """
    reach = -(-block_m // block_n) + 1
    return min(kv_blocks, n_slash * reach), min(kv_blocks, reach)  # n_slash >= 1, so reach bounds the partials


def index_from_lines(lines: VSLines, *, block_m: int = 64, block_n: int = 64, static_widths: bool = False) -> BlockIndex:
    """Block cover of the slash lines plus gathered vertical columns (see the module docstring).

    A key block kb (keys [k0, k1]) meets a slash offset d in query block m (rows at positions [p0, p1]) iff
    d lies in [max(p0 - k1, 0), p1 - k0]; a prefix count of the selected offsets answers that for every
    (m, kb) at once. Working memory: a few bytes per (B, H, QB, KB) block pair plus the per-block
    vertical lists, never the token grid. ``meta["lines"]`` keeps the VSLines. static_widths: lists as wide
    as their bounds (``list_widths``; the verticals) instead of the largest counts (no device sync: the build can be
    captured in a CUDA graph, graphed.GraphedIndexCache).
    """
    q_len, kv_len = lines.q_len, check_frame(lines.q_len, lines.kv_len, lines.row_pos)
    device = lines.slash.device
    batch, heads = lines.slash.shape[:2]
    kv_blocks = num_blocks(kv_len, block_n)
    p0, p1 = query_block_bounds(q_len, kv_len, block_m, device, lines.row_pos)
    p0, p1 = p0[:, None], p1[:, None]  # [QB, 1]
    k0 = torch.arange(kv_blocks, device=device, dtype=torch.int64)[None, :] * block_n
    k1 = torch.clamp(k0 + block_n - 1, max=kv_len - 1)
    lo = torch.clamp(p0 - k1, min=0)  # [QB, KB]: the offsets that reach block kb from query block m
    hi = torch.clamp(p1 - k0, min=-1, max=kv_len - 1)
    # below[..., x] = number of selected offsets < x, for x in [0, kv_len].
    chosen = torch.zeros(batch, heads, kv_len, dtype=torch.int32, device=device).scatter_(-1, lines.slash, 1)
    below = torch.nn.functional.pad(chosen.cumsum(-1, dtype=torch.int32), (1, 0))
    reach = k0 <= p1
    touched = (below[..., hi + 1] > below[..., torch.clamp(lo, max=kv_len)]) & reach  # [B, H, QB, KB]
    is_full = full_block(k0 // block_n, p0, kv_len, block_n)
    full_w, part_w = list_widths(lines.slash.shape[-1], kv_blocks, block_m, block_n) if static_widths else (None, None)
    full_count, full_idx = pack_lists(touched & is_full, full_w)
    partial_count, partial_idx = pack_lists(touched & ~is_full, part_w)
    # Verticals: causal for the block's last row and not inside a touched block -> gathered columns.
    q_blocks = p0.shape[0]
    ordered = lines.vertical.sort(-1).values  # [B, H, V]: the column table's slots
    vertical = ordered[:, :, None, :].expand(batch, heads, q_blocks, -1)
    covered = touched.gather(-1, vertical // block_n)
    keep = (vertical <= p1) & ~covered
    keyed = torch.where(keep, vertical.to(torch.int32), kv_len).sort(-1).values
    col_count = keep.sum(-1, dtype=torch.int32)
    col_idx = keyed[..., : list_width(col_count, vertical.shape[-1] if static_widths else None)]
    col_idx = torch.where(col_idx >= kv_len, 0, col_idx).contiguous()
    table = None if lines.row_pos is not None else column_table(ordered, keep, p0[:, 0])
    return BlockIndex(
        full_count, full_idx, partial_count, partial_idx, block_m, block_n, lines.head_space,
        col_count, col_idx, meta={"pattern": NAME, "lines": lines}, col_table=table,
    )


def column_table(vertical: torch.Tensor, keep: torch.Tensor, first_pos: torch.Tensor) -> ColumnTable:
    """The verticals as one table per head (index.ColumnTable): vertical int [B, H, V] ascending, keep bool
    [B, H, QB, V] (slot used by the query block), first_pos int64 [QB] (each block's first row position)."""
    slots = torch.arange(keep.shape[-1], device=keep.device)
    causal = keep & (vertical[:, :, None, :] <= first_pos[:, None])
    clean = causal.to(torch.int32).cumprod(-1).sum(-1, dtype=torch.int32)  # the leading run of used, causal slots
    span = torch.where(keep, slots + 1, 0).amax(-1).to(torch.int32)
    return ColumnTable(vertical.to(torch.int32).contiguous(), pack_bits(keep), clean, span)


def build_index(
    params: VerticalSlashParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    scale: float | None = None,
    row_pos: torch.Tensor | None = None,
    static_widths: bool = False,
) -> BlockIndex:
    """estimate + index_from_lines (static_widths: no device sync, see there). The torch build, the
    reference: the fused Triton build of the same index, and the choice between the two, are
    kernels/dynamic_index.py's."""
    check_head_space(head_space)
    check_qk(q, k, row_pos)
    lines = estimate(params, q, k, head_space=head_space, scale=scale, row_pos=row_pos)
    return index_from_lines(lines, block_m=block_m, block_n=block_n, static_widths=static_widths)


def predicate(params: VerticalSlashParams, lines: VSLines, group: int = 1):
    """mask_mod-style predicate over absolute positions for given lines (lookup tables of size [B, H, Nk]).

    group: query heads per lines head (the GQA group when the lines are per KV head), else 1.
    """
    shape = (*lines.vertical.shape[:2], lines.kv_len)
    is_vertical = torch.zeros(shape, dtype=torch.bool, device=lines.vertical.device).scatter_(-1, lines.vertical, True)
    is_slash = torch.zeros(shape, dtype=torch.bool, device=lines.slash.device).scatter_(-1, lines.slash, True)
    last = lines.kv_len - 1

    def vertical_slash(b: torch.Tensor, h: torch.Tensor, q_pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        hh = h // group
        offset = q_pos - kv_idx
        on_slash = is_slash[b, hh, offset.clamp(0, last)]
        on_vertical = is_vertical[b, hh, kv_idx.clamp(0, last)]
        return (offset >= 0) & (on_vertical | on_slash)

    vertical_slash.__name__ = f"vertical_slash_{params.vertical_size}_{params.slash_size}"
    return vertical_slash


def slash_predicate(lines: VSLines, group: int = 1):
    """The slash lines alone (their block cover is exactly what the index lists)."""
    empty = VSLines(lines.vertical[..., :0], lines.slash, lines.q_len, lines.kv_len, lines.head_space)
    fn = predicate(VerticalSlashParams(), empty, group)
    fn.__name__ = "vertical_slash_slashes"
    return fn


def density(
    params: VerticalSlashParams,
    q_len: int,
    *,
    kv_len: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    index: BlockIndex | None = None,
) -> float:
    """Fraction of the causal matrix the kernel computes.

    With ``index`` (from ``build_index``): exact, mean over batch and heads. Without: an upper bound that
    assumes no two slash offsets share a key block and no vertical is covered, per query block
    min(its causal entries, slashes x blocks-per-offset x rows x block_n + verticals x rows).
    """
    kv_len = check_lengths(q_len, kv_len)
    if index is not None:
        return index_entries(index, q_len, kv_len) / (index.batch * index.heads * causal_entries(q_len, kv_len))
    first, last = query_block_bounds(q_len, kv_len, block_m)
    rows = last - first + 1
    causal = (first + 1 + last + 1) * rows // 2
    slashes = min(params.slash_size, kv_len)
    verticals = min(params.vertical_size, kv_len)
    per_offset = (block_m - 1) // block_n + 2
    bound = torch.clamp(slashes * per_offset * rows * block_n + verticals * rows, max=causal)
    return min(1.0, int(bound.sum()) / causal_entries(q_len, kv_len))


def main() -> None:
    torch.manual_seed(0)
    params = VerticalSlashParams(vertical_size=3, slash_size=3, last_q=8, force_vertical=1, force_slash=1)
    q_len = kv_len = 48
    dim = 32
    q, k = torch.randn(1, 1, q_len, dim) * 0.1, torch.randn(1, 1, kv_len, dim) * 0.1
    k[:, :, 20, 0] = 6.0  # a vertical line at key 20
    q[:, :, :, 0] = 3.0
    lines = estimate(params, q, k)
    print(f"verticals {lines.vertical.tolist()}, slash offsets {lines.slash.tolist()}")
    zero = torch.zeros((), dtype=torch.int64)
    pos, cols = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    print(ascii_mask(predicate(params, lines)(zero, zero, pos, cols)))
    index = index_from_lines(lines, block_m=16, block_n=16)
    print("slash block cover (block_m=16, block_n=16): F full, P partial; gathered columns per q block:")
    print(ascii_blocks(index, kv_len))
    print(index.col_idx[0, 0].tolist(), index.col_count[0, 0].tolist())
    print(f"density: {density(params, q_len, block_m=16, block_n=16, index=index):.3f}")


if __name__ == "__main__":
    main()
