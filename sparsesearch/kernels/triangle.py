"""Triangle attention (TriangleMix, paper 002 App. A.2).

Rows before the last ``last`` rows attend the streaming part (sink + local window): that is the
block-sparse kernel over an index built by ``patterns.triangle``. The last rows attend every causal key;
they are few (128 by default) but see the whole context, so a split-K kernel spreads their keys over many
programs and the partials are merged by log-sum-exp (sparsesearch/merge.py). The streaming result for those rows
is overwritten.

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
from .block_sparse import block_sparse_attention



@triton.jit
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
    if (m_tile * BLOCK_M >= tail) | (lo >= hi):
        return  # the launcher pre-fills partials with (0, -inf)

    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TILE_N)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + h * stride_qh + (q_start + rows).to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kv_h * stride_vh + k_start.to(tl.int64) * stride_vn
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
    o_ptrs = PO + split * stride_os + b * stride_ob + slot * stride_oh + offs_r[:, None] * stride_or + offs_d[None, :]
    tl.store(o_ptrs, out, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(PL + split * stride_ls + b * stride_lb + slot * stride_lh + offs_r, lse, mask=row_ok)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention of each sequence's last ``last`` query rows, split over keys.

    Returns (out fp32 [B, Hq, last, D], lse fp32 [B, Hq, last]); row r of sequence b is query row
    q_len_b − min(last, q_len_b) + r, and rows r >= min(last, q_len_b) are (0, −inf).
    """
    if last < 1:
        raise ValueError(f"last must be >= 1, got {last}")
    layout = check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _split_rows(q, k, v, layout, last, scale, splits)


def line_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, step: int, count: int,
                        q_heads: torch.Tensor, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention of the q rows first + step * r (r < count; a grid head's horizontal lines),
    split over keys, for the query heads ``q_heads`` (int32 [S] ids) only. Dense layout.
    Returns (out fp32 [B, S, count, D], lse fp32 [B, S, count])."""
    layout = check_layout(q, k, v, None, None)
    return _split_rows(q, k, v, layout, count, scale, None, (first, step, q_heads))


def _split_rows(q, k, v, layout, last: int, scale: float | None, splits: int | None, strided: tuple | None = None):
    """The split-K launch behind tail_attention (the last ``last`` rows, every head) and
    line_rows_attention (strided: (first, step, q_heads))."""
    varlen, batch, q_heads, kv_heads = layout.varlen, layout.batch, layout.q_heads, layout.kv_heads
    served = q_heads if strided is None else strided[2].numel()
    q_len_max, kv_len_max = layout.q_len_max, layout.kv_len_max
    sq, sk, sv = (bhn_strides(t, varlen) for t in (q, k, v))
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    rows = min(last, q_len_max)
    block_m = 16 if interpreting() else (64 if rows <= 64 else 128)
    block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    tile_n = 64
    m_tiles = triton.cdiv(rows, block_m)
    splits = splits or _num_splits(kv_len_max, m_tiles * batch * served, tile_n)
    chunk = triton.cdiv(triton.cdiv(kv_len_max, splits), tile_n) * tile_n
    splits = triton.cdiv(kv_len_max, chunk)
    part_o = torch.zeros(splits, batch, served, last, head_dim, dtype=torch.float32, device=q.device)
    part_l = torch.full((splits, batch, served, last), float("-inf"), dtype=torch.float32, device=q.device)
    first, step, head_map = strided if strided is not None else (0, 1, layout.cu_q)
    # Same shape of tile as the block-sparse kernel's measured best (4 warps, 2 stages, 64-wide keys).
    config = {"num_warps": 4, "num_stages": 1 if interpreting() else 2}
    _tail_split_fwd[(splits, m_tiles, batch * served)](
        q, k, v, part_o, part_l, layout.cu_q, layout.cu_k, head_map,
        scale * LOG2E, q_len_max, kv_len_max, last, chunk, first, step, served,
        *sq, *sk, *sv,
        *part_o.stride()[:4], *part_l.stride()[:3],
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=block_m, TILE_N=tile_n, VARLEN=varlen, DOT_F32=dot_f32(q.dtype), STRIDED=strided is not None, **config,
    )
    return merge_partials(part_o, part_l, dim=0)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Streaming (sink + window) rows from ``stream_index`` and dense last rows; shapes as block_sparse."""
    out, lse = block_sparse_attention(q, k, v, stream_index, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    tail_o, tail_l = tail_attention(q, k, v, last, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if cu_seqlens_q is None:
        rows = min(last, q.shape[2])
        out[:, :, -rows:] = tail_o[:, :, :rows].to(out.dtype)
        lse[:, :, -rows:] = tail_l[:, :, :rows]
        return out, lse
    # Varlen: token t of the packed tensor that is row r of sequence b's tail.
    ends = cu_seqlens_q[1:].long()
    tails = torch.clamp(cu_seqlens_q.diff().long(), max=last)
    r = torch.arange(last, device=q.device)
    tokens = ends[:, None] - tails[:, None] + r[None, :]
    valid = r[None, :] < tails[:, None]
    b_idx, r_idx = valid.nonzero(as_tuple=True)
    tok = tokens[b_idx, r_idx]
    out[tok] = tail_o[b_idx, :, r_idx].to(out.dtype)
    lse[:, tok] = tail_l[b_idx, :, r_idx].transpose(0, 1)
    return out, lse
