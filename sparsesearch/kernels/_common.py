"""Shared pieces of the attention kernels: the online-softmax tile update, input checks, launch configs.

Nothing here queries CUDA at import time, so the module imports (and the kernels run under
TRITON_INTERPRET=1) on a machine without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..index import GridLines, RegionMaps

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def load_kv_tile(base, cols, stride_n, offs_d, col_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows `cols` of a [N, D] slab: [BLOCK_D, len(cols)] when TRANSPOSED (K^T), else [len(cols), BLOCK_D].

    Masks are built only where needed: MASKED for column bounds, BLOCK_D > HEAD_DIM for padded dims.
    """
    if TRANSPOSED:
        ptrs = base + cols[None, :] * stride_n + offs_d[:, None]
        col_mask = col_ok[None, :]
        dim_mask = offs_d[:, None] < HEAD_DIM
    else:
        ptrs = base + cols[:, None] * stride_n + offs_d[None, :]
        col_mask = col_ok[:, None]
        dim_mask = offs_d[None, :] < HEAD_DIM
    if MASKED:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=col_mask, other=0.0)
        else:
            tile = tl.load(ptrs, mask=col_mask & dim_mask, other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=dim_mask, other=0.0)
    return tile


@triton.jit
def online_update(q, kt, v, ok, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """One flash-attention step over a key tile.

    q [BM, BD], kt [BD, BN], v [BN, BD], ok bool [BM, BN] (ignored unless MASKED);
    m_i, l_i [BM] fp32 in log2 units; acc [BM, BD] fp32. Returns the updated (m_i, l_i, acc).
    DOT_F32 upcasts the dot operands: only for bf16 under TRITON_INTERPRET=1, whose bf16 tl.dot
    returns garbage in triton 3.9 (conversions are right, the product is not).
    """
    if DOT_F32:
        q = q.to(tl.float32)
        kt = kt.to(tl.float32)
    qk = tl.dot(q, kt) * qk_scale
    if MASKED:
        qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row with nothing admitted so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = m_new
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def index_strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, head, query-block) strides of an index count or list tensor, (0, 0, 0) for None; ValueError
    unless the last dim is contiguous (the kernels read a row of a list with unit stride)."""
    if t is None:
        return (0, 0, 0)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"index lists must be contiguous in their last dim, got stride {t.stride(-1)}")
    return t.stride(0), t.stride(1), t.stride(2)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool, region: bool = False) -> None:
    """Raise ValueError (before any launch) for shapes, dtypes or devices the kernels do not take.
    region: a permuted modality region (row_pos given) may have more query rows than keys."""
    want = 3 if varlen else 4
    layout = "[T, H, D] (varlen)" if varlen else "[B, H, N, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be one of float16/bfloat16/float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got stride {t.stride(-1)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k head_dim {k.shape[-1]} differs from q head_dim {head_dim}")
    head_axis = 1
    q_heads, kv_heads = q.shape[head_axis], k.shape[head_axis]
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} differs from k batch {k.shape[0]}")
    if not varlen and not region and q.shape[2] > k.shape[2]:
        raise ValueError(f"q length {q.shape[2]} exceeds kv length {k.shape[2]} (queries are bottom-right aligned)")


def check_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, device: torch.device) -> tuple[int, int]:
    """Validate cumulative sequence lengths; return (max q length, max kv length)."""
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D with batch+1 entries, got shape {tuple(cu.shape)}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {cu.dtype}")
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device}, q on {device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel()} entries, cu_seqlens_k {cu_k.numel()}")
    lq, lk = cu_q.diff().cpu(), cu_k.diff().cpu()
    if int(cu_q[0]) != 0 or int(cu_k[0]) != 0:
        raise ValueError("cu_seqlens must start at 0")
    if bool((lq < 0).any()) or bool((lk < 0).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got q {cu_q.tolist()} k {cu_k.tolist()}")
    if int(cu_q[-1]) != total_q or int(cu_k[-1]) != total_k:
        raise ValueError(f"cu_seqlens end at q {int(cu_q[-1])} / k {int(cu_k[-1])}, tensors hold {total_q} / {total_k} tokens")
    if bool((lq > lk).any()):
        raise ValueError(f"a sequence has more queries than keys: q lengths {lq.tolist()}, kv lengths {lk.tolist()}")
    return int(lq.max()), int(lk.max())


@dataclass(frozen=True)
class Layout:
    """What a launcher needs to know of checked dense ([B, H, N, D]) or varlen ([T, H, D]) inputs.

    cu_q / cu_k are the cu_seqlens for varlen, or int32 placeholders the kernel never reads (VARLEN False).
    """

    varlen: bool
    batch: int
    q_heads: int
    kv_heads: int
    q_len_max: int
    kv_len_max: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def check_row_pos(q: torch.Tensor, k: torch.Tensor, row_pos: torch.Tensor | None) -> None:
    """A permuted region's frame for dense q [B, Hq, Nq, D], k [B, Hkv, Nk, D]: on q's device, int [Nq],
    nondecreasing, within [-1, Nk - 1] (patterns._common.check_frame). None passes."""
    if row_pos is None:
        return
    if row_pos.device != q.device:
        raise ValueError(f"row_pos is on {row_pos.device}, q on {q.device}")
    from ..patterns._common import check_frame

    check_frame(q.shape[2], k.shape[2], row_pos)


def check_layout(q, k, v, cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, row_pos: torch.Tensor | None = None) -> Layout:
    """Validate q/k/v (and cu_seqlens when either is given, row_pos when given) before any launch;
    ValueError names the problem. row_pos (a permuted region's frame, dense layout only): int64 [Nq] on q's
    device, nondecreasing, in [-1, Nk - 1]."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if row_pos is not None and varlen:
        raise ValueError("row_pos (a permuted region) takes the dense [B, H, N, D] layout, not cu_seqlens")
    check_row_pos(q, k, row_pos)
    check_qkv(q, k, v, varlen, region=row_pos is not None)
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        q_len_max, kv_len_max = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], q.device)
        return Layout(True, cu_seqlens_q.numel() - 1, q.shape[1], k.shape[1], q_len_max, kv_len_max, cu_seqlens_q, cu_seqlens_k)
    placeholder = _placeholder(q.device)
    return Layout(False, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], placeholder, placeholder)


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """A never-read int32 pointer argument for the dense layout's cu_seqlens slots, one per device: a fresh
    one per call was a fill launch per call (measured as host time on an H200 at 4K)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def bhn_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, token) strides as the kernels address them; varlen tensors [T, H, D] have batch
    stride 0 (each sequence's start comes from cu_seqlens)."""
    return (0, t.stride(1), t.stride(0)) if varlen else tuple(t.stride()[:3])


def dot_f32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast dot operands (interpreter bf16 bug, see online_update)."""
    return interpreting() and dtype == torch.bfloat16


def block_d(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)


DEFAULT_SMS = 132  # H100 SXM; used to size splits when no CUDA device is visible


@functools.cache
def sm_count(index: int = 0) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (DEFAULT_SMS without a GPU); read once per device."""
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else DEFAULT_SMS


def fill_splits(programs: int, most: int, sms: int) -> int:
    """Splits of each program's work so that programs x splits give every SM about two programs (a small
    launch would leave most SMs idle), at least 1 and at most ``most``."""
    return max(1, min(most, math.ceil(2 * sms / max(1, programs))))


def group_rows(group: int) -> int:
    """Rows a GQA group's query heads take in a ``tl.dot`` tile: the next power of two, at least 16 (the
    smallest tile side)."""
    return max(16, triton.next_power_of_2(group))


def _check_map(name: str, m: torch.Tensor, size: int) -> bool:
    """Check a row/column map's values: distinct, in [0, size). Returns whether it is strictly increasing."""
    lo, hi = int(m.min()), int(m.max())
    if lo < 0 or hi >= size:
        raise ValueError(f"{name} values must lie in [0, {size - 1}], got [{lo}, {hi}]")
    if torch.unique(m).numel() != m.numel():
        raise ValueError(f"{name} must not repeat a position ({m.numel()} entries, {torch.unique(m).numel()} distinct)")
    return m.numel() == 1 or bool((m[1:] > m[:-1]).all())


def region_maps(row_map: torch.Tensor | None, col_map: torch.Tensor | None, row_pos: torch.Tensor | None,
                q_len: int, kv_len: int) -> RegionMaps:
    """RegionMaps from maps of any origin, every value checked (a few device syncs, once): row_map int32
    [Nq_r] into q's q_len rows, col_map int32 [Nk_r] into k's kv_len rows, each distinct and in range;
    row_pos, when given, the region frame over [Nq_r] x [Nk_r] (patterns/_common.check_frame). ValueError
    names the bad value."""
    maps = RegionMaps(row_map, col_map, row_pos, q_len, kv_len)
    if row_map is not None:
        _check_map("row_map", row_map, q_len)
    increasing = col_map is not None and _check_map("col_map", col_map, kv_len)
    if row_pos is not None:
        from ..patterns._common import check_frame

        check_frame(maps.rows, maps.keys, row_pos)
    return dataclasses.replace(maps, increasing=increasing)


def check_region_maps(q: torch.Tensor, k: torch.Tensor, maps: RegionMaps | None, row_pos: torch.Tensor | None,
                      varlen: bool) -> None:
    """Check that maps fit these inputs (dense q [B, Hq, Nq, D], k [B, Hkv, Nk, D]) without reading their
    values (RegionMaps were checked when made): no device sync."""
    if maps is None:
        return
    if varlen:
        raise ValueError("region maps (a permutation read in place) take the dense [B, H, N, D] layout, not cu_seqlens")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, N, D] with region maps, got {tuple(q.shape)} and {tuple(k.shape)}")
    if row_pos is not None:
        raise ValueError("row_pos comes with the region maps (RegionMaps.row_pos); pass one or the other")
    if (maps.q_len, maps.kv_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"region maps index {maps.q_len} queries x {maps.kv_len} keys, inputs have {q.shape[2]} x {k.shape[2]}")
    if maps.device != q.device or (maps.row_pos is not None and maps.row_pos.device != q.device):
        raise ValueError(f"region maps are on {maps.device}, q on {q.device}")


def check_lines(q: torch.Tensor, k: torch.Tensor, lines: GridLines | None, q_blocks: int, maps: RegionMaps | None,
                varlen: bool) -> None:
    """Validate grid lines against the inputs before any launch (dense layout, no region maps)."""
    if lines is None:
        return
    if varlen or maps is not None:
        raise ValueError("grid lines take the dense [B, H, N, D] layout without region maps")
    if (lines.q_len, lines.kv_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"grid lines were built for {lines.q_len} queries x {lines.kv_len} keys, inputs have {q.shape[2]} x {k.shape[2]}")
    if lines.stride < 1 or not 0 <= lines.row_phase < lines.stride or not 0 <= lines.col_phase < lines.stride:
        raise ValueError(f"grid lines need stride >= 1 and phases in [0, stride), got stride {lines.stride}, "
                         f"phases {lines.row_phase}/{lines.col_phase}")
    if lines.row_lines < 0 or (lines.row_lines and lines.row_phase + lines.stride * (lines.row_lines - 1) >= lines.q_len):
        raise ValueError(f"grid lines list {lines.row_lines} line rows from {lines.row_phase} at stride {lines.stride}, past {lines.q_len} queries")
    cols = lines.line_cols
    if cols is not None and (cols.dim() != 1 or cols.dtype != torch.int32 or cols.numel() < q_blocks or cols.device != q.device):
        raise ValueError(f"grid line_cols must be int32 [query blocks] on {q.device}, got {cols.dtype} {tuple(cols.shape)} on {cols.device}")
