"""Section sums of the TriangleMix probe gradient ∂y/∂θ_ij = P_ij · (dO_i · V_j) (Triton).

One program takes one query block of one (batch, query head) and walks its causal key blocks. Per tile
it recomputes P = exp(q·kᵀ·scale − lse) from the dense pass's lse, forms G = dO·Vᵀ, D = P·G, and adds the
row sums of D, |D| and P over the STREAM and MIDDLE key masks into fp32 row accumulators. LAST is a
whole-row section, so at the end the rows i >= N − last move both their sums to LAST. Each program
writes its 3 x 3 partials (quantity grad/|grad|/prob x section) to [B, Hq, QB, 3, 3]; the launcher sums
over QB in float64 — no atomics. K and V are read through the query head's KV head (GQA), never repeated.

Layout: dense q, do [B, Hq, N, D]; k, v [B, Hkv, N, D] (prefill, N queries = N keys); any strides with
a contiguous last dim; lse [B, Hq, N] natural log.

Sections, by plain ints (0-based query row i, key j <= i): LAST = rows i >= N - last; of the other rows,
STREAM = keys j < sink or i - j < window, MIDDLE = the rest. The probe (sparsesearch/probe/sections.py)
names them, counts their entries and holds the torch twin this kernel is tested against.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..index import num_blocks
from ._common import LOG2E, block_d, check_qkv, dot_f32, interpreting, load_kv_tile


def check_section_inputs(q, k, v, do, lse) -> None:
    """Raise ValueError for inputs no section-sum path takes (dtypes beyond float are the caller's rule)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, N, D] tensor, got {getattr(t, 'shape', type(t))}")
        if not t.is_floating_point():
            raise ValueError(f"{name} dtype must be floating, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty: shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, length (prefill) and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if do.shape != q.shape:
        raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must be [B, Hq, N] = {tuple(q.shape[:3])}, got {getattr(lse, 'shape', type(lse))}")
    if not lse.is_floating_point() or lse.device != q.device:
        raise ValueError(f"lse must be a floating tensor on {q.device}, got {lse.dtype} on {lse.device}")
    if not bool(torch.isfinite(lse).all()):
        raise ValueError("lse has non-finite entries; pass the natural-log lse of a dense causal pass")


@triton.jit
def _tile_sums(
    q, do, lse2, offs_m, row_ok, start, offs_n, offs_d, k_base, v_base, stride_kn, stride_vn,
    qk_scale, seq_len, sink, window,
    g_stream, g_middle, a_stream, a_middle, p_stream, p_middle,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, G_F32: tl.constexpr,
    QK_PRECISION: tl.constexpr, G_PRECISION: tl.constexpr,
):
    """Add one key tile's row sums of D = P·(dO·Vᵀ), |D| and P to the STREAM / MIDDLE accumulators.

    MASKED=False is for interior tiles (every row in range, every key causal and MIDDLE for every row):
    no mask at all. MASKED=True applies the causal/bounds mask and splits by the STREAM key mask.
    """
    cols = start + offs_n
    col_ok = cols < seq_len
    # 64-bit offsets: at 1M tokens in a [B, N, H, D] layout, col * stride passes 2^31.
    cols64 = cols.to(tl.int64)
    kt = load_kv_tile(k_base, cols64, stride_kn, offs_d, col_ok, HEAD_DIM, BLOCK_D, MASKED, True)
    vt = load_kv_tile(v_base, cols64, stride_vn, offs_d, col_ok, HEAD_DIM, BLOCK_D, MASKED, True)
    if DOT_F32:
        kt = kt.to(tl.float32)
    if G_F32:
        vt = vt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=QK_PRECISION) * qk_scale
    g = tl.dot(do, vt, input_precision=G_PRECISION)
    if MASKED:
        # cols <= rows < seq_len also bounds the columns.
        ok = (cols[None, :] <= offs_m[:, None]) & row_ok[:, None]
        p = tl.where(ok, tl.math.exp2(s - lse2[:, None]), 0.0)
        d = p * g
        ad = tl.abs(d)
        stream = (cols[None, :] < sink) | ((offs_m[:, None] - cols[None, :]) < window)
        g_stream += tl.sum(tl.where(stream, d, 0.0), 1)
        g_middle += tl.sum(tl.where(stream, 0.0, d), 1)
        a_stream += tl.sum(tl.where(stream, ad, 0.0), 1)
        a_middle += tl.sum(tl.where(stream, 0.0, ad), 1)
        p_stream += tl.sum(tl.where(stream, p, 0.0), 1)
        p_middle += tl.sum(tl.where(stream, 0.0, p), 1)
    else:
        p = tl.math.exp2(s - lse2[:, None])
        d = p * g
        g_middle += tl.sum(d, 1)
        a_middle += tl.sum(tl.abs(d), 1)
        p_middle += tl.sum(p, 1)
    return g_stream, g_middle, a_stream, a_middle, p_stream, p_middle


@triton.jit
def _section_sums_kernel(
    Q, K, V, DO, LSE, PART,
    qk_scale, seq_len, sink, window, last_start, heads,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dn,
    stride_lb, stride_lh, stride_ln,
    stride_pb, stride_ph, stride_pm,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, G_F32: tl.constexpr,
    QK_PRECISION: tl.constexpr, G_PRECISION: tl.constexpr,
):
    # Last query blocks first: they walk the most key blocks.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    kv_h = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_len
    rows64 = offs_m.to(tl.int64)
    row_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows64[:, None] * stride_qn + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + rows64[:, None] * stride_dn + offs_d[None, :], mask=row_mask, other=0.0)
    lse2 = tl.load(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + rows64 * stride_ln, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    if DOT_F32:
        q = q.to(tl.float32)
    if G_F32:
        do = do.to(tl.float32)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    g_stream = tl.zeros([BLOCK_M], dtype=tl.float32)
    g_middle = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_stream = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_middle = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_stream = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_middle = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Key tiles [0, t_lo) and [t_hi, t_end) are masked; [t_lo, t_hi) are interior: cols >= sink and
    # row - col >= window for every row, all rows in range (the last LAST rows are re-assigned below).
    m0 = m_block * BLOCK_M
    t_end = tl.cdiv(tl.minimum(m0 + BLOCK_M, seq_len), BLOCK_N)
    t_lo = tl.minimum(tl.cdiv(sink, BLOCK_N), t_end)
    t_hi = tl.maximum(tl.minimum((m0 - window + 1) // BLOCK_N, t_end), t_lo)
    if m0 + BLOCK_M > seq_len:
        t_hi = t_lo
    for t in range(0, t_lo):
        g_stream, g_middle, a_stream, a_middle, p_stream, p_middle = _tile_sums(
            q, do, lse2, offs_m, row_ok, t * BLOCK_N, offs_n, offs_d, k_base, v_base, stride_kn, stride_vn,
            qk_scale, seq_len, sink, window, g_stream, g_middle, a_stream, a_middle, p_stream, p_middle,
            True, HEAD_DIM, BLOCK_D, DOT_F32, G_F32, QK_PRECISION, G_PRECISION)
    for t in range(t_lo, t_hi):
        g_stream, g_middle, a_stream, a_middle, p_stream, p_middle = _tile_sums(
            q, do, lse2, offs_m, row_ok, t * BLOCK_N, offs_n, offs_d, k_base, v_base, stride_kn, stride_vn,
            qk_scale, seq_len, sink, window, g_stream, g_middle, a_stream, a_middle, p_stream, p_middle,
            False, HEAD_DIM, BLOCK_D, DOT_F32, G_F32, QK_PRECISION, G_PRECISION)
    for t in range(t_hi, t_end):
        g_stream, g_middle, a_stream, a_middle, p_stream, p_middle = _tile_sums(
            q, do, lse2, offs_m, row_ok, t * BLOCK_N, offs_n, offs_d, k_base, v_base, stride_kn, stride_vn,
            qk_scale, seq_len, sink, window, g_stream, g_middle, a_stream, a_middle, p_stream, p_middle,
            True, HEAD_DIM, BLOCK_D, DOT_F32, G_F32, QK_PRECISION, G_PRECISION)

    # LAST rows own every causal key of the row.
    is_last = offs_m >= last_start
    base = PART + b * stride_pb + h * stride_ph + m_block * stride_pm
    tl.store(base + 0, tl.sum(tl.where(is_last, 0.0, g_stream), 0))
    tl.store(base + 1, tl.sum(tl.where(is_last, 0.0, g_middle), 0))
    tl.store(base + 2, tl.sum(tl.where(is_last, g_stream + g_middle, 0.0), 0))
    tl.store(base + 3, tl.sum(tl.where(is_last, 0.0, a_stream), 0))
    tl.store(base + 4, tl.sum(tl.where(is_last, 0.0, a_middle), 0))
    tl.store(base + 5, tl.sum(tl.where(is_last, a_stream + a_middle, 0.0), 0))
    tl.store(base + 6, tl.sum(tl.where(is_last, 0.0, p_stream), 0))
    tl.store(base + 7, tl.sum(tl.where(is_last, 0.0, p_middle), 0))
    tl.store(base + 8, tl.sum(tl.where(is_last, p_stream + p_middle, 0.0), 0))


def _launch_config(head_dim: int, f32: bool) -> dict:
    """Tiles and pipelining; one small fixed choice under the CPU interpreter.

    q and dO tiles stay resident while K and Vᵀ tiles stream. Measured on an H200 (d=128, 32 query /
    8 KV heads): bf16 64 x 64, 4 warps, 2 stages gives 416 TFLOP/s at 32K, 1.4x the time of a causal
    SDPA forward. fp32 operands (fp32 inputs or dO; 3-pass TF32 dots) need about twice the shared memory:
    one stage (64 x 64 beat 64 x 32 and 32 x 32 by 1.2-2x at 4K and 16K).
    """
    if interpreting():
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if f32:
        wide = head_dim <= 128
        return {"BLOCK_M": 64 if wide else 32, "BLOCK_N": 64 if wide else 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 2}


def section_grad_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    sink: int,
    window: int,
    last: int,
    *,
    scale: float | None = None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (batch, query head) section sums of ∂y/∂θ = P·(dO·V), |∂y/∂θ| and P (Triton).

    q, do [B, Hq, N, D]; k, v [B, Hkv, N, D] (fp16/bf16/fp32, q/k/v one dtype, do any of the three);
    lse [B, Hq, N] natural log of the dense causal pass (any float dtype, read as fp32); sink >= 0,
    window >= 1, last >= 1 place the sections (module docstring). Returns (grad, abs_grad, prob), each
    float64 [B, Hq, 3] over (STREAM, MIDDLE, LAST). Sums are accumulated in fp32 per program and reduced
    in float64. fp32 dot operands use 3-pass TF32 on the GPU (about fp32 accuracy); an fp32 dO next to
    half-precision q/k/v therefore runs several times slower than a dO in the model's dtype.
    config: BLOCK_M, BLOCK_N, num_warps, num_stages overrides.
    """
    check_section_inputs(q, k, v, do, lse)
    check_qkv(q, k, v, varlen=False)
    if do.dtype not in (torch.float16, torch.bfloat16, torch.float32) or do.stride(-1) != 1:
        raise ValueError(f"do must be float16/bfloat16/float32 with a contiguous head_dim, got {do.dtype}, stride {do.stride(-1)}")
    for name, value, low in (("sink", sink, 0), ("window", window, 1), ("last", last, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    batch, q_heads, n, dim = q.shape
    kv_heads = k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    cfg = dict(_launch_config(dim, torch.float32 in (q.dtype, do.dtype)), **(config or {}))
    q_blocks = num_blocks(n, cfg["BLOCK_M"])
    part = torch.zeros(batch, q_heads, q_blocks, 3, 3, dtype=torch.float32, device=q.device)
    # Clamp the sections into int32 range: only comparisons against 0 <= i, j < n matter.
    sink, window, last_start = min(sink, n), min(window, n + 1), max(n - last, 0)
    # fp32 operands (fp32 inputs, or an fp32 dO) take 3-pass TF32: plain TF32 costs ~1e-3 relative error,
    # IEEE fp32 gives up the tensor cores. Half-precision operands ignore it (the interpreter does too).
    g_f32 = dot_f32(q.dtype) or do.dtype != v.dtype
    qk_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    g_precision = "tf32x3" if v.dtype == torch.float32 or do.dtype != v.dtype else "tf32"
    grid = (q_blocks, batch * q_heads)
    _section_sums_kernel[grid](
        q, k, v, do, lse, part,
        scale * LOG2E, n, sink, window, last_start, q_heads,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride(), *part.stride()[:3],
        GROUP=q_heads // kv_heads, HEAD_DIM=dim, BLOCK_D=block_d(dim),
        DOT_F32=dot_f32(q.dtype), G_F32=g_f32, QK_PRECISION=qk_precision, G_PRECISION=g_precision,
        **cfg,
    )
    sums = part.double().sum(2)  # [B, Hq, 3 quantities, 3 sections]
    return sums[:, :, 0].contiguous(), sums[:, :, 1].contiguous(), sums[:, :, 2].contiguous()
