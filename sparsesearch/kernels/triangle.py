"""Triangle attention (TriangleMix, paper 002 App. A.2).

Rows before the last ``last`` rows attend the streaming part (sink + local window): that is the
block-sparse kernel over an index built by ``patterns.triangle``. The last rows attend every causal key;
they are few (128 by default) but see the whole context, so a split-K kernel spreads their keys over many
programs, and a merge kernel combines the partials by log-sum-exp straight into those rows of the output,
over the streaming result (``tail_attention`` returns the merged rows instead, merged by sparsesearch/merge.py).
Measured on an H200 at 4K: the torch merge and its copies cost more host time per call than the whole GPU
work of the triangle (0.54 ms against 0.25 ms), which put the kernel behind FlexAttention at short lengths.

Layouts and outputs as in ``block_sparse_attention``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..index import BlockIndex
from ..merge import merge_partials
from ._common import LOG2E, bhn_strides, block_d, check_layout, dot_f32, fill_splits, interpreting, load_kv_tile, online_update, sm_count
from .block_sparse import attend_in_layout



# Row counts, split sizes and row positions change with the pattern's parameters, which a search varies; they
# stay out of the compile key (a cold modal search compiled 6 and 7 variants of these two kernels). The
# Q/K/V/O strides, which set load alignment, stay specialised.
_ROW_ARGS = ("q_len_max", "last", "row_first", "row_step", "heads_per_batch")


@triton.jit(do_not_specialize=_ROW_ARGS + ("kv_len_max", "chunk"))
def _tail_split_fwd(
    Q, K, V, PO, PL, CU_Q, CU_K, QH_MAP,
    qk_scale, q_len_max, kv_len_max, last, chunk, row_first, row_step, heads_per_batch,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_os, stride_ob, stride_oh, stride_or,
    stride_ls, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, VARLEN: tl.constexpr, DOT_F32: tl.constexpr, STRIDED: tl.constexpr,
):
    split = tl.program_id(0)
    m_tile = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // heads_per_batch
    slot = pid_bh % heads_per_batch  # the partials' head axis
    if STRIDED:
        h = tl.load(QH_MAP + slot)  # only the query heads served
    else:
        h = slot
    kv_h = h // GROUP
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        kv_len = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = 0
        q_len = q_len_max
        k_start = 0
        kv_len = kv_len_max
    tail = tl.minimum(last, q_len)
    offs_r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the tail
    row_ok = offs_r < tail
    if STRIDED:
        rows = row_first + row_step * offs_r  # a grid head's horizontal lines (index.GridLines)
        first_row = row_first + row_step * m_tile * BLOCK_M
    else:
        rows = q_len - tail + offs_r
        first_row = q_len - tail + m_tile * BLOCK_M
    pos = rows + (kv_len - q_len)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    if m_tile * BLOCK_M >= tail:
        return  # no row of this tile is in the tail: never read
    if lo >= hi:
        # No key in this split (a shorter sequence of a varlen batch): lse -inf, so the merge weighs it 0.
        tl.store(PL + split.to(tl.int64) * stride_ls + b * stride_lb + slot * stride_lh + offs_r, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return

    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TILE_N)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + (q_start + rows).to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    never = offs_t < 0

    # Tiles every row of this tile may see whole (below the first row's position) need no mask.
    first_pos = first_row + (kv_len - q_len)
    safe_hi = tl.minimum(hi, first_pos + 1)
    # Never below lo: a split that starts past the first row's position has no unmasked tile at all.
    safe_end = lo + (tl.maximum(safe_hi - lo, 0) // TILE_N) * TILE_N
    for start in range(lo, safe_end, TILE_N):
        cols = start + offs_t
        kt = load_kv_tile(k_base, cols, stride_kn, offs_d, never, HEAD_DIM, BLOCK_D, False, True)
        vt = load_kv_tile(v_base, cols, stride_vn, offs_d, never, HEAD_DIM, BLOCK_D, False, False)
        m_i, l_i, acc = online_update(q, kt, vt, never, m_i, l_i, acc, qk_scale, False, DOT_F32)
    for start in range(safe_end, hi, TILE_N):
        cols = start + offs_t
        col_ok = cols < hi
        kt = load_kv_tile(k_base, cols, stride_kn, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, True)
        vt = load_kv_tile(v_base, cols, stride_vn, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, False)
        ok = col_ok[None, :] & (cols[None, :] <= pos[:, None])
        m_i, l_i, acc = online_update(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, DOT_F32)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = PO + split.to(tl.int64) * stride_os + b * stride_ob + slot * stride_oh + offs_r[:, None] * stride_or + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(PL + split.to(tl.int64) * stride_ls + b * stride_lb + slot * stride_lh + offs_r, lse, mask=row_ok)


@triton.jit(do_not_specialize=_ROW_ARGS + ("splits",))
def _merge_rows_fwd(
    PO, PL, O, LSE, CU_Q, QH_MAP,
    splits, q_len_max, last, row_first, row_step, heads_per_batch,
    stride_os, stride_ob, stride_oh, stride_or,
    stride_ls, stride_lb, stride_lh,
    stride_qb, stride_qh, stride_qn,
    stride_eb, stride_eh, stride_en,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, VARLEN: tl.constexpr, STRIDED: tl.constexpr,
):
    """Merge the split partials of BLOCK_R rows by log-sum-exp straight into out/lse at the rows'
    positions (the tail's, or a grid head's strided lines): one launch instead of a chain of torch ops."""
    r_tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads_per_batch
    slot = pid_bh % heads_per_batch
    if STRIDED:
        h = tl.load(QH_MAP + slot)
    else:
        h = slot
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
    else:
        q_start = 0
        q_len = q_len_max
    tail = tl.minimum(last, q_len)
    offs_r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = offs_r < tail
    if STRIDED:
        rows = row_first + row_step * offs_r
    else:
        rows = q_len - tail + offs_r
    offs_d = tl.arange(0, BLOCK_D)
    l_base = PL + b * stride_lb + slot * stride_lh + offs_r
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for split in range(0, splits):
        m = tl.maximum(m, tl.load(l_base + split * stride_ls, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    o_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    # Stepped by pointer (64-bit) per split: a grid head's many line rows can put split * stride_os past int32.
    o_split = PO + b * stride_ob + slot * stride_oh + offs_r[:, None] * stride_or + offs_d[None, :]
    for split in range(0, splits):
        w = tl.exp(tl.load(l_base + split * stride_ls, mask=row_ok, other=float("-inf")) - m_safe)
        o = tl.load(o_split, mask=o_ok, other=0.0)
        o_split += stride_os
        # An empty split's partial output is never written: weigh it out instead of multiplying 0 by it.
        acc += tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0)
        den += w
    empty = den == 0.0
    out = acc / tl.where(empty, 1.0, den)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, den)))
    o_ptrs = O + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + (q_start + rows).to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_ok)
    tl.store(LSE + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh + (q_start + rows).to(tl.int64) * stride_en, lse, mask=row_ok)


def _num_splits(kv_len: int, programs: int, tile_n: int) -> int:
    """Enough key splits to give every SM about two programs, each split at least one tile wide."""
    return fill_splits(programs, triton.cdiv(kv_len, tile_n), sm_count(0))


def tail_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    last: int,
    *,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    splits: int | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention of each sequence's last ``last`` query rows, split over keys.

    Returns (out fp32 [B, Hq, last, D], lse fp32 [B, Hq, last]); row r of sequence b is query row
    q_len_b − min(last, q_len_b) + r, and rows r >= min(last, q_len_b) are (0, −inf).
    """
    if last < 1:
        raise ValueError(f"last must be >= 1, got {last}")
    layout = check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _split_rows(q, k, v, layout, last, scale, splits, config=config)


def line_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, step: int, count: int,
                        q_heads: torch.Tensor, *, scale: float | None = None, out: torch.Tensor | None = None,
                        lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Dense causal attention of the q rows first + step * r (r < count; a grid head's horizontal lines),
    split over keys, for the query heads ``q_heads`` (int32 [S] ids) only. Dense layout.
    Returns (out fp32 [B, S, count, D], lse fp32 [B, S, count]); given out [B, Hq, Nq, D] (q's dtype) and lse
    fp32 [B, Hq, Nq], writes those rows and heads of them in place instead and returns None."""
    layout = check_layout(q, k, v, None, None)
    into = None if out is None else (out, lse, bhn_strides(out, False), lse.stride())
    return _split_rows(q, k, v, layout, count, scale, None, (first, step, q_heads), into)


def tail_config(rows: int, head_dim: int, interpret: bool) -> dict:
    """Launch shape of the split-K tail pass for ``rows`` query rows: 128-row tiles of 64 keys to head_dim 128
    (the block-sparse kernel's measured best); past it 64 rows of 64 keys in three stages, as a 128 x 256 fp32
    accumulator alone is 256 registers a thread at 4 warps and spills: at Gemma 3's shape (4 heads, 1 KV head,
    d 256) 0.41-0.64 of SDPA's rate for 512-2048 rows at 32K against 0.17-0.20 (benchmarks/tune_tail.py, Run 34)."""
    if interpret:
        block_m, tile_n, warps, stages = 16, 64, 4, 1
    elif head_dim <= 128:
        block_m, tile_n, warps, stages = (64 if rows <= 64 else 128), 64, 4, 2
    else:
        block_m, tile_n, warps, stages = 64, 64, 4, 3
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    return {"BLOCK_M": block_m, "TILE_N": tile_n, "num_warps": warps, "num_stages": stages}


def _split_rows(q, k, v, layout, last: int, scale: float | None, splits: int | None, strided: tuple | None = None,
                into: tuple | None = None, config: dict | None = None):
    """The split-K launch behind tail_attention (the last ``last`` rows, every head) and
    line_rows_attention (strided: (first, step, q_heads)). into: (out, lse, out's (b, h, n) strides, lse's):
    the partials are merged by one more launch straight into those rows of out/lse (returns None); else
    merged by torch and returned as fp32 (out, lse)."""
    varlen, batch, q_heads, kv_heads = layout.varlen, layout.batch, layout.q_heads, layout.kv_heads
    served = q_heads if strided is None else strided[2].numel()
    q_len_max, kv_len_max = layout.q_len_max, layout.kv_len_max
    sq, sk, sv = (bhn_strides(t, varlen) for t in (q, k, v))
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows = min(last, q_len_max)
    launch = {**tail_config(rows, head_dim, interpreting()), **(config or {})}
    block_m, tile_n = launch.pop("BLOCK_M"), launch.pop("TILE_N")
    m_tiles = triton.cdiv(rows, block_m)
    splits = splits or _num_splits(kv_len_max, m_tiles * batch * served, tile_n)
    chunk = triton.cdiv(triton.cdiv(kv_len_max, splits), tile_n) * tile_n
    splits = triton.cdiv(kv_len_max, chunk)
    if into is None:
        # Returned rows past a sequence's tail read (0, -inf): pre-filled, as the kernel never writes them.
        part_o = torch.zeros(splits, batch, served, last, head_dim, dtype=torch.float32, device=q.device)
        part_l = torch.full((splits, batch, served, last), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        # The merge launch reads only rows inside each tail, and every split writes those (an empty one -inf).
        part_o = torch.empty(splits, batch, served, last, head_dim, dtype=torch.float32, device=q.device)
        part_l = torch.empty(splits, batch, served, last, dtype=torch.float32, device=q.device)
    first, step, head_map = strided if strided is not None else (0, 1, layout.cu_q)
    _tail_split_fwd[(splits, m_tiles, batch * served)](
        q, k, v, part_o, part_l, layout.cu_q, layout.cu_k, head_map,
        scale * LOG2E, q_len_max, kv_len_max, last, chunk, first, step, served,
        *sq, *sk, *sv,
        *part_o.stride()[:4], *part_l.stride()[:3],
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=block_m, TILE_N=tile_n, VARLEN=varlen, DOT_F32=dot_f32(q.dtype), STRIDED=strided is not None, **launch,
    )
    if into is None:
        return merge_partials(part_o, part_l, dim=0)
    out, lse, so, sl = into
    _merge_rows_fwd[(m_tiles, batch * served)](
        part_o, part_l, out, lse, layout.cu_q, head_map, splits, q_len_max, last, first, step, served,
        *part_o.stride()[:4], *part_l.stride()[:3], *so, *sl,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_R=block_m, VARLEN=varlen, STRIDED=strided is not None,
        num_warps=4,
    )
    return None


def triangle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    stream_index: BlockIndex,
    last: int,
    *,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Streaming (sink + window) rows from ``stream_index`` and dense last rows; shapes as block_sparse
    (out/lse given: written in place and returned). Three launches: the streaming pass, the tail's split-K
    pass, and a merge that writes the tail's rows over the streaming ones."""
    if last < 1:
        raise ValueError(f"last must be >= 1, got {last}")
    layout = check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k)  # once for both passes
    out, lse = attend_in_layout(q, k, v, stream_index, layout, scale=scale, out=out, lse=lse)
    varlen = layout.varlen
    sl = (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()
    _split_rows(q, k, v, layout, last, scale, None, None, (out, lse, bhn_strides(out, varlen), sl))
    return out, lse
