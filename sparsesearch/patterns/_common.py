"""Helpers shared by the pattern modules: parameter checks, query-block bounds, list packing, density
arithmetic, the last-queries attention estimate and ASCII drawing.

Positions follow ``index.py``: query row ``i`` sits at absolute position ``pos = i + kv_len - q_len``;
in a permuted modality region (patterns/boundary.py) it sits at ``row_pos[i]`` instead, and every helper
that takes ``row_pos`` works in that frame. Nothing here builds a token x token tensor.
"""

from __future__ import annotations

import math

import torch

from ..index import HEAD_SPACES, BlockIndex, list_width, num_blocks

# ---------------------------------------------------------------------------------------------- params


def check_int(name: str, value: object, minimum: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) and ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_lengths(q_len: int, kv_len: int | None) -> int:
    """Return kv_len (q_len when None) after checking 1 <= q_len <= kv_len."""
    kv_len = q_len if kv_len is None else kv_len
    check_int("q_len", q_len, 1)
    check_int("kv_len", kv_len, 1)
    if q_len > kv_len:
        raise ValueError(f"q_len must be <= kv_len (queries are bottom-right aligned), got {q_len} > {kv_len}")
    return kv_len


def check_frame(q_len: int, kv_len: int | None, row_pos: torch.Tensor | None) -> int:
    """kv_len after checking the frame: bottom-right causal (check_lengths) or, with row_pos, a region —
    any q_len, kv_len >= 1 and row_pos int [q_len], nondecreasing, within [-1, kv_len - 1]."""
    if row_pos is None:
        return check_lengths(q_len, kv_len)
    kv_len = q_len if kv_len is None else kv_len
    check_int("q_len", q_len, 1)
    check_int("kv_len", kv_len, 1)
    if row_pos.dim() != 1 or row_pos.numel() != q_len or row_pos.dtype.is_floating_point:
        raise ValueError(f"row_pos must be an int tensor [{q_len}], got {row_pos.dtype} {tuple(row_pos.shape)}")
    if q_len > 1 and bool((row_pos[1:] < row_pos[:-1]).any()):
        raise ValueError("row_pos must be nondecreasing (rows keep their original order within a region)")
    if int(row_pos.min()) < -1 or int(row_pos.max()) >= kv_len:
        raise ValueError(f"row_pos values must lie in [-1, {kv_len - 1}], got [{int(row_pos.min())}, {int(row_pos.max())}]")
    return kv_len


def check_head_space(head_space: str) -> None:
    if head_space not in HEAD_SPACES:
        raise ValueError(f"head_space must be one of {HEAD_SPACES}, got {head_space!r}")


def check_qk(q: torch.Tensor, k: torch.Tensor, row_pos: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (and the frame, see check_frame); return (Hq, Hkv, Nq, Nk)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, N, D], got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must share batch and head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    check_frame(q.shape[2], k.shape[2], row_pos)
    return q_heads, kv_heads, q.shape[2], k.shape[2]


# ------------------------------------------------------------------------------------------ block bounds


def query_block_bounds(
    q_len: int, kv_len: int, block_m: int, device: torch.device | str | None = None, row_pos: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-frame positions of the first and last valid row of every query block: two int64 [QB].

    row_pos: int64 [q_len], nondecreasing, the position of each query row in the key frame (row i admits
    keys j <= row_pos[i]; -1 admits none) — a permuted modality region (patterns/boundary.py). None: the
    bottom-right causal frame, row_pos[i] = i + kv_len - q_len.
    """
    start = torch.arange(num_blocks(q_len, block_m), device=device, dtype=torch.int64) * block_m
    stop = torch.clamp(start + block_m, max=q_len) - 1
    if row_pos is not None:
        row_pos = row_pos.to(device=start.device, dtype=torch.int64)
        return row_pos[start], row_pos[stop]
    offset = kv_len - q_len
    return start + offset, stop + offset


def row_positions(q_len: int, kv_len: int, device: torch.device | str | None = None, row_pos: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [q_len]: row_pos itself, or the bottom-right causal frame's i + kv_len - q_len."""
    if row_pos is not None:
        return row_pos.to(device=device, dtype=torch.int64)
    return torch.arange(q_len, device=device, dtype=torch.int64) + (kv_len - q_len)


def max_block_span(first: torch.Tensor, last: torch.Tensor, block_m: int) -> int:
    """Largest last - first + 1 over query blocks (block_m in the causal frame; more in a region)."""
    return max(block_m, int((last - first).max().item()) + 1) if first.numel() else block_m


def full_block(kb: torch.Tensor, first_pos: torch.Tensor, kv_len: int, block_n: int) -> torch.Tensor:
    """Key block ``kb`` needs no mask for its query block: wholly causal for the first row and inside kv_len."""
    top = (kb + 1) * block_n - 1
    return (top <= first_pos) & (top < kv_len)


def pack_candidates(ids: torch.Tensor, valid: torch.Tensor, size: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted, de-duplicated (count, ids) from candidate ids without a Python loop.

    ids: int [..., C] (any order, repeats allowed) with valid bool [..., C]; every valid id lies in [0, size).
    Returns count int32 [...] and ids int32 [..., W], ascending, 0-padded (as ``pack_lists``; ``width``
    likewise: a bound W >= every count, for a sync-free build).
    """
    sentinel = torch.full_like(ids, size, dtype=torch.int64)
    keyed = torch.where(valid, ids.long(), sentinel).sort(dim=-1).values
    repeat = torch.zeros_like(valid)
    repeat[..., 1:] = keyed[..., 1:] == keyed[..., :-1]
    keyed = torch.where(repeat, sentinel, keyed).sort(dim=-1).values
    count = (keyed < size).sum(-1, dtype=torch.int32)
    width = list_width(count, width)
    kept = keyed[..., :width]
    kept = torch.where(kept >= size, torch.zeros_like(kept), kept)
    return count, kept.to(torch.int32).contiguous()


def index_from_candidates(
    ids: torch.Tensor,
    valid: torch.Tensor,
    is_full: torch.Tensor,
    kv_blocks: int,
    block_m: int,
    block_n: int,
    *,
    head_space: str = "query",
    window: int = -1,
    sink: int = 0,
    col_count: torch.Tensor | None = None,
    col_idx: torch.Tensor | None = None,
    meta: dict | None = None,
    width: int | None = None,
) -> BlockIndex:
    """Split candidate key blocks [B, H, QB, C] into the full and partial lists of a BlockIndex.

    ``is_full`` must be a function of (query block, key block) only, so repeats of one id agree.
    width: a bound on the blocks per list (``pack_candidates``), for a sync-free build.
    """
    full_count, full_idx = pack_candidates(ids, valid & is_full, kv_blocks, width)
    partial_count, partial_idx = pack_candidates(ids, valid & ~is_full, kv_blocks, width)
    return BlockIndex(
        full_count, full_idx, partial_count, partial_idx, block_m, block_n, head_space,
        col_count, col_idx, window, sink, meta=dict(meta or {}),
    )


def expand_heads(index: BlockIndex, batch: int, heads: int) -> BlockIndex:
    """Broadcast an index built for one (batch, head) to [batch, heads] as views (no copy)."""
    check_int("batch", batch, 1)
    check_int("heads", heads, 1)
    names = ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
    grown = {}
    for name in names:
        tensor = getattr(index, name)
        if tensor is not None:
            grown[name] = tensor.expand(batch, heads, *tensor.shape[2:])
    return BlockIndex(
        grown["full_count"], grown["full_idx"], grown["partial_count"], grown["partial_idx"],
        index.block_m, index.block_n, index.head_space, grown.get("col_count"), grown.get("col_idx"),
        index.window, index.sink, meta=index.meta,
        col_table=None if index.col_table is None else index.col_table.map(lambda _, t: t.expand(batch, heads, *t.shape[2:])),
    )


# --------------------------------------------------------------------------------------------- density


def causal_entries(q_len: int, kv_len: int | None = None, row_start: int = 0, row_stop: int | None = None) -> int:
    """Number of causal (row, key) pairs for query rows [row_start, row_stop) (bottom-right aligned)."""
    kv_len = q_len if kv_len is None else kv_len
    row_stop = q_len if row_stop is None else min(row_stop, q_len)
    if row_stop <= row_start:
        return 0
    offset = kv_len - q_len
    # Row i admits i + offset + 1 keys: an arithmetic series.
    first, last = row_start + offset + 1, row_stop - 1 + offset + 1
    return (first + last) * (row_stop - row_start) // 2


def _series(x: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """G(x) = sum_{y=0..x} clamp(y, 0, width), elementwise (0 for x < 0)."""
    x = x.clamp(min=-1)
    inside = x * (x + 1) // 2
    beyond = width * (width + 1) // 2 + (x - width) * width
    return torch.where(x <= width, inside, beyond).clamp(min=0)


def block_entries(first_pos: torch.Tensor, last_pos: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor) -> torch.Tensor:
    """Causal (row, key) pairs in rows pos in [first_pos, last_pos] x keys [key_lo, key_hi], elementwise.

    Row ``pos`` contributes clamp(min(key_hi, pos) - key_lo + 1, 0): summed in closed form, int64.
    """
    width = (key_hi - key_lo + 1).clamp(min=0)
    rows = (last_pos - first_pos + 1).clamp(min=0)
    start = first_pos - key_lo + 1
    total = _series(start + rows - 1, width) - _series(start - 1, width)
    return torch.where(rows > 0, total, torch.zeros_like(total))


def index_entries(
    index: BlockIndex, q_len: int, kv_len: int | None = None, *, row_stop: int | None = None, row_pos: torch.Tensor | None = None
) -> int:
    """Causal (row, key) pairs the kernel computes for this index, summed over batch and heads.

    Listed blocks count all their causal, in-range entries (the kernel computes whole blocks; a partial
    block's window mask does not save work); gathered columns count the causal rows of their query block.
    Only query rows below ``row_stop`` count (all rows when None). Arithmetic on counts, no dense mask.
    With ``row_pos`` (a permuted region, see ``query_block_bounds``) rows are counted one by one.
    """
    if row_pos is not None:
        return _region_entries(index, q_len, kv_len or q_len, row_pos, q_len if row_stop is None else min(row_stop, q_len))
    kv_len = check_lengths(q_len, kv_len)
    row_stop = q_len if row_stop is None else min(row_stop, q_len)
    offset = kv_len - q_len
    starts = torch.arange(index.q_blocks, device=index.device, dtype=torch.int64) * index.block_m
    first = starts + offset
    last = torch.clamp(starts + index.block_m, max=row_stop) - 1 + offset
    first_b = first[None, None, :, None]
    last_b = last[None, None, :, None]
    total = torch.zeros((), dtype=torch.int64, device=index.device)
    for count, idx in ((index.full_count, index.full_idx), (index.partial_count, index.partial_idx)):
        valid = torch.arange(idx.shape[-1], device=idx.device) < count.unsqueeze(-1)
        lo = idx.long() * index.block_n
        hi = torch.clamp(lo + index.block_n - 1, max=kv_len - 1)
        total += torch.where(valid, block_entries(first_b, last_b, lo, hi), 0).sum()
    if index.col_count is not None:
        valid = torch.arange(index.col_idx.shape[-1], device=index.device) < index.col_count.unsqueeze(-1)
        cols = index.col_idx.long()
        rows = (last_b - torch.maximum(cols, first_b) + 1).clamp(min=0)
        total += torch.where(valid, rows, 0).sum()
    return int(total.item())


def region_causal_entries(row_pos: torch.Tensor) -> int:
    """Causal (row, key) pairs of a region: sum of (row_pos + 1), rows at -1 admitting none."""
    return int((row_pos.long() + 1).clamp(min=0).sum().item())


def _region_entries(index: BlockIndex, q_len: int, kv_len: int, row_pos: torch.Tensor, row_stop: int) -> int:
    """index_entries for a region: per row, min(row_pos, block end) - block start + 1 keys of each listed
    block and each gathered column <= row_pos. Chunked over query blocks: O(chunk x list width) memory."""
    pos = torch.full((index.q_blocks * index.block_m,), -1, dtype=torch.int64, device=index.device)
    pos[:row_stop] = row_pos.to(index.device, torch.int64)[:row_stop]
    pos = pos.view(index.q_blocks, index.block_m)  # [QB, bm], padded rows admit nothing
    total = 0
    chunk = max(1, 2**22 // max(1, index.batch * index.heads * index.block_m * (index.full_idx.shape[-1] + index.partial_idx.shape[-1] + (0 if index.col_idx is None else index.col_idx.shape[-1]))))
    for start in range(0, index.q_blocks, chunk):
        sl = slice(start, start + chunk)
        p = pos[sl][None, None, :, None, :]  # [1, 1, C, 1, bm]
        for count, idx in ((index.full_count, index.full_idx), (index.partial_count, index.partial_idx)):
            valid = (torch.arange(idx.shape[-1], device=idx.device) < count[:, :, sl].unsqueeze(-1))[..., None]
            lo = (idx[:, :, sl].long() * index.block_n)[..., None]
            hi = torch.clamp(lo + index.block_n - 1, max=kv_len - 1)
            total += int(torch.where(valid, (torch.minimum(hi, p) - lo + 1).clamp(min=0), 0).sum().item())
        if index.col_count is not None:
            valid = (torch.arange(index.col_idx.shape[-1], device=index.device) < index.col_count[:, :, sl].unsqueeze(-1))[..., None]
            total += int((valid & (index.col_idx[:, :, sl].long()[..., None] <= p)).sum().item())
    return total


def index_density(index: BlockIndex, q_len: int, kv_len: int | None = None) -> float:
    """Fraction of the causal attention matrix the kernel computes for ``index`` (mean over batch, heads)."""
    kv_len = check_lengths(q_len, kv_len)
    entries = index_entries(index, q_len, kv_len)
    return entries / (index.batch * index.heads * causal_entries(q_len, kv_len))


# ------------------------------------------------------------------------------- last-queries estimate


def last_q_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    last_q: int,
    *,
    head_space: str = "query",
    scale: float | None = None,
    diagonals: bool = True,
    row_pos: torch.Tensor | None = None,
    discount: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Column and diagonal sums of softmax(Q[-last_q:] K^T * scale) with the causal corner masked.

    q [B, Hq, Nq, D], k [B, Hkv, Nk, D]. Returns float32 ``columns`` [B, H, Nk] (summed over the last rows)
    and ``diagonals`` [B, H, Nk] where entry d sums the probabilities at offset pos - j = d, or None.
    H is Hq for head_space "query", Hkv for "kv" (the GQA group's estimates summed, each head's softmax
    taken first). Memory O(Hq x last_q x Nk); K is never repeated.
    discount: each sum less its largest single-row term (``line_sums``), the evidence of a line that one
    row's crossing line cannot fake.
    """
    check_head_space(head_space)
    q_heads, kv_heads, q_len, kv_len = check_qk(q, k, row_pos)
    batch, dim = q.shape[0], q.shape[3]
    group = q_heads // kv_heads
    rows = min(last_q, q_len)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    tail = q[:, :, q_len - rows:].float().reshape(batch, kv_heads, group * rows, dim)
    scores = (tail @ k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*rows, Nk]
    scores = scores.view(batch, kv_heads, group, rows, kv_len)
    pos = row_positions(q_len, kv_len, q.device, row_pos)[q_len - rows:]
    keys = torch.arange(kv_len, device=q.device)
    causal = keys[None, :] <= pos[:, None]  # [rows, Nk]: O(last_q x Nk)
    # nan_to_num: a region row with no visible key (row_pos -1) has an all -inf row and counts nothing.
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).nan_to_num(0.0)
    # One [rows, Nk] plane per head of the space: a KV head's group summed first (sums are linear; the
    # discount's largest row is taken of the group's sum, as the fused build does).
    probs = probs.sum(dim=2) if head_space == "kv" else probs.reshape(batch, q_heads, rows, kv_len)
    columns = line_sums(probs, discount)
    diag = None
    if diagonals and row_pos is not None:
        # Region rows are not consecutive positions: gather offset d = pos - j per row directly.
        src = pos[:, None] - keys[None, :]  # [rows, Nk]: key of offset d for each row
        gathered = probs.gather(-1, src.clamp(min=0).expand(*probs.shape[:-2], rows, kv_len))
        diag = line_sums(torch.where(src >= 0, gathered, 0.0), discount)
    elif diagonals:
        # Skew trick: left-pad each row by `rows` zeros, flatten, re-view with one more column per row;
        # row r shifts left by r, so key j of row r lands in column rows + j - r = rows + (kv_len - rows) - d.
        padded = torch.nn.functional.pad(probs, (rows, 0))  # [..., rows, rows + Nk]
        flat = torch.nn.functional.pad(padded.flatten(-2), (0, rows))
        skew = flat.view(*probs.shape[:-2], rows, rows + kv_len + 1)
        col_sums = line_sums(skew, discount)  # column c holds offset d = kv_len - c
        diag = col_sums[..., 1: kv_len + 1].flip(-1)  # d = 0 .. kv_len - 1
    return columns, diag


def line_sums(plane: torch.Tensor, discount: bool) -> torch.Tensor:
    """Sums over the rows of plane [..., rows, L] (probabilities, >= 0): [..., L]. With ``discount`` each
    sum less its largest term. Why: a vertical line crosses every diagonal in exactly one row, and a slash
    line every column in one row, so one row's mass is what a line of the other kind casts on a line that
    is not there; a real line holds mass in many rows and loses one row's share of it."""
    sums = plane.sum(dim=-2)
    return sums - plane.amax(dim=-2) if discount else sums


def top_ids(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Ids of the ``count`` largest scores along the last dim, ties to the lower id, returned ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :count]
    return order.sort(dim=-1).values


# ------------------------------------------------------------------------------------------- drawing


def ascii_mask(mask: torch.Tensor, on: str = "#", off: str = ".") -> str:
    """Draw a bool [rows, cols] mask, one text line per row."""
    return "\n".join("".join(on if bool(x) else off for x in row) for row in mask.tolist())


def ascii_blocks(index: BlockIndex, kv_len: int, batch: int = 0, head: int = 0) -> str:
    """Draw the block lists of one (batch, head): F full, P partial, . skipped."""
    from ..index import to_block_masks

    full, partial = to_block_masks(index, num_blocks(kv_len, index.block_n))
    chars = torch.full(full.shape[2:], ord("."), dtype=torch.int64)
    chars[partial[batch, head]] = ord("P")
    chars[full[batch, head]] = ord("F")
    return "\n".join("".join(chr(c) for c in row) for row in chars.tolist())


def predicate_grid(predicate, q_len: int, kv_len: int | None = None) -> torch.Tensor:
    """Token mask [q_len, kv_len] of a predicate for batch 0, head 0 (demo and test use only: n x n)."""
    kv_len = q_len if kv_len is None else kv_len
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    cols = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    return predicate(zero, zero, pos, cols).expand(q_len, kv_len) & (cols <= pos)
