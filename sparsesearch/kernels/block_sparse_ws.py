"""Persistent, warp-specialized block-sparse attention forward for Hopper (Gluon).

Same contract as block_sparse.py's plain path (full + partial key-block lists of a kv-space BlockIndex, GQA,
dense [B, H, N, D] layouts, bottom-right causal alignment), built the way FlashAttention-3 is built, because
the Triton kernel's loss at low density is per program, not per tile (benchmarks/program_cost.py, Run 12):
each of its programs loads Q, walks ~14 key tiles and stores O with nothing else in flight, about 4.5 SDPA
tiles of fixed cost at 32K.

Here one CTA per SM walks a list of work items (PACK heads of one GQA group x 64 query rows):
- a 1-warp producer partition issues TMA loads: the next item's Q into the second Q buffer while the current
  item still runs, and the K/V tiles of every item into a STAGES-deep ring, across item boundaries, so the
  first tiles of the next item are in shared memory before the current one's epilogue;
- PACK consumer partitions (one warpgroup each: one head's 64 rows) run QK^T and PV on wgmma, the online
  softmax in registers (P never leaves them) and the causal mask only on partial tiles; O leaves through an
  asynchronous TMA store that overlaps the next item.
Q and O go through 3D descriptors ([B*H, N, D], [1, 64, D] boxes): rows past N read as zeros and stores past N
are dropped by the TMA unit, so they need no row masks. K/V go through 2D ones ([B*H*N, D], [64, D] boxes); a
box past the last key reads the next head's rows or zeros, which only a partial block's masked columns hold.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..index import BlockIndex
from ._common import LOG2E, index_strides

# Gluon renamed its TMA copies (triton 3.6 on the GPU hosts: async_copy_*; 3.9 here: async_load/async_store, the
# old names raise): take whichever this triton has.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

TILE = 64  # query rows per head and keys per tile: the index's block size
BLOCK = gl.constexpr(TILE)  # the same, readable inside the kernels


@gluon.jit
def _item(w, n_qb, packs_per_batch, PACK: gl.constexpr, GROUP: gl.constexpr):
    """Work item w -> (batch, first query head, its KV head, query block): query blocks run fastest, heaviest
    (last) first. PACK divides GROUP, so the item's heads share the KV head."""
    hp = w // n_qb
    h0 = (hp % packs_per_batch) * PACK
    return hp // packs_per_batch, h0, h0 // GROUP, n_qb - 1 - w % n_qb


@gluon.jit
def _stream_block(f_base, p_base, n_full, e):
    """Key block of entry e of a row's stream: its full blocks, then its partial ones."""
    if e < n_full:
        entry = gl.load(f_base + e)
    else:
        entry = gl.load(p_base + (e - n_full))
    return entry


@gluon.jit
def _scores(qk, t, n_full, total, p_base, pos, offs_c, kv_len, qk_scale, PAIR: gl.constexpr):
    """Scaled scores of tile t [64, PAIR * 64]; a tile holding a partial block or running past the row's last
    block gets its mask (causal in bottom-right positions, kv bound), the others none."""
    qk = qk * qk_scale
    if (t + 1) * PAIR > n_full:
        e = t * PAIR + offs_c // BLOCK  # each column's entry in the row's stream
        is_part = (e >= n_full) & (e < total)
        blk = gl.load(p_base + (e - n_full), mask=is_part, other=0)
        cols = blk * BLOCK + offs_c % BLOCK
        part_ok = is_part[None, :] & (cols[None, :] <= pos[:, None]) & (cols[None, :] < kv_len)
        qk = gl.where((e < n_full)[None, :] | part_ok, qk, float("-inf"))
    return qk


@gluon.jit
def _softmax(qk, m_i, l_i):
    """Online softmax step in log2 units: (p, m, l, alpha), alpha rescaling what was accumulated before."""
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    # A row with nothing admitted yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
              FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, n_items, n_qb, packs_per_batch, kv_heads, q_heads, kv_len,
              s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm,
              PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr):
    tile = 0
    it = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h0, kv_h, m_block = _item(w, n_qb, packs_per_batch, PACK, GROUP)
        qb = it % 2
        # Q buffer qb was last read by item it - 2: wait for the consumers to release it.
        mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
        mbarrier.expect(q_ready.index(qb), PACK * q_desc.block_type.nbytes)
        for p in gl.static_range(PACK):
            _tma_load(q_desc, [b * q_heads + h0 + p, m_block * BLOCK, 0], q_ready.index(qb), q_smem.index(qb * PACK + p))
        c_off = b * s_cb + kv_h * s_ch + m_block * s_cm
        n_full = gl.load(FULL_CNT + c_off)
        n_part = gl.load(PART_CNT + c_off)
        f_base = FULL_IDX + b * s_fb + kv_h * s_fh + m_block * s_fm
        p_base = PART_IDX + b * s_pb + kv_h * s_ph + m_block * s_pm
        row0 = (b * kv_heads + kv_h) * kv_len  # the KV head's first row in [B * Hkv * N, D]
        total = n_full + n_part
        for j in range(gl.cdiv(total, PAIR)):
            s = tile % STAGES
            mbarrier.wait(kv_empty.index(s), ((tile // STAGES) & 1) ^ 1, pred=tile >= STAGES)
            bar = kv_ready.index(s)
            mbarrier.expect(bar, 2 * PAIR * k_desc.block_type.nbytes)
            for i in gl.static_range(PAIR):
                # A missing last block of the pair re-reads the one before (the consumer masks it): the stage
                # never holds uninitialised shared memory, whose NaN patterns would survive p = 0.
                entry = _stream_block(f_base, p_base, n_full, gl.minimum(j * PAIR + i, total - 1))
                r = row0 + entry * BLOCK
                _tma_load(k_desc, [r, 0], bar, k_smem.index(s).slice(i * BLOCK, BLOCK))
                _tma_load(v_desc, [r, 0], bar, v_smem.index(s).slice(i * BLOCK, BLOCK))
            tile += 1
        it += 1


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, kv_ready, kv_empty, LSE,
              PART_CNT, FULL_CNT, PART_IDX, n_items, n_qb, packs_per_batch, q_heads, q_len, kv_len,
              qk_scale, s_cb, s_ch, s_cm, s_pb, s_ph, s_pm,
              HEAD_DIM: gl.constexpr, PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
              PAIR: gl.constexpr, HEAD: gl.constexpr):
    """One warpgroup: head h0 + HEAD of every item, its 64 rows, against key tiles of PAIR blocks. The heads'
    warpgroups run unsynchronised, so one's softmax overlaps the other's tensor-core work."""
    TILE_N: gl.constexpr = PAIR * BLOCK
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_r = gl.arange(0, BLOCK, layout=row_s)
    offs_c = gl.arange(0, TILE_N, layout=col_s)
    zero_s = gl.zeros([BLOCK, TILE_N], gl.float32, s_layout)
    tile = 0
    it = 0
    for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
        b, h0, kv_h, m_block = _item(w, n_qb, packs_per_batch, PACK, GROUP)
        h = h0 + HEAD
        c_off = b * s_cb + kv_h * s_ch + m_block * s_cm
        n_full = gl.load(FULL_CNT + c_off)
        total = n_full + gl.load(PART_CNT + c_off)
        p_base = PART_IDX + b * s_pb + kv_h * s_ph + m_block * s_pm
        rows = m_block * BLOCK + offs_r
        pos = rows + (kv_len - q_len)  # each row's frontier among the keys (bottom-right alignment)
        qb = it % 2
        mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
        q = q_smem.index(qb * PACK + HEAD).reshape([BLOCK, HEAD_DIM])
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK], gl.float32, row_s)
        acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
        n_tiles = gl.cdiv(total, PAIR)
        if n_tiles > 0:
            # Tile 0 alone; then each step issues QK of tile t and PV of tile t - 1 together and runs tile t's
            # softmax while that PV is on the tensor cores (FlashAttention-3's intra-warpgroup overlap).
            s = tile % STAGES
            mbarrier.wait(kv_ready.index(s), (tile // STAGES) & 1)
            qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk,))
            qk = _scores(qk, 0, n_full, total, p_base, pos, offs_c, kv_len, qk_scale, PAIR)
            p, m_i, l_i, alpha = _softmax(qk, m_i, l_i)
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
            s_prev = s
            tile += 1
            for t in range(1, n_tiles):
                s = tile % STAGES
                mbarrier.wait(kv_ready.index(s), (tile // STAGES) & 1)
                qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                pv = warpgroup_mma(p_op, v_smem.index(s_prev), acc, is_async=True)
                qk = warpgroup_mma_wait(1, deps=(qk,))  # groups retire in order: the scores, not yet PV
                qk = _scores(qk, t, n_full, total, p_base, pos, offs_c, kv_len, qk_scale, PAIR)
                p, m_i, l_i, alpha = _softmax(qk, m_i, l_i)
                p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
                acc = warpgroup_mma_wait(0, deps=(pv,))
                mbarrier.arrive(kv_empty.index(s_prev), count=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                s_prev = s
                tile += 1
            pv = warpgroup_mma(p_op, v_smem.index(s_prev), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(pv,))
            mbarrier.arrive(kv_empty.index(s_prev), count=1)
        mbarrier.arrive(q_empty.index(qb), count=1)
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        o_buf = o_smem.index(HEAD)
        # This warpgroup's previous O store must have left its buffer before it is overwritten.
        tma.store_wait(0)
        o_buf.reshape([BLOCK, HEAD_DIM]).store(out.to(o_smem.dtype))
        fence_async_shared()
        _tma_store(o_desc, [b * q_heads + h, m_block * BLOCK, 0], o_buf)
        # lse in natural log; rows past q_len are not stored.
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(LSE + (b * q_heads + h).to(gl.int64) * q_len + rows, lse, mask=rows < q_len)
        it += 1
    tma.store_wait(0)


@gluon.jit
def _block_sparse_ws_fwd(q_desc, k_desc, v_desc, o_desc, LSE, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX,
                         n_items, n_qb, packs_per_batch, kv_heads, q_heads, q_len, kv_len, qk_scale,
                         s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm,
                         HEAD_DIM: gl.constexpr, PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                         PAIR: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * PACK] + q_desc.block_type.shape, q_desc.layout)  # 2 items x PACK heads
    # A stage holds PAIR key blocks as one [PAIR * 64, D] tile (same 128-byte swizzle as the 64-row boxes).
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, PAIR * BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, PAIR * BLOCK, HEAD_DIM], v_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [PACK] + o_desc.block_type.shape, o_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Every consumer warpgroup releases each Q buffer and K/V stage once.
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=PACK)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=PACK)
    gl.warp_specialize([
        (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, kv_ready, kv_empty, LSE,
                     PART_CNT, FULL_CNT, PART_IDX, n_items, n_qb, packs_per_batch, q_heads, q_len, kv_len,
                     qk_scale, s_cb, s_ch, s_cm, s_pb, s_ph, s_pm, HEAD_DIM, PACK, GROUP, STAGES, PAIR, 0)),
        (_consumer, (o_desc, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, kv_ready, kv_empty, LSE,
                     PART_CNT, FULL_CNT, PART_IDX, n_items, n_qb, packs_per_batch, q_heads, q_len, kv_len,
                     qk_scale, s_cb, s_ch, s_cm, s_pb, s_ph, s_pm, HEAD_DIM, PACK, GROUP, STAGES, PAIR, 1)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
                     FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, n_items, n_qb, packs_per_batch, kv_heads, q_heads, kv_len,
                     s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm, PACK, GROUP, STAGES, PAIR)),
    ], [4, 1], [CONSUMER_REGS, 40])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(flat: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """A TMA descriptor over all of ``flat`` with ``box``-shaped tiles in the default swizzled layout."""
    layout = gl.NVMMASharedLayout.get_default_for(box, _GL_DTYPES[flat.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, layout)


def _head_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """[B, H, N, D] contiguous as [B*H, N, D] with [1, 64, D] boxes (Q and O; module docstring)."""
    b, h, n, d = t.shape
    return _descriptor(t.view(b * h, n, d), [1, TILE, d])


def _row_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """[B, H, N, D] contiguous as [B*H*N, D] with [64, D] boxes (K and V; module docstring)."""
    return _descriptor(t.view(-1, t.shape[-1]), [TILE, t.shape[-1]])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def ws_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex) -> bool:
    """Whether this kernel can run the launch (on a Hopper GPU, which the caller checks): dense contiguous
    bf16/fp16 on CUDA, d 64/128, 64-blocks, a kv-space index with only full and partial lists (no columns,
    table, window or sink), GQA groups of 2 or more."""
    return q.is_cuda and ws_shapes_fit(q, k, v, index)


def ws_shapes_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex) -> bool:
    """ws_eligible less the device: layouts, dtypes, head dim, block size and the index's contents."""
    if q.dim() != 4 or q.dtype not in _GL_DTYPES or not all(t.is_contiguous() and t.dtype == q.dtype for t in (q, k, v)):
        return False
    if any(t.data_ptr() % 16 for t in (q, k, v)):  # TMA descriptors need 16-byte aligned bases
        return False
    if q.shape[-1] not in (64, 128) or index.block_m != TILE or index.block_n != TILE or index.head_space != "kv":
        return False
    if index.col_count is not None or index.col_table is not None or index.window != -1 or index.sink:
        return False
    group = q.shape[1] // k.shape[1]
    return group % 2 == 0


def block_sparse_ws_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *,
                              scale: float, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                              stages: int = 3, pair: int = 1, consumer_regs: int = 232) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hq, Nq, D] like q, lse fp32 [B, Hq, Nq] (written into out/lse when given, contiguous): the plain
    path of block_sparse_attention. ws_eligible says what it takes; the caller has checked the index
    (block_sparse.check_index).
    stages: K/V ring depth; pair: key blocks per tile (1 or 2; 2 fits 2 stages of shared memory at d=128).
    H200, 32K, block top-k: 1 block x 3 stages ran 4-10% faster than 2 x 2 (benchmarks/RESULTS.md, Run 15)."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    pack = 2
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device) if lse is None else lse
    n_qb = triton.cdiv(q_len, TILE)
    packs = q_heads // pack
    n_items = batch * packs * n_qb
    grid = (min(n_items, _sm_count(q.device)),)
    # Both counts are read with full_count's strides: check_index has made sure the counts share them.
    _block_sparse_ws_fwd[grid](
        _head_descriptor(q), _row_descriptor(k), _row_descriptor(v), _head_descriptor(out), lse,
        index.full_count, index.full_idx, index.partial_count, index.partial_idx,
        n_items, n_qb, packs, kv_heads, q_heads, q_len, kv_len, scale * LOG2E,
        *index_strides(index.full_count), *index_strides(index.full_idx), *index_strides(index.partial_idx),
        HEAD_DIM=head_dim, PACK=pack, GROUP=q_heads // kv_heads, STAGES=stages, PAIR=pair,
        CONSUMER_REGS=consumer_regs, num_warps=4,
    )
    return out, lse
