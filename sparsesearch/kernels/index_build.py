"""Fused dynamic-index builds (Triton): estimate, top-k and packing straight into the BlockIndex layout.

The torch builds (patterns/block_topk.py, patterns/vertical_slash.py) are the reference: about eighty
small launches, sorts over [B, H, QB, KB] and fp32 score matrices in HBM. At 8K tokens that is 0.7-1.1 ms
on an H200 even replayed from a CUDA graph, against ~0.93 ms for all of SDPA (issue 14 §2). Here the same
indices come from two (block top-k) or four (vertical-slash) launches, with no host sync and no
data-dependent shape, so a build can be captured in a CUDA graph (graphed.py) and is cheap when it is not.
Vertical-slash: see the section comment above ``_vs_row_stats``.

Block top-k:

1. ``_pool_rows``: mean of every key block's valid rows, fp32 [B, Hkv, BLOCK_D, KB] (padded dims 0).
2. ``_block_topk_select``: one program per (batch, index head, query block). It pools its query block
   itself (each query row is read by one program only), scores the key blocks (query head space: its own
   pooled query; kv head space: each of the GQA group's pooled queries, softmax over the open blocks with
   scale 1/sqrt(D), probabilities summed), keeps the forced blocks (sinks and the diagonal ones) and the
   ``k_blocks`` best open blocks, ties to the lower block id, and writes the full/partial lists ascending,
   0-padded to the static width KB (= ``static_widths=True``), plus the bool block selection
   [B, H, QB, KB] that ``meta["selection"]`` carries.

Every top-k here (key blocks, vertical columns, slash offsets) is exact, not a sort: scores map to
order-preserving int32 keys; up to FEW_TAKES picks are that many max rounds over keys packed with their
lane (ties to the lower id), more are 32 rounds of bisection for the k-th largest key, the tied ones taken
in id order (a prefix count). Either reproduces the reference's stable sort exactly.

Identity frame only (queries bottom-right aligned, q_len <= kv_len); kernels/dynamic_index.py, the one
caller, keeps the torch path for a permuted region (row_pos) and for inputs ``fusable`` / ``vs_fusable`` refuse. The kernels never read a
token x token tensor; the vertical-slash estimate never writes its [last_q, Nk] probabilities to HBM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..index import BlockIndex, ColumnTable, num_blocks
from ._common import SUPPORTED_DTYPES, block_d, dot_f32

# Longest key axis, in key blocks, a block top-k select program holds in registers (128K keys at block_n
# 64); past it the torch build runs. The vertical-slash build walks key blocks a tile at a time: no limit.
MAX_KEY_BLOCKS = 2048


@triton.jit
def _pool_rows(
    X, OUT, length, heads, stride_xb, stride_xh, stride_xn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
):
    """OUT[b, h, :, blk] = mean of x[b, h, blk*BLOCK : min(length, (blk+1)*BLOCK), :] in fp32."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + rows.to(tl.int64)[:, None] * stride_xn + offs_d[None, :]
    tile = tl.load(ptrs, mask=(rows < length)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    count = tl.minimum(length - blk * BLOCK, BLOCK).to(tl.float32)
    # Transposed, [BLOCK_D, blocks] per head: the select kernel reads a few dims of every block at a time.
    out = OUT + (bh.to(tl.int64) * BLOCK_D + offs_d) * tl.num_programs(0) + blk
    tl.store(out, tl.sum(tile, 0) / count)


@triton.jit
def _pooled_scores(
    q_base, stride_qh, stride_qn, n_heads, start, q_len, pk_base, kb, kb_ok, kv_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HEADS_P2: tl.constexpr, KB_P2: tl.constexpr,
):
    """[HEADS_P2, KB_P2] fp32: for each of ``n_heads`` query heads from q_base, the mean of its q rows
    [start, min(q_len, start + BLOCK_M)) . every pooled key block (rows past n_heads: 0).

    Walks the head dim CHUNK_D at a time so the [HEADS_P2, KB_P2, CHUNK_D] product stays in registers;
    each pooled-key chunk is loaded once for all the heads. A runtime loop, not an unrolled one: at 128K
    keys (2048 lanes, CHUNK_D 1) unrolling 128 chunks took the compiler 155 s on an H200 host.
    """
    heads = tl.arange(0, HEADS_P2)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = (heads < n_heads)[:, None] & (rows < q_len)[None, :]
    count = tl.minimum(q_len - start, BLOCK_M).to(tl.float32)
    row_off = heads.to(tl.int64)[:, None] * stride_qh + rows.to(tl.int64)[None, :] * stride_qn  # [HEADS_P2, BLOCK_M]
    scores = tl.zeros([HEADS_P2, KB_P2], dtype=tl.float32)
    for d0 in tl.range(0, BLOCK_D, CHUNK_D):
        offs_d = d0 + tl.arange(0, CHUNK_D)
        qt = tl.load(q_base + row_off[:, :, None] + offs_d[None, None, :],
                     mask=row_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :], other=0.0).to(tl.float32)
        pooled_q = tl.sum(qt, 1) / count  # [HEADS_P2, CHUNK_D], as the reference: sum, then divide
        kt = tl.load(pk_base + offs_d.to(tl.int64)[None, :] * kv_blocks + kb[:, None], mask=kb_ok[:, None], other=0.0)
        scores += tl.sum(pooled_q[:, None, :] * kt[None, :, :], 2)
    return scores


# Up to this many picks, a top-k is ``take`` rounds of one max each; past it, bisection (at most 32 rounds).
FEW_TAKES = tl.constexpr(32)


@triton.jit
def _top_take(scores, eligible, take, lanes):
    """bool like ``scores``: the ``take`` best eligible entries, ties to the lower position (the reference's
    stable descending sort). Needs take <= eligible count; lanes = tl.arange over the scores.

    Floats map to int32 keys in the same order (negative values get their magnitude bits flipped; -0 is
    made +0 first, since the sort ties them). Few picks (the block top-k budgets of short contexts: 6 at
    8K): each round takes the max of key * 2^32 + (reversed lane), one reduction that breaks ties to the
    lower lane. Many picks: bisection over the eligible keys' range finds the largest threshold with at
    least ``take`` keys at or above it (the take-th largest key), and a prefix count takes the tied ones
    in lane order; it stops early where a threshold has exactly ``take`` keys at or above it. Each round
    costs one cross-warp reduction either way, so few picks cost take rounds instead of up to 34 (H200,
    8K, 32/8 heads: the select kernel's top-k was most of its time).
    """
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    if take <= FEW_TAKES:
        # Distinct packed values (the low word is the reversed lane), so each round marks exactly one entry.
        none = tl.full([], -9223372036854775808, tl.int64)
        packed = tl.where(eligible, key * 4294967296 + (lanes.shape[0] - 1 - lanes), none)
        chosen = lanes < 0
        for _ in range(0, take):
            hit = packed == tl.max(packed, 0)
            chosen = chosen | hit
            packed = tl.where(hit, none, packed)
    else:
        # Invariant: at least ``take`` keys at or above lo; hi bounds the answer. From the eligible keys' own
        # range, and done as soon as exactly ``take`` keys lie at or above mid (no tie to split then): a
        # runtime loop (unrolled over 32K lanes, 32 rounds cost seconds of compile per length) that stops once
        # mid falls between the take-th and the next key, well before the 32 rounds a full bisection needs.
        lo = tl.min(tl.where(eligible, key, 2147483647), 0)
        hi = tl.max(tl.where(eligible, key, -2147483648), 0)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            count = tl.sum((eligible & (key >= mid)).to(tl.int32), 0)
            lo = tl.where(count >= take, mid, lo)
            hi = tl.where(count > take, hi, tl.where(count == take, mid, mid - 1))
        above = eligible & (key > lo)
        tied = eligible & (key == lo)
        rank = tl.cumsum(tied.to(tl.int32), 0)  # 1-based among the tied, in id order
        quota = take - tl.sum(above.to(tl.int32), 0)
        chosen = above | (tied & (rank <= quota))
    return chosen


@triton.jit
def _store_list(cnt_ptr, idx_ptr, chosen, values, lanes, lanes_ok):
    """Write ``values`` where ``chosen`` in lane order to idx_ptr[0:n], 0 to idx_ptr[n:len(lanes)], n to cnt_ptr."""
    n = tl.sum(chosen.to(tl.int32), 0)
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(cnt_ptr, n)
    tl.store(idx_ptr + lanes, tl.zeros_like(values).to(idx_ptr.dtype.element_ty), mask=lanes_ok & (lanes >= n))
    tl.store(idx_ptr + slot, values.to(idx_ptr.dtype.element_ty), mask=chosen)


@triton.jit
def _block_topk_select(
    Q, PK, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BLOCKS,
    q_len, kv_len, kv_blocks, k_blocks, sink_blocks, scale, heads, kv_heads,
    stride_qb, stride_qh, stride_qn,
    GROUP: tl.constexpr, PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_P2: tl.constexpr, KB_P2: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)  # b * heads + h, h in the index's head space
    b = bh // heads
    h = bh % heads
    kv_h = h if PER_KV else h // GROUP
    first = qb * BLOCK_M + kv_len - q_len
    last = tl.minimum(q_len, (qb + 1) * BLOCK_M) - 1 + kv_len - q_len
    kb = tl.arange(0, KB_P2)
    kb_ok = kb < kv_blocks
    causal = kb_ok & (kb * BLOCK_N <= last)
    forced = causal & ((kb < sink_blocks) | (kb >= first // BLOCK_N))
    open_ = causal & ~forced
    pk_base = PK + (b * kv_heads + kv_h).to(tl.int64) * kv_blocks * BLOCK_D
    q_b = Q + b.to(tl.int64) * stride_qb
    if PER_KV:
        # The group's per-head probabilities over the open blocks, summed: a head's favourite block gets
        # ~1 whatever its logit scale (block_topk.select). No open block: all 0 (the reference's nan -> 0).
        logits = _pooled_scores(q_b + (kv_h * GROUP).to(tl.int64) * stride_qh, stride_qh, stride_qn, GROUP, qb * BLOCK_M,
                                q_len, pk_base, kb, kb_ok, kv_blocks, HEAD_DIM, BLOCK_D, CHUNK_D, BLOCK_M, HEADS_P2, KB_P2) * scale
        logits = tl.where(open_[None, :], logits, float("-inf"))
        top = tl.max(logits, 1)
        p = tl.exp(logits - tl.where(top == float("-inf"), 0.0, top)[:, None])
        total = tl.sum(p, 1)
        scores = tl.sum(p / tl.where(total == 0.0, 1.0, total)[:, None], 0)
    else:
        scores = tl.sum(_pooled_scores(q_b + h.to(tl.int64) * stride_qh, stride_qh, stride_qn, 1, qb * BLOCK_M, q_len, pk_base,
                                       kb, kb_ok, kv_blocks, HEAD_DIM, BLOCK_D, CHUNK_D, BLOCK_M, HEADS_P2, KB_P2), 0)
    take = tl.minimum(k_blocks, tl.sum(open_.to(tl.int32), 0))
    chosen = forced | _top_take(scores, open_, take, kb)
    top_key = (kb + 1) * BLOCK_N - 1
    is_full = (top_key <= first) & (top_key < kv_len)
    row = bh.to(tl.int64) * tl.num_programs(0) + qb
    _store_list(FULL_CNT + row, FULL_IDX + row * kv_blocks, chosen & is_full, kb, kb, kb_ok)
    _store_list(PART_CNT + row, PART_IDX + row * kv_blocks, chosen & ~is_full, kb, kb, kb_ok)
    tl.store(BLOCKS + row * kv_blocks + kb, chosen, mask=kb_ok)


def fusable(q: torch.Tensor, k: torch.Tensor, block_n: int, row_pos: torch.Tensor | None) -> str | None:
    """Why the fused build cannot take these inputs (None: it can). q [B, Hq, Nq, D], k [B, Hkv, Nk, D]."""
    if row_pos is not None:
        return "a permuted region (row_pos) takes the torch build"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype not in SUPPORTED_DTYPES:
        return f"dtypes {q.dtype}/{k.dtype} are not float16/bfloat16/float32"
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q and k must be contiguous in head_dim"
    if q.device != k.device:
        return f"q is on {q.device}, k on {k.device}"
    if q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} > 256"
    return None


def topk_fusable(q: torch.Tensor, k: torch.Tensor, block_n: int, row_pos: torch.Tensor | None) -> str | None:
    """``fusable`` plus block top-k's limit: its select program holds every key block in registers."""
    why = fusable(q, k, block_n, row_pos)
    if why is None and num_blocks(k.shape[2], block_n) > MAX_KEY_BLOCKS:
        why = f"{num_blocks(k.shape[2], block_n)} key blocks > {MAX_KEY_BLOCKS}"
    return why


def pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 [B, H, BLOCK_D, ceil(N / block)]: means of consecutive blocks of rows of x [B, H, N, D] (valid
    rows only), transposed, head dim padded with 0 to the next power of two."""
    batch, heads, length, dim = x.shape
    blocks = num_blocks(length, block)
    out = torch.empty(batch, heads, block_d(dim), blocks, dtype=torch.float32, device=x.device)
    _pool_rows[(blocks, batch * heads)](
        x, out, length, heads, *x.stride()[:3], HEAD_DIM=dim, BLOCK_D=block_d(dim), BLOCK=block, num_warps=4,
    )
    return out


def _select_config(kv_blocks: int, head_dim: int, heads: int) -> dict:
    """KB_P2 lanes per program, HEADS_P2 query heads scored together; CHUNK_D keeps the [heads, KB, chunk]
    product at <= 8K fp32 registers; more warps for long key axes (the bisection rounds reduce over KB_P2)."""
    kb_p2 = triton.next_power_of_2(max(kv_blocks, 16))
    heads_p2 = triton.next_power_of_2(heads)
    chunk = max(1, min(block_d(head_dim), 8192 // (kb_p2 * heads_p2)))
    return {"KB_P2": kb_p2, "HEADS_P2": heads_p2, "CHUNK_D": chunk, "num_warps": 4 if kb_p2 <= 256 else 8}


def block_topk_index(
    q: torch.Tensor,
    k: torch.Tensor,
    k_blocks: int,
    sink_blocks: int,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[BlockIndex, torch.Tensor]:
    """Block top-k index of q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (Nq <= Nk, bottom-right causal) with
    static widths KB, and the bool selection [B, H, QB, KB] it lists; H = Hq ("query") or Hkv ("kv").
    Equal to ``block_topk.build_index(..., static_widths=True)`` where no two scores of a row are within
    rounding of each other (the pooled means and dots are summed in another order). Inputs are checked by
    the caller (block_topk.select's checks and ``fusable``)."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    heads = kv_heads if head_space == "kv" else q_heads
    q_blocks, kv_blocks = num_blocks(q_len, block_m), num_blocks(kv_len, block_n)
    pooled_k = pool_blocks(k, block_n)
    device = q.device
    counts = torch.empty(2, batch, heads, q_blocks, dtype=torch.int32, device=device)
    lists = torch.empty(2, batch, heads, q_blocks, kv_blocks, dtype=torch.int32, device=device)
    blocks = torch.empty(batch, heads, q_blocks, kv_blocks, dtype=torch.bool, device=device)
    _block_topk_select[(q_blocks, batch * heads)](
        q, pooled_k, counts[0], lists[0], counts[1], lists[1], blocks,
        q_len, kv_len, kv_blocks, k_blocks, sink_blocks, 1.0 / dim**0.5, heads, kv_heads, *q.stride()[:3],
        GROUP=group, PER_KV=head_space == "kv", HEAD_DIM=dim, BLOCK_D=block_d(dim), BLOCK_M=block_m, BLOCK_N=block_n,
        **_select_config(kv_blocks, dim, group if head_space == "kv" else 1),
    )
    index = BlockIndex(counts[0], lists[0], counts[1], lists[1], block_m, block_n, head_space)
    return index, blocks


# ------------------------------------------------------------------------------------------ vertical-slash
#
# 1. ``_vs_row_stats``: per (key chunk, batch, query head), the softmax max and sum of each of the last R
#    query rows over the chunk's causal keys (split so that short prompts still fill the GPU).
# 2. ``_vs_sums``: per (key tile, batch, index head): the probabilities of the tile's keys under the merged
#    row stats (``_vs_stats_merge``), summed over rows into the tile's column sums less their largest row
#    (the discount of ``_common.line_sums``) and, through a skewed gather, into diagonal sums (offset
#    d = pos - j) in two parts with their largest rows, the rows inside the tile and those in the next;
#    kv head space sums the GQA group's heads.
# 3. ``_vs_top``: per (batch, index head, line kind): the line scores (a diagonal's two parts added less
#    the larger peak, 0 below ``vertical_slash.slash_floor``), the forced lines get +inf, the exact top-k of
#    ``_top_take`` picks the rest (ties to the lower id); the ids go out ascending, and for the slashes
#    the prefix counts ``below[x]`` = chosen offsets < x. Past VS_TOP_LANES keys (one program's registers)
#    in stages: every chunk keeps its own top-take as candidates (``_vs_top_chunk``); while those exceed
#    one program, groups of them keep theirs (``_vs_top_reduce``); ``_vs_top_merge`` picks from
#    the rest; ``below`` is then a search of the sorted offsets.
# 4. ``_vs_index``: per (query block, batch, index head): the key blocks a chosen offset touches (two
#    reads of ``below`` per block), full/partial by causality, and the verticals that are causal for the
#    block's last row and outside every touched block as gathered columns.

VS_TILE = 64  # keys per tile of _vs_sums (and per step of _vs_row_stats)
VS_CHUNK = 1024  # keys per _vs_row_stats program (256 at 8K keys was slower: 27 vs 23 us, four times the Q loads)
MAX_LAST_Q = 64  # estimate rows a _vs_sums program holds ([64, 64] probabilities); more: the torch build
VS_TOP_LANES = 32768  # keys (or candidates) a _vs_top program holds in registers
VS_INDEX_TILE = 1024  # key blocks (or verticals) a _vs_index program holds per step
VS_MERGE_TILE = 16  # row-stat chunks a _vs_stats_merge step holds


@triton.jit
def _key_tile(k_base, stride_kn, keys, kv_len, offs_d, HEAD_DIM: tl.constexpr):
    """K^T for the rows ``keys`` of one head: [BLOCK_D, len(keys)], rows outside [0, kv_len) 0."""
    ok = (keys >= 0) & (keys < kv_len)
    return tl.load(k_base + keys.to(tl.int64)[None, :] * stride_kn + offs_d[:, None],
                   mask=ok[None, :] & (offs_d < HEAD_DIM)[:, None], other=0.0)


@triton.jit
def _dot(q, kt, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """q [R, BLOCK_D] . kt [BLOCK_D, N] in fp32, as the reference's fp32 matmul of the upcast inputs."""
    if DOT_F32:
        return tl.dot(q.to(tl.float32), kt.to(tl.float32))  # interpreter bf16 dot bug (_common.online_update)
    if IEEE:
        return tl.dot(q, kt, input_precision="ieee")  # fp32 inputs: no tf32, the reference is fp32
    return tl.dot(q, kt)  # fp16/bf16 products are exact in the fp32 accumulator


@triton.jit
def _tail_rows(Q, b, h, stride_qb, stride_qh, stride_qn, q_len, rows, r, offs_d, HEAD_DIM: tl.constexpr):
    """The last ``rows`` query rows of (b, h), [len(r), len(offs_d)] (lanes r >= rows and dims past HEAD_DIM: 0)."""
    q_rows = q_len - rows + r
    ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
    return tl.load(ptrs, mask=(r < rows)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _vs_row_stats(
    Q, K, M, L, q_len, kv_len, rows, q_heads, scale,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, R_P2: tl.constexpr,
    TILE: tl.constexpr, CHUNK: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    r = tl.arange(0, R_P2)
    offs_d = tl.arange(0, BLOCK_D)
    q = _tail_rows(Q, b, h, stride_qb, stride_qh, stride_qn, q_len, rows, r, offs_d, HEAD_DIM)
    pos = kv_len - rows + r
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    m_i = tl.full([R_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([R_P2], dtype=tl.float32)
    for start in range(chunk * CHUNK, tl.minimum((chunk + 1) * CHUNK, kv_len), TILE):
        keys = start + tl.arange(0, TILE)
        s = _dot(q, _key_tile(k_base, stride_kn, keys, kv_len, offs_d, HEAD_DIM), DOT_F32, IEEE) * scale
        s = tl.where((keys[None, :] <= pos[:, None]) & (keys < kv_len)[None, :] & (r < rows)[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
        m_i = m_new
    out = (bh.to(tl.int64) * tl.num_programs(0) + chunk) * R_P2 + r
    tl.store(M + out, m_i)
    tl.store(L + out, l_i)


@triton.jit
def _vs_stats_merge(M, L, M_OUT, L_OUT, chunks, R_P2: tl.constexpr, C_TILE: tl.constexpr):
    """One query head's per-chunk softmax stats [chunks, R_P2] merged into one (max, sum) per estimate row,
    so every _vs_sums window loads R_P2 values, not chunks x R_P2. Merging in each window instead (one
    launch fewer) put a chain of dependent loads ahead of its exponentials: on an H200 the build's GPU time
    at 8K / 16K keys was 148 / 373 us that way and is 108 / 222 us this way (1024 x 64 stats at 1M keys
    would not fit a window's registers at all); eager, the extra launch costs 0.03-0.08 ms at 8K."""
    bh = tl.program_id(0)
    r = tl.arange(0, R_P2)
    m = tl.full([R_P2], float("-inf"), dtype=tl.float32)
    l = tl.zeros([R_P2], dtype=tl.float32)
    for start in tl.range(0, chunks, C_TILE):
        c = start + tl.arange(0, C_TILE)
        stat = (bh.to(tl.int64) * chunks + c[:, None]) * R_P2 + r[None, :]
        m_c = tl.load(M + stat, mask=(c < chunks)[:, None], other=float("-inf"))
        l_c = tl.load(L + stat, mask=(c < chunks)[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_c, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(l_c * tl.exp(m_c - m_safe[None, :]), 0)
        m = m_new
    tl.store(M_OUT + bh.to(tl.int64) * R_P2 + r, m)
    tl.store(L_OUT + bh.to(tl.int64) * R_P2 + r, l)


@triton.jit
def _vs_sums(
    Q, K, M, L, COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, q_len, kv_len, rows, heads, q_heads, scale,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    GROUP: tl.constexpr, PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, R_P2: tl.constexpr,
    TILE: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
):
    """Tile p: keys [A, A + TILE) with A = (p - 1) * TILE, and the last R_P2 <= TILE rows. It owns the column
    sums of its keys and the diagonal offsets [d0, d0 + TILE), d0 = kv_len - rows - A - TILE + 1. Offset
    d0 + t's entries lie in this tile for rows r <= t and in the next tile for the rest, so a diagonal is
    two partial sums: this tile's rows r <= t into DIAG[d0 + t], and the rows r > t, which are the previous
    tile's offsets d0 + TILE + t, into DIAG_NEXT there (the top-k adds the two; PEAK / PEAK_NEXT hold each
    part's largest row, the discount of _common.line_sums). Both read slot
    (r - 1 - t) mod TILE of the row, one skewed gather. Each key's scores are computed once; a window wide
    enough to hold whole diagonals (TILE + R_P2 - 1 keys, a power of two: 128) computed every key twice."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    r = tl.arange(0, R_P2)
    t = tl.arange(0, TILE)
    offs_d = tl.arange(0, BLOCK_D)
    a = (p - 1) * TILE
    keys = a + t
    pos = kv_len - rows + r
    ok = (keys[None, :] <= pos[:, None]) & (keys >= 0)[None, :] & (keys < kv_len)[None, :] & (r < rows)[:, None]
    kv_h = h if PER_KV else h // GROUP
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    kt = _key_tile(k_base, stride_kn, keys, kv_len, offs_d, HEAD_DIM)  # the tile's keys serve every head of the group
    # The group's probabilities summed before the column and diagonal reductions: sums are linear, and the
    # skewed gather then runs once per tile, not once per head. Unrolled, so the heads' stat and Q loads
    # are issued together.
    total = tl.zeros([R_P2, TILE], dtype=tl.float32)
    for g in tl.static_range(GROUP if PER_KV else 1):
        qh = h * GROUP + g if PER_KV else h
        m = tl.load(M + (b * q_heads + qh).to(tl.int64) * R_P2 + r)  # the rows' merged stats (_vs_stats_merge)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l = tl.load(L + (b * q_heads + qh).to(tl.int64) * R_P2 + r)
        inv_l = 1.0 / tl.where(l == 0.0, 1.0, l)  # one division per row, not per score
        q = _tail_rows(Q, b, qh, stride_qb, stride_qh, stride_qn, q_len, rows, r, offs_d, HEAD_DIM)
        s = _dot(q, kt, DOT_F32, IEEE) * scale
        total += tl.where(ok, tl.exp(s - m_safe[:, None]) * inv_l[:, None], 0.0)
    cols = tl.sum(total, 0) - tl.max(total, 0)  # discounted (_common.line_sums): probabilities are >= 0
    # [R_P2, TILE]: row r's entry at offset d0 + t. The two parts are summed in fp64 and added before one
    # rounding (_line_scores): fp32 parts would round each offset's sum at its own split point, so offsets
    # that tie exactly in the reference's fp32 sums (uniform rows) would no longer tie.
    skewed = tl.gather(total, (r[:, None] + TILE - 1 - t[None, :]) % TILE, 1).to(tl.float64)
    own = r[:, None] <= t[None, :]
    diag = tl.sum(tl.where(own, skewed, 0.0), 0)
    diag_prev = tl.sum(tl.where(own, 0.0, skewed), 0)
    peak = tl.max(tl.where(own, skewed, 0.0), 0)
    peak_prev = tl.max(tl.where(own, 0.0, skewed), 0)
    out = bh.to(tl.int64) * kv_len
    tl.store(COLS + out + keys, cols, mask=(keys >= 0) & (keys < kv_len))
    d = kv_len - rows - a - TILE + 1 + t
    tl.store(DIAG + out + d, diag, mask=(d >= 0) & (d < kv_len))
    tl.store(PEAK + out + d, peak, mask=(d >= 0) & (d < kv_len))
    tl.store(DIAG_NEXT + out + d + TILE, diag_prev, mask=(d + TILE >= 0) & (d + TILE < kv_len))
    tl.store(PEAK_NEXT + out + d + TILE, peak_prev, mask=(d + TILE >= 0) & (d + TILE < kv_len))


@triton.jit
def _line_scores(COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, offs, ok, slash, floor):
    """fp32 line scores at ``offs`` (vertical_slash.line_scores): the discounted column sums, or for slashes
    a diagonal's two fp64 parts (_vs_sums) added, less the larger of the two parts' peaks, rounded once,
    and 0 below ``floor``."""
    if slash:
        peak = tl.maximum(tl.load(PEAK + offs, mask=ok, other=0.0), tl.load(PEAK_NEXT + offs, mask=ok, other=0.0))
        total = tl.load(DIAG + offs, mask=ok, other=0.0) + tl.load(DIAG_NEXT + offs, mask=ok, other=0.0)
        scores = (total - peak).to(tl.float32)
        scores = tl.where(scores < floor, 0.0, scores)
    else:
        scores = tl.load(COLS + offs, mask=ok, other=0.0)
    return scores


# Line counts, forced counts and list widths change with every candidate a search prices, and Triton compiles
# a kernel again whenever an int argument crosses 1 or a multiple of 16 (a cold modal search compiled 8
# variants of _vs_top and 6 of _vs_index). They stay generic; lengths and pointers, which set load alignment,
# stay specialised.
_LINES = ("n_vert", "n_slash", "force_vert", "force_slash", "floor")


@triton.jit(do_not_specialize=_LINES)
def _vs_top(
    COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, VERT, SLASH, BELOW, kv_len, n_vert, n_slash, force_vert, force_slash,
    floor, NK_P2: tl.constexpr,
):
    bh = tl.program_id(0)
    slash = tl.program_id(1) == 1
    lanes = tl.arange(0, NK_P2)
    ok = lanes < kv_len
    row = bh.to(tl.int64) * kv_len
    # Scalars by tl.where, not in the branches: an int argument equal to 1 may arrive as a constant, and
    # both branches of an if must give a variable the same type.
    take = tl.where(slash, n_slash, n_vert)
    force = tl.where(slash, force_slash, force_vert)
    if slash:
        out = SLASH + bh.to(tl.int64) * n_slash
    else:
        out = VERT + bh.to(tl.int64) * n_vert
    scores = _line_scores(COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, row + lanes, ok, slash, floor)
    scores = tl.where(lanes < force, float("inf"), scores)  # MInference's forced lines
    chosen = _top_take(scores, ok, take, lanes)  # exactly ``take`` lines: take <= kv_len
    slot = tl.cumsum(chosen.to(tl.int32), 0)
    tl.store(out + slot - 1, lanes.to(tl.int64), mask=chosen)
    if slash:
        below = BELOW + bh.to(tl.int64) * (kv_len + 1)
        tl.store(below + lanes + 1, slot, mask=ok)  # below[x + 1] = chosen offsets <= x
        tl.store(below, 0)


@triton.jit(do_not_specialize=_LINES + ("width",))
def _vs_top_chunk(
    COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, CAND_S, CAND_I, kv_len, n_vert, n_slash, force_vert, force_slash,
    floor, width, CHUNK: tl.constexpr,
):
    """Keys past VS_TOP_LANES, stage 1: each chunk of CHUNK keys keeps its own best min(take, chunk) lines
    as (score, key id) candidates, ascending by id, in its ``width`` slots (the rest id -1); stage 2
    (``_vs_top_merge``) picks the take best candidates. Exact: a line of the global top-take is in its
    chunk's top-take, and ties to the lower id hold in both stages."""
    bh = tl.program_id(0)
    slash = tl.program_id(1) == 1
    chunk = tl.program_id(2)
    lanes = tl.arange(0, CHUNK)
    keys = chunk * CHUNK + lanes
    ok = keys < kv_len
    take = tl.where(slash, n_slash, n_vert)
    force = tl.where(slash, force_slash, force_vert)
    scores = _line_scores(COLS, DIAG, DIAG_NEXT, PEAK, PEAK_NEXT, bh.to(tl.int64) * kv_len + keys, ok, slash, floor)
    scores = tl.where(keys < force, float("inf"), scores)
    take = tl.minimum(take, tl.minimum(kv_len - chunk * CHUNK, CHUNK))
    chosen = _top_take(scores, ok, take, lanes)
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    base = ((bh * 2 + tl.program_id(1)) * tl.num_programs(2) + chunk).to(tl.int64) * width
    tl.store(CAND_I + base + lanes, tl.full([CHUNK], -1, tl.int32), mask=(lanes >= take) & (lanes < width))
    tl.store(CAND_S + base + slot, scores, mask=chosen)
    tl.store(CAND_I + base + slot, keys, mask=chosen)


@triton.jit(do_not_specialize=("n_cand", "n_vert", "n_slash", "width"))
def _vs_top_reduce(CAND_S, CAND_I, OUT_S, OUT_I, n_cand, n_vert, n_slash, width, CHUNK: tl.constexpr):
    """A middle stage of the chunked top-k, while a head's candidates exceed one program: each group of
    CHUNK candidates (ascending by id) keeps its own best min(take, live) as stage 1 does for keys, in its
    ``width`` slots of OUT (the rest id -1), ascending by id. Exact for the reason stage 1 is."""
    bh = tl.program_id(0)
    kind = tl.program_id(1)
    group = tl.program_id(2)
    lanes = tl.arange(0, CHUNK)
    pos = group * CHUNK + lanes
    src = (bh * 2 + kind).to(tl.int64) * n_cand
    ids = tl.load(CAND_I + src + pos, mask=pos < n_cand, other=-1)
    live = ids >= 0
    scores = tl.load(CAND_S + src + pos, mask=live, other=0.0)
    take = tl.minimum(tl.where(kind == 1, n_slash, n_vert), tl.sum(live.to(tl.int32), 0))
    chosen = _top_take(scores, live, take, lanes)
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    base = ((bh * 2 + kind) * tl.num_programs(2) + group).to(tl.int64) * width
    tl.store(OUT_I + base + lanes, tl.full([CHUNK], -1, tl.int32), mask=(lanes >= take) & (lanes < width))
    tl.store(OUT_S + base + slot, scores, mask=chosen)
    tl.store(OUT_I + base + slot, ids, mask=chosen)


@triton.jit(do_not_specialize=("n_cand", "n_vert", "n_slash"))
def _vs_top_merge(CAND_S, CAND_I, VERT, SLASH, n_cand, n_vert, n_slash, NC_P2: tl.constexpr):
    """Stage 2 of the chunked top-k: the take best of a head's candidates (ascending by id, so position
    order is id order and the tie rule carries over), written ascending."""
    bh = tl.program_id(0)
    slash = tl.program_id(1) == 1
    lanes = tl.arange(0, NC_P2)
    base = (bh * 2 + tl.program_id(1)).to(tl.int64) * n_cand
    ids = tl.load(CAND_I + base + lanes, mask=lanes < n_cand, other=-1)
    live = ids >= 0
    scores = tl.load(CAND_S + base + lanes, mask=live, other=0.0)
    take = tl.where(slash, n_slash, n_vert)
    if slash:
        out = SLASH + bh.to(tl.int64) * n_slash
    else:
        out = VERT + bh.to(tl.int64) * n_vert
    chosen = _top_take(scores, live, take, lanes)
    slot = tl.cumsum(chosen.to(tl.int32), 0)
    tl.store(out + slot - 1, ids.to(tl.int64), mask=chosen)


@triton.jit
def _vs_touched(below, kb, p0, p1, kv_len, BLOCK_N: tl.constexpr):
    """Whether a chosen slash offset reaches key block kb from the query block at positions [p0, p1]:
    some offset in [max(p0 - k1, 0), p1 - k0] (prefix counts ``below``), and the block is causal."""
    k0 = kb * BLOCK_N
    k1 = tl.minimum(k0 + BLOCK_N - 1, kv_len - 1)
    lo = tl.minimum(tl.maximum(p0 - k1, 0), kv_len)
    hi = tl.minimum(tl.maximum(p1 - k0, -1), kv_len - 1)
    return (tl.load(below + hi + 1) > tl.load(below + lo)) & (k0 <= p1)


@triton.jit
def _store_run(idx_ptr, n, chosen, values):
    """Append ``values`` where ``chosen`` to a list holding ``n`` entries; returns the new count."""
    slot = n + tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(idx_ptr + slot, values.to(idx_ptr.dtype.element_ty), mask=chosen)
    return n + tl.sum(chosen.to(tl.int32), 0)


@triton.jit
def _zero_tail(idx_ptr, n, width, TILE: tl.constexpr):
    """0 into idx_ptr[n:width] (the padding the torch static-width build leaves)."""
    for start in tl.range(n // TILE * TILE, width, TILE):
        lanes = start + tl.arange(0, TILE)
        tl.store(idx_ptr + lanes, tl.zeros([TILE], dtype=idx_ptr.dtype.element_ty), mask=(lanes >= n) & (lanes < width))


@triton.jit(do_not_specialize=("n_vert", "full_w", "part_w", "n_words"))
def _vs_index(
    VERT, BELOW, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, COL_CNT, COL_IDX, TAB_BITS, TAB_CLEAN, TAB_SPAN,
    q_len, kv_len, kv_blocks, n_vert, full_w, part_w, n_words,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB_TILE: tl.constexpr, V_TILE: tl.constexpr,
):
    """One query block's lists, walking its causal key blocks and then the verticals a tile at a time
    (1M keys are 16K key blocks and up to 16K verticals: more than one program's registers), each list
    at its static width (``vertical_slash.list_widths``; the verticals); and its row of the column table
    (index.ColumnTable: the verticals are the slots; V_TILE is a multiple of 32, one word per 32 lanes)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    p0 = qb * BLOCK_M + kv_len - q_len
    p1 = tl.minimum(q_len, (qb + 1) * BLOCK_M) - 1 + kv_len - q_len
    below = BELOW + bh.to(tl.int64) * (kv_len + 1)
    row = bh.to(tl.int64) * tl.num_programs(0) + qb
    full_ptr = FULL_IDX + row * full_w
    part_ptr = PART_IDX + row * part_w
    causal_blocks = tl.minimum(kv_blocks, p1 // BLOCK_N + 1)
    n_full = 0
    n_part = 0
    for start in tl.range(0, causal_blocks, KB_TILE):
        kb = start + tl.arange(0, KB_TILE)
        kb_ok = kb < causal_blocks
        touched = _vs_touched(below, tl.where(kb_ok, kb, 0), p0, p1, kv_len, BLOCK_N) & kb_ok
        top_key = (kb + 1) * BLOCK_N - 1
        is_full = (top_key <= p0) & (top_key < kv_len)
        n_full = _store_run(full_ptr, n_full, touched & is_full, kb)
        n_part = _store_run(part_ptr, n_part, touched & ~is_full, kb)
    tl.store(FULL_CNT + row, n_full)
    tl.store(PART_CNT + row, n_part)
    _zero_tail(full_ptr, n_full, full_w, KB_TILE)
    _zero_tail(part_ptr, n_part, part_w, KB_TILE)
    col_ptr = COL_IDX + row * n_vert
    n_col = 0
    clean = n_vert  # the first slot that is unused or not causal for the block's first row
    span = 0
    for start in tl.range(0, n_vert, V_TILE):
        lanes = start + tl.arange(0, V_TILE)
        live = lanes < n_vert
        vert = tl.load(VERT + bh.to(tl.int64) * n_vert + lanes, mask=live, other=0).to(tl.int32)
        covered = _vs_touched(below, vert // BLOCK_N, p0, p1, kv_len, BLOCK_N)
        keep = live & (vert <= p1) & ~covered
        n_col = _store_run(col_ptr, n_col, keep, vert)
        # Disjoint bits: their int32 sum is their OR.
        words = tl.sum(tl.reshape(keep.to(tl.int32) << (lanes % 32), [V_TILE // 32, 32]), axis=1)
        w_lanes = start // 32 + tl.arange(0, V_TILE // 32)
        tl.store(TAB_BITS + row * n_words + w_lanes, words, mask=w_lanes < n_words)
        clean = tl.minimum(clean, tl.min(tl.where(live & ~(keep & (vert <= p0)), lanes, n_vert), 0))
        span = tl.maximum(span, tl.max(tl.where(keep, lanes + 1, 0), 0))
    tl.store(COL_CNT + row, n_col)
    tl.store(TAB_CLEAN + row, clean)
    tl.store(TAB_SPAN + row, span)
    _zero_tail(col_ptr, n_col, n_vert, V_TILE)


def vs_fusable(q: torch.Tensor, k: torch.Tensor, block_n: int, last_q: int, row_pos: torch.Tensor | None,
               vertical_size: int, slash_size: int) -> str | None:
    """``fusable`` plus the vertical-slash limits (None: the fused build takes these inputs)."""
    why = fusable(q, k, block_n, row_pos)
    if why is None and q.shape[-1] < 16:
        why = f"head_dim {q.shape[-1]} < 16 (tl.dot's smallest side)"
    if why is None and min(last_q, q.shape[2]) > MAX_LAST_Q:
        why = f"last_q {last_q} > {MAX_LAST_Q}"
    if why is None:
        kv_len = k.shape[2]
        why = vs_top_refusal(kv_len, min(vertical_size, kv_len), min(slash_size, kv_len))
    return why


def vs_top_refusal(kv_len: int, vertical_size: int, slash_size: int) -> str | None:
    """Why the top-k cannot take this many keys and lines (None: it can): one program holds VS_TOP_LANES
    keys; past that, each chunked stage must at least halve the candidates, so a head keeps at most half a
    program's lanes of lines."""
    if kv_len <= VS_TOP_LANES:
        return None
    width = _candidates_per_chunk(vertical_size, slash_size)
    if 2 * width > VS_TOP_LANES:
        return f"{width} lines per head over {kv_len} keys: the chunked top-k takes at most {VS_TOP_LANES // 2}"
    return None


def _candidates_per_chunk(n_vert: int, n_slash: int) -> int:
    """Slots each chunk of the chunked top-k keeps for its candidates: the larger take, at most a chunk."""
    return min(max(n_vert, n_slash), VS_TOP_LANES)


def _top_warps(lanes: int) -> int:
    return 4 if lanes <= 2048 else (8 if lanes <= 8192 else 16)


def _vs_lines(cols, diag, vertical, slash, below, kv_len: int, n_vert: int, n_slash: int, force_vertical: int, force_slash: int,
              floor: float) -> None:
    """The top-k of the column sums [BH, kv_len] and the two-part diagonal sums and peaks [4, BH, kv_len] into
    vertical/slash (ascending) and the prefix counts ``below`` [BH, kv_len + 1] of the chosen offsets: one
    program per head and kind up to
    VS_TOP_LANES keys, else chunked (``_vs_top_chunk`` then ``_vs_top_merge``; inputs checked by
    ``vs_top_refusal``)."""
    bh, device = cols.shape[0], cols.device
    if kv_len <= VS_TOP_LANES:
        nk_p2 = triton.next_power_of_2(kv_len)
        _vs_top[(bh, 2)](
            cols, *diag, vertical, slash, below, kv_len, n_vert, n_slash, force_vertical, force_slash, floor,
            NK_P2=nk_p2, num_warps=_top_warps(nk_p2),
        )
        return
    chunks = num_blocks(kv_len, VS_TOP_LANES)
    width = _candidates_per_chunk(n_vert, n_slash)
    cand_s = torch.empty(bh, 2, chunks, width, dtype=torch.float32, device=device)
    cand_i = torch.empty(bh, 2, chunks, width, dtype=torch.int32, device=device)
    _vs_top_chunk[(bh, 2, chunks)](
        cols, *diag, cand_s, cand_i, kv_len, n_vert, n_slash, force_vertical, force_slash, floor, width,
        CHUNK=VS_TOP_LANES, num_warps=16,
    )
    n_cand = chunks * width
    while n_cand > VS_TOP_LANES:  # e.g. 128K keys with > 8K lines: each pass keeps <= half (vs_top_refusal)
        groups = num_blocks(n_cand, VS_TOP_LANES)
        out_s = torch.empty(bh, 2, groups, width, dtype=torch.float32, device=device)
        out_i = torch.empty(bh, 2, groups, width, dtype=torch.int32, device=device)
        _vs_top_reduce[(bh, 2, groups)](cand_s, cand_i, out_s, out_i, n_cand, n_vert, n_slash, width, CHUNK=VS_TOP_LANES, num_warps=16)
        cand_s, cand_i, n_cand = out_s, out_i, groups * width
    nc_p2 = triton.next_power_of_2(n_cand)
    _vs_top_merge[(bh, 2)](cand_s, cand_i, vertical, slash, n_cand, n_vert, n_slash, NC_P2=nc_p2, num_warps=_top_warps(nc_p2))
    # below[h, x] = chosen offsets < x, as _vs_top writes it: a search of the sorted offsets.
    points = torch.arange(kv_len + 1, device=device).expand(bh, -1).contiguous()
    below.copy_(torch.searchsorted(slash.view(bh, n_slash), points))


def vertical_slash_index(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical_size: int,
    slash_size: int,
    last_q: int,
    force_vertical: int,
    force_slash: int,
    slash_floor: float,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    scale: float | None = None,
) -> tuple[BlockIndex, torch.Tensor, torch.Tensor]:
    """Vertical-slash index of q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (Nq <= Nk, bottom-right causal) with static
    widths (block lists as wide as ``vertical_slash.list_widths``, min(vertical_size, Nk) columns), and its lines: vertical ids int64 [B, H, V] and
    slash offsets int64 [B, H, S], ascending. force_*: the forced counts (``vertical_slash.forced``);
    slash_floor: the slash score below which an offset is no line (``vertical_slash.slash_floor``). Equal
    to ``vertical_slash.build_index(..., static_widths=True)`` where no two line scores of a head are within
    rounding at the top-k boundary and none is within rounding of the floor. Inputs are checked by the caller (``vs_fusable``)."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    heads = kv_heads if head_space == "kv" else q_heads
    rows = min(last_q, q_len)
    r_p2 = max(16, triton.next_power_of_2(rows))
    scale = 1.0 / dim**0.5 if scale is None else scale
    device = q.device
    dot = {"DOT_F32": dot_f32(q.dtype), "IEEE": q.dtype == torch.float32}
    chunks = num_blocks(kv_len, VS_CHUNK)
    stats = torch.empty(2, batch * q_heads, chunks, r_p2, dtype=torch.float32, device=device)
    _vs_row_stats[(chunks, batch * q_heads)](
        q, k, stats[0], stats[1], q_len, kv_len, rows, q_heads, scale, *q.stride()[:3], *k.stride()[:3],
        GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d(dim), R_P2=r_p2, TILE=VS_TILE, CHUNK=VS_CHUNK, **dot, num_warps=4,
    )
    merged = torch.empty(2, batch * q_heads, r_p2, dtype=torch.float32, device=device)
    _vs_stats_merge[(batch * q_heads,)](stats[0], stats[1], merged[0], merged[1], chunks, R_P2=r_p2, C_TILE=VS_MERGE_TILE, num_warps=4)
    cols = torch.empty(batch * heads, kv_len, dtype=torch.float32, device=device)
    diag = torch.empty(4, batch * heads, kv_len, dtype=torch.float64, device=device)  # a diagonal's two parts, their peaks
    # Tiles start one tile left of key 0, so that offsets up to kv_len - 1 are owned (R_P2 <= TILE), and run
    # one past the last key, so that every owned offset's second part is written (zeros there).
    tile = max(VS_TILE, r_p2)
    _vs_sums[(num_blocks(kv_len, tile) + 2, batch * heads)](
        q, k, merged[0], merged[1], cols, *diag, q_len, kv_len, rows, heads, q_heads, scale,
        *q.stride()[:3], *k.stride()[:3],
        GROUP=group, PER_KV=head_space == "kv", HEAD_DIM=dim, BLOCK_D=block_d(dim), R_P2=r_p2, TILE=tile, **dot,
        num_warps=4,
    )
    n_vert, n_slash = min(vertical_size, kv_len), min(slash_size, kv_len)
    vertical = torch.empty(batch, heads, n_vert, dtype=torch.int64, device=device)
    slash = torch.empty(batch, heads, n_slash, dtype=torch.int64, device=device)
    below = torch.empty(batch * heads, kv_len + 1, dtype=torch.int32, device=device)
    _vs_lines(cols, diag, vertical, slash, below, kv_len, n_vert, n_slash, force_vertical, force_slash, slash_floor)
    from ..patterns.vertical_slash import list_widths  # local: the pattern module imports this one lazily

    q_blocks, kv_blocks = num_blocks(q_len, block_m), num_blocks(kv_len, block_n)
    full_w, part_w = list_widths(n_slash, kv_blocks, block_m, block_n)
    counts = torch.empty(5, batch, heads, q_blocks, dtype=torch.int32, device=device)  # + the table's clean, span
    full_idx = torch.empty(batch, heads, q_blocks, full_w, dtype=torch.int32, device=device)
    part_idx = torch.empty(batch, heads, q_blocks, part_w, dtype=torch.int32, device=device)
    col_idx = torch.empty(batch, heads, q_blocks, n_vert, dtype=torch.int32, device=device)
    bits = torch.empty(batch, heads, q_blocks, num_blocks(n_vert, 32), dtype=torch.int32, device=device)
    _vs_index[(q_blocks, batch * heads)](
        vertical, below, counts[0], full_idx, counts[1], part_idx, counts[2], col_idx, bits, counts[3], counts[4],
        q_len, kv_len, kv_blocks, n_vert, full_w, part_w, bits.shape[-1],
        BLOCK_M=block_m, BLOCK_N=block_n, KB_TILE=min(VS_INDEX_TILE, triton.next_power_of_2(kv_blocks)),
        V_TILE=max(32, min(VS_INDEX_TILE, triton.next_power_of_2(n_vert))), num_warps=4,
    )
    table = ColumnTable(vertical.to(torch.int32), bits, counts[3], counts[4])
    index = BlockIndex(counts[0], full_idx, counts[1], part_idx, block_m, block_n, head_space, counts[2], col_idx, col_table=table)
    return index, vertical, slash
