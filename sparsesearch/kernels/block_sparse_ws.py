"""Persistent, warp-specialized block-sparse attention forward for Hopper (Gluon).

Same contract as block_sparse.py's plain path (full + partial key-block lists of a kv-space BlockIndex with its
window/sink mask and its column table, GQA, dense [B, H, N, D] layouts, bottom-right causal alignment), built the
way FlashAttention-3 is built, because the Triton kernel's loss at low density is per program, not per tile
(benchmarks/program_cost.py, Run 12): each of its programs loads Q, walks ~14 key tiles and stores O with nothing
else in flight, about 4.5 SDPA tiles of fixed cost at 32K.

Here one CTA per SM walks work items (PACK heads of one GQA group, fewer in some of a group's items when PACK does not
divide it, x 64 query rows; PACK is 2, 3 or 4 by group, head dim and column table (_pack); with a head map, of the
KV heads the launch serves, so a layer's pattern groups each take it; MHA: two query blocks of one head, each
warpgroup on its own key list through its own half of the K/V ring), heaviest first, each CTA taking its next item
from a counter as it frees up (a static round-robin left near-dense 8K launches 0.73-0.80 balanced):
- a 1-warp producer partition issues TMA loads: the next item's Q into the second Q buffer while the current
  item still runs, and the K/V tiles of every item into a STAGES-deep ring, across item boundaries, so the
  first tiles of the next item are in shared memory before the current one's epilogue. It posts each item's
  coordinates and counts beside its Q, so the consumers cross an item boundary with no division and no global
  load, and it keeps its own global reads (the next ticket, the next item's counts, the next tile's block id)
  one step ahead, in flight while it waits for the ring;
- PACK consumer partitions (one warpgroup each: one head's 64 rows) run QK^T and PV on wgmma with both A
  operands in registers (Q loaded once per item, which frees its buffer for the next item's Q at once; P never
  leaves them), the online softmax in registers and a mask only on tiles that need one; O leaves through an
  asynchronous TMA store that overlaps the next item. Three warpgroups have 160 registers each: at d 128 or with a
  column table they read Q from shared memory, and at d 128 O leaves through each head's Q buffer, released under
  the next item's first QK, which leaves room for a 4-stage ring. Four (d 64) have 112 and read Q from shared
  memory.
A row's key tiles are its full blocks, its partial blocks, then (vertical-slash) 64-slot tiles of its column
table's span (index.ColumnTable): the table's K/V rows copied once per launch into contiguous per-head slabs
(column_slabs.py), so a tile of slots is one TMA box like a key block; tiles inside the clean run need no mask,
the rest are masked by the slots' bits and causality.
Every global tensor (Q, K, V, O, the slabs) goes through a 4D descriptor over its [B, H, N, D] strides with
[1, 1, 64, D] boxes, so the runtime's transposed [B, N, H, D] buffers are read and written in place; rows past N
read as zeros and stores past N are dropped by the TMA unit, so no row needs a mask for them.
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
from .column_slabs import column_slabs, table_operands

# Gluon renamed its TMA copies (triton 3.6 on the GPU hosts: async_copy_*; 3.9 here: async_load/async_store, the
# old names raise): take whichever this triton has.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

TILE = 64  # query rows per head, keys per tile, table slots per tile: the index's block size
BLOCK = gl.constexpr(TILE)  # the same, readable inside the kernels


@gluon.jit
def _item(w, n_qb, packs_per_batch, HEAD_MAP, PACK: gl.constexpr, GROUP: gl.constexpr, USE_HEAD_MAP: gl.constexpr):
    """Work item w -> (batch, first query head, its KV head, its index row, query block, heads in the item). A GQA
    group's heads split into ceil(GROUP / PACK) items that share its KV head, as evenly as that count allows when
    PACK does not divide GROUP (Qwen2-7B's 7 in pairs: 2 + 2 + 2 + 1; in threes: 3 + 2 + 2). A group's items of one
    query block run fastest, so they read the same key tiles at about the same time, the later ones from L2 (up to
    3.5% faster at 8K, the same at 32K-128K: H200, benchmarks/RESULTS.md, Run 24); then query blocks, heaviest (last)
    first. With a head map the launch serves a subset of KV heads: index row i is KV head HEAD_MAP[i]."""
    if GROUP == 1:
        # MHA: two query blocks of one head, m_block and m_block - 1 (one warpgroup each: its own rows, its own key
        # list); "heads" counts them, 1 where block 0 is left alone.
        n_pairs = (n_qb + 1) // 2
        m_block = n_qb - 1 - 2 * (w % n_pairs)
        hb = w // n_pairs
        rows = packs_per_batch  # index rows per batch
        r = 0
        n_heads = gl.minimum(m_block + 1, 2)
    else:
        PER_GROUP: gl.constexpr = (GROUP + PACK - 1) // PACK
        # The group's heads split as evenly as its item count allows (7 in threes: 3 + 2 + 2, not 3 + 3 + 1, so no
        # item runs one head on three warpgroups' K/V traffic): item j's first head and head count.
        j = w % PER_GROUP
        BASE: gl.constexpr = GROUP // PER_GROUP
        EXTRA: gl.constexpr = GROUP % PER_GROUP
        r = j * BASE + gl.minimum(j, EXTRA)
        n_heads = BASE + (j < EXTRA).to(gl.int32)
        rest = w // PER_GROUP
        m_block = n_qb - 1 - rest % n_qb
        hb = rest // n_qb  # batch x index row
        rows = packs_per_batch // PER_GROUP  # index rows per batch
    idx_h = hb % rows
    if USE_HEAD_MAP:
        kv_h = gl.load(HEAD_MAP + idx_h)
    else:
        kv_h = idx_h
    return hb // rows, kv_h * GROUP + r, kv_h, idx_h, m_block, n_heads


@gluon.jit
def _tile(bufs, i, HEAD_DIM: gl.constexpr):
    """Buffer i of a ring of [1, 1, 64, D] TMA boxes as the [64, D] operand the MMAs read (same bytes)."""
    return bufs.index(i).reshape([BLOCK, HEAD_DIM])


NF = gl.constexpr(10)  # fields per item slot: w, b, h0, idx_h, m_block, n_heads, n_full, total, n_span, n_clean
NF_MHA = gl.constexpr(14)  # MHA items: then the second query block's n_full, total, n_span, n_clean
# Posting them, rather than each consumer dividing the item number and loading the counts from global memory after
# its Q lands, took 4.7% off 32K block top-k 12 with the producer's prefetches (H200, benchmarks/RESULTS.md, Run 20).


@gluon.jit
def _put(item_smem, i, v, layout: gl.constexpr):
    """Scalar v into word i of the item ring (every lane of the warp writes the same word)."""
    item_smem.index(i).store(gl.zeros([1, 1], gl.int32, layout) + v)


@gluon.jit
def _get(item_smem, i, layout: gl.constexpr):
    """Word i of the item ring as a scalar."""
    return gl.max(gl.max(item_smem.index(i).load(layout), 1), 0)


@gluon.jit
def _post_item(item_smem, qb, w, b, h0, idx_h, m_block, n_heads, n_full, total, n_span, n_clean, NFS: gl.constexpr,
               layout: gl.constexpr):
    """Producer: item w and what the consumers need of it (its coordinates, counts and table span) into slot qb of
    the item ring, for them to read once q_ready[qb] completes (the producer's arrive on it releases these stores):
    no division and no global load on the consumers' side of an item boundary. NFS: words per slot."""
    base = qb * NFS
    _put(item_smem, base, w, layout)
    _put(item_smem, base + 1, b, layout)
    _put(item_smem, base + 2, h0, layout)
    _put(item_smem, base + 3, idx_h, layout)
    _put(item_smem, base + 4, m_block, layout)
    _put(item_smem, base + 5, n_heads, layout)
    _put(item_smem, base + 6, n_full, layout)
    _put(item_smem, base + 7, total, layout)
    _put(item_smem, base + 8, n_span, layout)
    _put(item_smem, base + 9, n_clean, layout)


@gluon.jit
def _post_second(item_smem, qb, n_full, total, n_span, n_clean, layout: gl.constexpr):
    """Producer, MHA items: the second query block's counts and table span after the item's fields."""
    base = qb * NF_MHA + NF
    _put(item_smem, base, n_full, layout)
    _put(item_smem, base + 1, total, layout)
    _put(item_smem, base + 2, n_span, layout)
    _put(item_smem, base + 3, n_clean, layout)


@gluon.jit
def _read_second(item_smem, qb, layout: gl.constexpr):
    """Consumer, MHA items: the second query block's (n_full, total, n_span, n_clean)."""
    base = qb * NF_MHA + NF
    return (_get(item_smem, base, layout), _get(item_smem, base + 1, layout), _get(item_smem, base + 2, layout),
            _get(item_smem, base + 3, layout))


@gluon.jit
def _read_item(item_smem, qb, NFS: gl.constexpr, layout: gl.constexpr):
    """Consumer: the fields of slot qb (after waiting on q_ready[qb])."""
    base = qb * NFS
    return (_get(item_smem, base, layout), _get(item_smem, base + 1, layout), _get(item_smem, base + 2, layout),
            _get(item_smem, base + 3, layout), _get(item_smem, base + 4, layout), _get(item_smem, base + 5, layout),
            _get(item_smem, base + 6, layout), _get(item_smem, base + 7, layout), _get(item_smem, base + 8, layout),
            _get(item_smem, base + 9, layout))


@gluon.jit
def _count(ptr, has, MASKED: gl.constexpr):
    """One raw count: 0 where MASKED and not has; unmasked where the caller knows the block exists (a plain load)."""
    if MASKED:
        return gl.load(ptr, mask=has, other=0)
    else:
        return gl.load(ptr)


@gluon.jit
def _counts(b, idx_h, m_block, has, FULL_CNT, PART_CNT, TAB_SPAN, TAB_CLEAN, s_cb, s_ch, s_cm, s_tb, s_th, s_tm,
            TABLE: gl.constexpr, MASKED: gl.constexpr):
    """Producer: query block m_block's raw (n_full, n_part, span, clean), loads issued and not waited for (their
    values are first used an item later); span and clean are 0 without a table."""
    c_off = b * s_cb + idx_h * s_ch + m_block * s_cm
    n_full = _count(FULL_CNT + c_off, has, MASKED)
    n_part = _count(PART_CNT + c_off, has, MASKED)
    if TABLE:
        t_off = b * s_tb + idx_h * s_th + m_block * s_tm
        span = _count(TAB_SPAN + t_off, has, MASKED)
        clean = _count(TAB_CLEAN + t_off, has, MASKED)
    else:
        span = 0
        clean = 0
    return n_full, n_part, span, clean


@gluon.jit
def _fetch(w, n_items, n_qb, packs_per_batch, HEAD_MAP, FULL_CNT, PART_CNT, TAB_SPAN, TAB_CLEAN, s_cb, s_ch, s_cm,
           s_tb, s_th, s_tm, PACK: gl.constexpr, GROUP: gl.constexpr, USE_HEAD_MAP: gl.constexpr,
           TABLE: gl.constexpr):
    """Producer: item w's coordinates and its raw counts (_counts). Past the end it reads the last item's (never
    used)."""
    b, h0, kv_h, idx_h, m_block, n_heads = _item(gl.minimum(w, n_items - 1), n_qb, packs_per_batch, HEAD_MAP, PACK,
                                                 GROUP, USE_HEAD_MAP)
    n_full, n_part, span, clean = _counts(b, idx_h, m_block, True, FULL_CNT, PART_CNT, TAB_SPAN, TAB_CLEAN, s_cb, s_ch,
                                          s_cm, s_tb, s_th, s_tm, TABLE, False)
    return b, h0, kv_h, idx_h, m_block, n_heads, n_full, n_part, span, clean


@gluon.jit
def _table_span(span, clean, n_slots, TABLE: gl.constexpr):
    """Producer: a query block's table span and clean run as the consumers read them, clamped to the table's slots
    (bounds-safe on a malformed span); 0, 0 without a table."""
    if TABLE:
        n_span = gl.minimum(span, n_slots)
        n_clean = gl.minimum(clean, n_span)
    else:
        n_span = 0
        n_clean = 0
    return n_span, n_clean


# An MHA item's two query blocks share no key list, so the K/V ring splits in two: warpgroup j's tiles go to stages
# j, j + 2, ..., each its own ring with its own count (an mbarrier's parity wait needs every phase of a stage seen by
# its waiter). The producer fills them alternately, the first block's tile first, until the shorter list ends, then
# the rest of the longer one. Adjacent blocks' lists are about as long, so the two warpgroups keep each other's
# tensor-core gaps filled as pairs of GQA heads do.
@gluon.jit
def _mha_stage(tile, j, STAGES: gl.constexpr):
    """The stage and phase of warpgroup j's tile'th K/V tile in its half of the ring."""
    half: gl.constexpr = STAGES // 2
    return j + 2 * (tile % half), (tile // half) & 1


@gluon.jit
def _landed(kv_ready, tile, HEAD: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr):
    """Consumer: wait for this warpgroup's tile'th K/V tile to land; its stage."""
    if GROUP == 1:
        s, phase = _mha_stage(tile, HEAD, STAGES)
        mbarrier.wait(kv_ready.index(s), phase)
    else:
        s = tile % STAGES
        mbarrier.wait(kv_ready.index(s), (tile // STAGES) & 1)
    return s


@gluon.jit
def _mha_tile(t, both, n_t1_longer):
    """Stream position t -> (block 0 or 1, its tile): alternate below 2 * both, then the longer block's rest."""
    alternate = t < 2 * both
    return gl.where(alternate, t % 2, n_t1_longer), gl.where(alternate, t // 2, t - both)


@gluon.jit
def _mha_block_id(t, both, n_t1_longer, n_full, total, n_full1, total1, f_base, p_base, s_fm, s_pm):
    """Key block at stream position t of an MHA item (0 past its lists); block 1's lists are one query block
    before block 0's."""
    j, i = _mha_tile(t, both, n_t1_longer)
    first = j == 0
    return _block_id(i, gl.where(first, n_full, n_full1), gl.where(first, total, total1), f_base - j * s_fm,
                     p_base - j * s_pm)


@gluon.jit
def _block_id(t, n_full, total, f_base, p_base):
    """Key block of tile t of a row's list stream (0 past it): two masked loads, no branch, so the load is in flight
    while the producer waits for the ring."""
    bf = gl.load(f_base + t, mask=t < n_full, other=0)
    bp = gl.load(p_base + (t - n_full), mask=(t >= n_full) & (t < total), other=0)
    return bf + bp


@gluon.jit
def _scores(qk, t, n_full, total, p_base, pos, offs_c, kv_len, window, sink, n_clean, n_span, ids_base, bits_base,
            WINDOW: gl.constexpr, TABLE: gl.constexpr):
    """Raw scores of tile t [64, 64] of a row's stream (unscaled: _softmax folds the scale into its exponent),
    masked where the tile needs it: a partial block by causality (bottom-right positions), the kv bound and, with
    WINDOW, the window/sink rule (a key within ``window`` of the row, or among the first ``sink``); a table tile
    past the clean run by its slots' bits and causality. Full blocks and clean table tiles: none."""
    if t >= n_full:
        if t < total:
            blk = gl.load(p_base + (t - n_full))
            cols = blk * BLOCK + offs_c
            ok = (cols[None, :] <= pos[:, None]) & (cols[None, :] < kv_len)
            if WINDOW:
                ok = ok & (((pos[:, None] - cols[None, :]) < window) | (cols[None, :] < sink))
            qk = gl.where(ok, qk, float("-inf"))
        elif TABLE:
            start = (t - total) * BLOCK
            if start + BLOCK > n_clean:
                # The tile's slots are bits of two words (start is a multiple of 64): two loads for the whole
                # warpgroup, not one per column.
                slots = start + offs_c
                w0 = gl.load(bits_base + start // 32, mask=start < n_span, other=0)
                w1 = gl.load(bits_base + start // 32 + 1, mask=start + 32 < n_span, other=0)
                used = (((gl.where(offs_c < 32, w0, w1) >> (offs_c % 32)) & 1) != 0) & (slots < n_span)
                # An unused slot's id reads as the largest int32, past every row's position: one test per score,
                # and the bits die before the scores are masked. Testing used and causality per score kept both
                # live with the ids, which spilled three d-128 warpgroups' registers inside the tile loop.
                ids = gl.load(ids_base + slots, mask=used, other=2147483647)
                qk = gl.where(ids[None, :] <= pos[:, None], qk, float("-inf"))
    return qk


@gluon.jit
def _halve(x):
    """[64, 2c] -> [64, c]: the elementwise max of each row's two column halves. The top column bit of the wgmma
    accumulator layout (and of what is left after each halving, down to 8 columns) is a register bit, so the split
    moves no data."""
    n: gl.constexpr = x.shape[1] // 2
    lo, hi = gl.split(x.reshape(BLOCK, 2, n).permute(0, 2, 1))
    return gl.maximum(lo, hi)


@gluon.jit
def _row_max(qk):
    """Row max of [64, 64] scores [64]: three halvings, then gl.max over each thread's last 2 values and the lanes.
    gl.max alone reduces a thread's 16 values of a row in one chain of 15 dependent FMNMX, which starts the softmax's
    critical path: the tree took 0.3-1.5% off every launch (H200, benchmarks/RESULTS.md, Run 21)."""
    return gl.max(_halve(_halve(_halve(qk))), 1)


@gluon.jit
def _softmax(qk, m_i, l_i, qk_scale):
    """Online softmax step in log2 units of the scaled scores: (p, m, l, alpha), alpha rescaling what was
    accumulated before. The scale rides in the exponent's FMA (qk * scale - m), as FlashAttention-3 does, not in
    a multiply of its own per score (qk_scale > 0, so the max commutes with it): 4-6% faster per launch than
    scaling first (H200, 8K-128K, block top-k)."""
    m_new = gl.maximum(m_i, gl.convert_layout(_row_max(qk), m_i.type.layout) * qk_scale)
    # A row with nothing admitted yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _producer(PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, TABLE: gl.constexpr,
              USE_HEAD_MAP: gl.constexpr,
              q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
              item_smem, ITEM_CTR, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, TAB_SPAN, TAB_CLEAN, HEAD_MAP, n_slots,
              n_items, n_qb, packs_per_batch, s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm, s_tb, s_th, s_tm):
    """Hands out the CTA's items and streams their Q and K/V tiles. The first item is the CTA's own index; each
    next one is a ticket from ITEM_CTR, so CTAs that drew light items take more of them (heaviest first, the tail
    is the lightest): a static round-robin left the SMs 0.73-0.80 balanced on near-dense 8K launches (16 items
    each, costs 1-66 tiles). MHA items (GROUP 1) are two query blocks of one head; their tiles alternate."""
    one_warp: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, 1], [1, 0])
    NFS: gl.constexpr = NF_MHA if GROUP == 1 else NF
    step = gl.num_programs(0)
    tile = 0
    it = 0
    w = gl.program_id(0)
    b, h0, kv_h, idx_h, m_block, n_heads, n_full, n_part, span, clean = _fetch(
        w, n_items, n_qb, packs_per_batch, HEAD_MAP, FULL_CNT, PART_CNT, TAB_SPAN, TAB_CLEAN, s_cb, s_ch, s_cm,
        s_tb, s_th, s_tm, PACK, GROUP, USE_HEAD_MAP, TABLE)
    if GROUP == 1:
        # The second query block's counts (zeros where the item has one block).
        n_full1, n_part1, span1, clean1 = _counts(b, idx_h, m_block - 1, n_heads > 1, FULL_CNT, PART_CNT, TAB_SPAN,
                                                  TAB_CLEAN, s_cb, s_ch, s_cm, s_tb, s_th, s_tm, TABLE, True)
        tile1 = 0  # tile counts 0 and 1: each warpgroup's own half of the ring
    while w < n_items:
        qb = it % 2
        # Q buffer qb (and item slot qb) was last read by item it - 2: wait for the consumers to release it.
        mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
        total = n_full + n_part
        n_span, n_clean = _table_span(span, clean, n_slots, TABLE)
        _post_item(item_smem, qb, w, b, h0, idx_h, m_block, n_heads, n_full, total, n_span, n_clean, NFS, one_warp)
        if GROUP == 1:
            total1 = n_full1 + n_part1
            n_span1, n_clean1 = _table_span(span1, clean1, n_slots, TABLE)
            _post_second(item_smem, qb, n_full1, total1, n_span1, n_clean1, one_warp)
            n_t0 = total + gl.cdiv(n_span, BLOCK)
            n_t1 = total1 + gl.cdiv(n_span1, BLOCK)
            both = gl.minimum(n_t0, n_t1)
            n_t1_longer = (n_t1 > n_t0).to(gl.int32)
        if GROUP % PACK == 0:
            mbarrier.expect(q_ready.index(qb), PACK * q_desc.block_type.nbytes)
        else:
            # Some of a group's items may hold fewer heads (_item): the bytes expected are a constant per expect,
            # so one predicated expect per head count, of which one arrives.
            for r in gl.static_range(1, PACK + 1):
                mbarrier.expect(q_ready.index(qb), r * q_desc.block_type.nbytes, pred=n_heads == r)
        for p in gl.static_range(PACK):
            has = p < n_heads
            if GROUP == 1:
                q_at = [b, h0, (m_block - p) * BLOCK, 0]  # MHA: warpgroup p's query block
            else:
                q_at = [b, h0 + p, m_block * BLOCK, 0]
            _tma_load(q_desc, q_at, q_ready.index(qb), q_smem.index(qb * PACK + p), pred=has)
        f_base = FULL_IDX + b * s_fb + idx_h * s_fh + m_block * s_fm
        p_base = PART_IDX + b * s_pb + idx_h * s_ph + m_block * s_pm
        if GROUP == 1:
            blk = _mha_block_id(0, both, n_t1_longer, n_full, total, n_full1, total1, f_base, p_base, s_fm, s_pm)
        else:
            blk = _block_id(0, n_full, total, f_base, p_base)
        # The next ticket and its counts: the atomic's result is used at once (the warp shares it by a shuffle),
        # so it is taken here, where its round trip overlaps the first block id's load and the wait for the ring.
        nxt = step + gl.atomic_add(ITEM_CTR, 1, sem="relaxed")
        nb, nh0, nkv_h, nidx_h, nm_block, nn_heads, nn_full, nn_part, nspan, nclean = _fetch(
            nxt, n_items, n_qb, packs_per_batch, HEAD_MAP, FULL_CNT, PART_CNT, TAB_SPAN, TAB_CLEAN, s_cb, s_ch, s_cm,
            s_tb, s_th, s_tm, PACK, GROUP, USE_HEAD_MAP, TABLE)
        if GROUP == 1:
            nn_full1, nn_part1, nspan1, nclean1 = _counts(nb, nidx_h, nm_block - 1, nn_heads > 1, FULL_CNT, PART_CNT,
                                                          TAB_SPAN, TAB_CLEAN, s_cb, s_ch, s_cm, s_tb, s_th, s_tm,
                                                          TABLE, True)
            n_stream = n_t0 + n_t1
        else:
            n_stream = total + gl.cdiv(n_span, BLOCK)
        for t in range(n_stream):
            if GROUP == 1:
                j, i = _mha_tile(t, both, n_t1_longer)
                listed = gl.where(j == 0, total, total1)
                count = gl.where(j == 0, tile, tile1)  # the tiles block j's warpgroup has had so far
                s, phase = _mha_stage(count, j, STAGES)
                mbarrier.wait(kv_empty.index(s), phase ^ 1, pred=count >= STAGES // 2)
            else:
                i = t
                listed = total
                s = tile % STAGES
                mbarrier.wait(kv_empty.index(s), ((tile // STAGES) & 1) ^ 1, pred=tile >= STAGES)
            bar = kv_ready.index(s)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            if i < listed:
                _tma_load(k_desc, [b, kv_h, blk * BLOCK, 0], bar, k_smem.index(s))
                _tma_load(v_desc, [b, kv_h, blk * BLOCK, 0], bar, v_smem.index(s))
            else:
                # The index row's slab ([B, Hs, V, D]): slots (i - listed) * 64 on.
                _tma_load(kc_desc, [b, idx_h, (i - listed) * BLOCK, 0], bar, k_smem.index(s))
                _tma_load(vc_desc, [b, idx_h, (i - listed) * BLOCK, 0], bar, v_smem.index(s))
            # The next tile's block id, in flight through the next ring wait; the tile counts.
            if GROUP == 1:
                blk = _mha_block_id(t + 1, both, n_t1_longer, n_full, total, n_full1, total1, f_base, p_base, s_fm,
                                    s_pm)
                tile += 1 - j
                tile1 += j
            else:
                blk = _block_id(t + 1, n_full, total, f_base, p_base)
                tile += 1
        w = nxt
        b, h0, kv_h, idx_h, m_block, n_heads = nb, nh0, nkv_h, nidx_h, nm_block, nn_heads
        n_full, n_part, span, clean = nn_full, nn_part, nspan, nclean
        if GROUP == 1:
            n_full1, n_part1, span1, clean1 = nn_full1, nn_part1, nspan1, nclean1
        it += 1
    # The end: an item past the last, with no Q behind it.
    qb = it % 2
    mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
    _post_item(item_smem, qb, w, 0, 0, 0, 0, 0, 0, 0, 0, 0, NFS, one_warp)
    mbarrier.arrive(q_ready.index(qb), count=1)


@gluon.jit
def _epilogue(o_desc, o_buf, LSE, acc, m_i, l_i, b, h, m_block, rows, q_heads, q_len, HEAD_DIM: gl.constexpr,
              row_o: gl.constexpr):
    """Normalise one head's [64, D] accumulator and send it out through its O buffer by an asynchronous TMA store
    (rows past N are dropped by the TMA unit); lse [64] in natural log, rows past q_len not stored. Rows with no
    admitted key give zeros and lse -inf."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    # One reciprocal per row, then a multiply: acc / l is a full-precision division per element (a reciprocal, three
    # multiplies and a select each), 184 instructions per thread per item more.
    out = acc * gl.convert_layout(1.0 / l_safe, row_o)[:, None]
    # This warpgroup's previous O store must have left its buffer before it is overwritten.
    tma.store_wait(0)
    o_buf.reshape([BLOCK, HEAD_DIM]).store(out.to(o_buf.dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, m_block * BLOCK, 0], o_buf)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(LSE + (b * q_heads + h).to(gl.int64) * q_len + rows, lse, mask=rows < q_len)


@gluon.jit
def _release_previous_q(q_empty, it):
    """Three d-128 warpgroups store O through their Q buffers (_block_sparse_ws_fwd): item it - 1's buffer is free
    for the producer once that item's O store has read it, which it has, or nearly, by item it's first QK."""
    if it > 0:
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index((it - 1) % 2), count=1)


@gluon.jit
def _consumer(HEAD_DIM: gl.constexpr, PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
              WINDOW: gl.constexpr, TABLE: gl.constexpr, HEAD: gl.constexpr,
              o_desc, q_smem, k_smem, v_smem, o_smem, item_smem, q_ready, q_empty, kv_ready, kv_empty, LSE,
              PART_IDX, TAB_IDS, TAB_BITS, n_items, q_heads, q_len, kv_len, window, sink, qk_scale,
              s_pb, s_ph, s_pm, s_ib, s_ih, s_wb, s_wh, s_wm):
    """One warpgroup: head h0 + HEAD of every item, its 64 rows, against the row's key tiles. The heads'
    warpgroups run unsynchronised, so one's softmax overlaps the other's tensor-core work (FlashAttention-3's
    explicit ping-pong between them, mbarrier turns around each GEMM issue, ran 2-3% slower here: H200, 8K-128K).
    MHA (GROUP 1): query block m_block - HEAD of head h0, on its own tiles of the item's alternating stream."""
    # Three warpgroups have 160 registers each (PACK3_REGS), four 112 (PACK4_REGS): a consumer of four, or of three at
    # d 128 or with a column table, spills with Q in registers, so it reads Q from shared memory until the item's last QK.
    Q_IN_SMEM: gl.constexpr = PACK == 4 or (PACK == 3 and (HEAD_DIM == 128 or TABLE))
    # O leaves through Q's buffers where _block_sparse_ws_fwd passes them as o_smem (2 items x PACK heads, not PACK).
    O_IN_Q: gl.constexpr = o_smem.shape[0] == 2 * PACK
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_r = gl.arange(0, BLOCK, layout=row_s)
    offs_c = gl.arange(0, BLOCK, layout=col_s)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    one_wg: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
    NFS: gl.constexpr = NF_MHA if GROUP == 1 else NF
    tile = 0
    it = 0
    mbarrier.wait(q_ready.index(0), 0)
    w, b, h0, idx_h, m_block, n_heads, n_full, total, n_span, n_clean = _read_item(item_smem, 0, NFS, one_wg)
    if GROUP == 1:
        n_full1, total1, n_span1, n_clean1 = _read_second(item_smem, 0, one_wg)
    while w < n_items:
        if GROUP == 1:
            # This warpgroup's query block and its counts.
            if HEAD == 1:
                m_block = m_block - 1
                n_full, total, n_span, n_clean = n_full1, total1, n_span1, n_clean1
            h = h0
        else:
            h = h0 + HEAD
        if GROUP % PACK == 0:
            active = True
        else:
            active = HEAD < n_heads  # some of a group's items have no head for this warpgroup
        p_base = PART_IDX + b * s_pb + idx_h * s_ph + m_block * s_pm
        ids_base = TAB_IDS + b * s_ib + idx_h * s_ih
        bits_base = TAB_BITS + b * s_wb + idx_h * s_wh + m_block * s_wm
        rows = m_block * BLOCK + offs_r
        pos = rows + (kv_len - q_len)  # each row's frontier among the keys (bottom-right alignment)
        qb = it % 2
        if Q_IN_SMEM:
            q = _tile(q_smem, qb * PACK + HEAD, HEAD_DIM)
        else:
            if active:
                # Q as the QK wgmma's register operand (32 registers): with 64-key tiles, a QK with both operands in
                # shared memory reads as many bytes per clock as shared memory gives; 3-5% faster per launch on an
                # H200, 8K-32K, every index kind (benchmarks/RESULTS.md, Run 19).
                q = _tile(q_smem, qb * PACK + HEAD, HEAD_DIM).load(q_layout)
            else:
                q = gl.zeros([BLOCK, HEAD_DIM], q_smem.dtype, q_layout)  # never read: an empty slot has no Q
            # Q is in registers (or not needed): the producer may load the item after next into this buffer now.
            mbarrier.arrive(q_empty.index(qb), count=1)
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK], gl.float32, row_s)
        acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
        n_tiles = total + gl.cdiv(n_span, BLOCK)
        if not active:
            # Nothing to compute, but the ring's stages are released by every warpgroup (kv_empty counts PACK
            # arrivals); each is waited for first, so this warpgroup never runs a phase ahead of the loads. (An MHA
            # item's missing block has no tiles.) With O through Q it frees the item before's Q buffer here.
            if O_IN_Q:
                _release_previous_q(q_empty, it)
            for t in range(n_tiles):
                s = _landed(kv_ready, tile, HEAD, STAGES, GROUP)
                mbarrier.arrive(kv_empty.index(s), count=1)
                tile += 1
        elif n_tiles > 0:
            # Tile 0 alone; then each step issues QK of tile t and PV of tile t - 1 together, then tile t's softmax.
            # The source waits for PV after the softmax (FlashAttention-3's intra-warpgroup overlap), but ptxas moves
            # that wait to the top of the softmax, so the two warpgroups take turns on the tensor cores instead; a
            # block boundary that pins the wait after the softmax ran 0.5-3% slower (benchmarks/RESULTS.md, Run 21).
            s = _landed(kv_ready, tile, HEAD, STAGES, GROUP)
            qk = warpgroup_mma(q, _tile(k_smem, s, HEAD_DIM).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if O_IN_Q:
                _release_previous_q(q_empty, it)  # under the first QK
            if Q_IN_SMEM:
                qk = warpgroup_mma_wait(0, deps=(qk,))
            else:
                qk, q = warpgroup_mma_wait(0, deps=(qk, q))
            qk = _scores(qk, 0, n_full, total, p_base, pos, offs_c, kv_len, window, sink, n_clean, n_span, ids_base, bits_base,
                         WINDOW, TABLE)
            p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale)
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
            s_prev = s
            tile += 1
            for t in range(1, n_tiles):
                s = _landed(kv_ready, tile, HEAD, STAGES, GROUP)
                qk = warpgroup_mma(q, _tile(k_smem, s, HEAD_DIM).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                pv = warpgroup_mma(p_op, _tile(v_smem, s_prev, HEAD_DIM), acc, is_async=True)
                # Groups retire in order: the scores, not yet PV. Q in registers is named, so they stay Q's meanwhile.
                if Q_IN_SMEM:
                    qk = warpgroup_mma_wait(1, deps=(qk,))
                else:
                    qk, q = warpgroup_mma_wait(1, deps=(qk, q))
                qk = _scores(qk, t, n_full, total, p_base, pos, offs_c, kv_len, window, sink, n_clean, n_span, ids_base,
                             bits_base, WINDOW, TABLE)
                p, m_i, l_i, alpha = _softmax(qk, m_i, l_i, qk_scale)
                p_next = gl.convert_layout(p.to(v_smem.dtype), p_layout)
                # P is PV's A operand, read from registers while it runs: name it in the wait's deps, or its
                # registers may be reused for the next P under the running MMA (ptxas 12.8 then serializes
                # every wgmma of the kernel: C7513).
                acc, _ = warpgroup_mma_wait(0, deps=(pv, p_op))
                p_op = p_next
                mbarrier.arrive(kv_empty.index(s_prev), count=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                s_prev = s
                tile += 1
            pv = warpgroup_mma(p_op, _tile(v_smem, s_prev, HEAD_DIM), acc, is_async=True)
            acc, _ = warpgroup_mma_wait(0, deps=(pv, p_op))
            mbarrier.arrive(kv_empty.index(s_prev), count=1)
        elif O_IN_Q:
            _release_previous_q(q_empty, it)  # an item with no key tile
        if O_IN_Q:
            o_slot = qb * PACK + HEAD  # its Q buffer, released under the next item's first QK
        else:
            o_slot = HEAD
            if Q_IN_SMEM:
                mbarrier.arrive(q_empty.index(qb), count=1)  # this item's QKs are done with its Q buffer
        if active:
            _epilogue(o_desc, o_smem.index(o_slot), LSE, acc, m_i, l_i, b, h, m_block, rows, q_heads, q_len, HEAD_DIM, row_o)
        it += 1
        # The next item (or the end) and its Q.
        mbarrier.wait(q_ready.index(it % 2), (it // 2) & 1)
        w, b, h0, idx_h, m_block, n_heads, n_full, total, n_span, n_clean = _read_item(item_smem, it % 2, NFS, one_wg)
        if GROUP == 1:
            n_full1, total1, n_span1, n_clean1 = _read_second(item_smem, it % 2, one_wg)
    tma.store_wait(0)


# Every integer and index pointer changes with the candidates a search times (lengths, item counts, list widths) and
# none feeds a vectorised access (the tiles move by TMA descriptors), so none is specialised on ==1 / %16: without
# this a cold 28/4-head modal search compiled ~19 variants of this kernel (block_sparse.py's _GENERIC_ARGS, same reason).
_GENERIC_ARGS = (
    "ITEM_CTR", "FULL_CNT", "FULL_IDX", "PART_CNT", "PART_IDX", "TAB_IDS", "TAB_BITS", "TAB_CLEAN", "TAB_SPAN", "HEAD_MAP",
    "n_slots", "n_items", "n_qb", "packs_per_batch", "q_heads", "q_len", "kv_len", "window", "sink",
    "s_cb", "s_ch", "s_cm", "s_fb", "s_fh", "s_fm", "s_pb", "s_ph", "s_pm",
    "s_ib", "s_ih", "s_wb", "s_wh", "s_wm", "s_tb", "s_th", "s_tm",
)


@gluon.jit(do_not_specialize=_GENERIC_ARGS)
def _block_sparse_ws_fwd(q_desc, k_desc, v_desc, o_desc, kc_desc, vc_desc, LSE, ITEM_CTR, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX,
                         TAB_IDS, TAB_BITS, TAB_CLEAN, TAB_SPAN, HEAD_MAP, n_slots,
                         n_items, n_qb, packs_per_batch, q_heads, q_len, kv_len, window, sink, qk_scale,
                         s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm,
                         s_ib, s_ih, s_wb, s_wh, s_wm, s_tb, s_th, s_tm,
                         HEAD_DIM: gl.constexpr, PACK: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                         WINDOW: gl.constexpr, TABLE: gl.constexpr, USE_HEAD_MAP: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * PACK] + q_desc.block_type.shape, q_desc.layout)  # 2 items x PACK heads
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if PACK == 3 and HEAD_DIM == 128:
        # O through each head's Q buffer, free after the item's last QK: 3 O tiles (48 KiB) less, so the K/V ring has
        # 4 stages, not 2 (225 KiB in all; 1.07-1.13x on block top-k, H200, benchmarks/RESULTS.md, Run 23).
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [PACK] + o_desc.block_type.shape, o_desc.layout)
    # Each Q buffer's item (a scheduler's ticket) and its fields, written by the producer before it arrives on q_ready.
    NFS: gl.constexpr = NF_MHA if GROUP == 1 else NF
    item_smem = gl.allocate_shared_memory(gl.int32, [2 * NFS, 1, 1], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Every consumer warpgroup releases each Q buffer once, and each K/V stage once, or with MHA items (GROUP 1) the
    # warpgroup whose block the stage holds.
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=PACK)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1 if GROUP == 1 else PACK)
    # Each partition's arguments: its constexprs in a literal, then the shared rest. A tuple assigned in the kernel
    # turns constexprs into tensors, and a tuple sum unwraps those of its right-hand side, not of its left.
    cargs = (o_desc, q_smem, k_smem, v_smem, o_smem, item_smem, q_ready, q_empty, kv_ready, kv_empty, LSE, PART_IDX,
             TAB_IDS, TAB_BITS, n_items, q_heads, q_len, kv_len, window, sink, qk_scale,
             s_pb, s_ph, s_pm, s_ib, s_ih, s_wb, s_wh, s_wm)
    pargs = (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty,
             item_smem, ITEM_CTR, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, TAB_SPAN, TAB_CLEAN, HEAD_MAP, n_slots,
             n_items, n_qb, packs_per_batch, s_cb, s_ch, s_cm, s_fb, s_fh, s_fm, s_pb, s_ph, s_pm, s_tb, s_th, s_tm)
    if PACK == 4:
        gl.warp_specialize([(_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 0) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 1) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 2) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 3) + cargs),
                            (_producer, (PACK, GROUP, STAGES, TABLE, USE_HEAD_MAP) + pargs)],
                           [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif PACK == 3:
        gl.warp_specialize([(_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 0) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 1) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 2) + cargs),
                            (_producer, (PACK, GROUP, STAGES, TABLE, USE_HEAD_MAP) + pargs)],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 0) + cargs),
                            (_consumer, (HEAD_DIM, PACK, GROUP, STAGES, WINDOW, TABLE, 1) + cargs),
                            (_producer, (PACK, GROUP, STAGES, TABLE, USE_HEAD_MAP) + pargs)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _head_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """[B, H, N, D] with any 16-byte strides (tma_layout_ok) as a 4D descriptor of [1, 1, 64, D] boxes in the default
    swizzled layout: Q, K, V, O and the table slabs (module docstring)."""
    box = [1, 1, TILE, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(box, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)


# Triton pads the warps to whole warpgroups and shares the 64K registers among them at launch: the 13 warps of three
# consumers and a 1-warp producer get 4 warpgroups' worth, 128 per thread; the 17 of four consumers 5 warpgroups'
# worth, 96 per thread (65536 / 640, down to a multiple of 8). setmaxnreg moves them to the consumers:
# 3 x 160 + 32 = 4 x 128 and 4 x 112 + 32 = 5 x 96. With pairs the producer keeps 40.
PACK3_REGS, PACK3_PRODUCER_REGS, PAIR_PRODUCER_REGS = 160, 32, 40
PACK4_REGS, PACK4_PRODUCER_REGS = 112, 32


# Groups not divisible by 3 that run faster in threes than in pairs, as (group, head dim, column table): where
# measured (_pack); the others keep pairs, or fours at d 64.
_ODD_THREES = frozenset({(5, 64, False), (5, 128, False), (5, 128, True), (7, 128, False), (7, 64, True)})


def _pack(group: int, head_dim: int, table: bool) -> int:
    """Heads per work item (_item splits a group's heads as evenly as its item count allows):
    - 4 at d 64 for groups not divisible by 3 whose items leave at most one warpgroup idle (4, 7, 8, 16, ...), with a
      column table only where none idles (4, 8, 16);
    - 3 for groups of 3 and 9, at d 64 for groups of 6 and 12, and where measured for groups of 5 (3 + 2) and 7
      (3 + 2 + 2): 5 but at d 64 with a table (not measured), 7 at d 128 without a table and at d 64 with one (four
      ran 0.94-1.09x the pairs there);
    - else 2.
    Every warpgroup of an item reads the same K/V tiles, so more of them read each tile once per item, and they take
    turns on the tensor cores, which hides more of each one's softmax. Against pairs:
    - three: 1.13-1.35x at d 64 (24/8 and 9/3 heads, 8K-32K, every index kind), 1.16-1.26x at d 128 on block top-k
      and 1.16-1.24x on A-shape (24/8 heads); where pairs idle nowhere, 1.11-1.15x at d 64 (12/2 heads, 32K) but up
      to 8% slower at d 128 (8K), and 0.83-0.98x on groups of 8 there (16/2 heads, 3 + 3 + 2); groups of 5 and 7 at
      d 128 (20/4, 28/4 heads) 1.01-1.10x and 1.00-1.06x on block top-k and A-shape, groups of 5 at d 64 (20/4)
      1.09-1.17x; with a table, groups of 5 at d 128 (40/8) 0.99-1.06x but groups of 7 0.95-1.01x;
    - four (d 64): 1.11-1.25x on block top-k and 1.04-1.14x on A-shape (32/8, 32/4, 32/2 and 28/4 heads, 8K-32K);
      on groups of 12 within -8% to +4% of three, which keep them;
    - with a column table (vertical-slash): three 1.13-1.24x at d 128 (24/8 heads) and 1.03-1.08x (27/3); at d 64
      0.97-1.14x on 12/2 heads (slower at 8K only) and 1.03-1.08x on 28/4; four 1.08-1.21x on 32/8 and 32/4.
    Items of one KV tile (diagonal only) lose 8-14% with three. H200, benchmarks/RESULTS.md, Runs 22-24 and 26-27.
    Four warpgroups have 112 registers (PACK4_REGS), too few for d 128. Under triton 3.9's ptxas (13.4), four keep
    13-29 values in local memory (none under 3.6's 12.8, a few with a window mask), read at item boundaries and,
    with a window mask, twice per key tile; three at d 128 with a window mask or items that idle one keep 8-9 (none
    under 12.8), one L1 load per key tile. With a table, 13.4 keeps more (9 loads per key tile for three at d 128,
    13 for four at d 64; 12.8 none in the loop), and there the choices above still ran 1.06-1.19x the pairs."""
    if head_dim == 64 and group % 3 and (group % 4 == 0 if table else -group % 4 <= 1):
        return 4
    if group % 3 == 0:
        return 3 if group % 2 or head_dim == 64 else 2  # even groups (6, 12) ran slower in threes at d 128
    if (group, head_dim, table) in _ODD_THREES:
        return 3
    return 2


def _plan(group: int, head_dim: int, table: bool, stages: int | None, consumer_regs: int) -> tuple[int, int, int, int]:
    """(heads per item, ring stages, consumer and producer registers per thread) for a launch with or without a
    column table; ``stages`` None for the default: 3, or 4 for three d-128 warpgroups, whose O leaves through their Q
    buffers (_block_sparse_ws_fwd), which leaves room for a 4-stage ring, and for MHA, whose warpgroups each have
    half of the ring (_mha_stage): at least 4, even, because a consumer holds its previous tile's stage while it waits
    for the next one (with one stage each, both would wait forever)."""
    pack = _pack(group, head_dim, table)
    if stages is None:
        stages = 4 if (pack == 3 and head_dim == 128) or group == 1 else 3
    if group == 1:
        stages = max(4, stages + stages % 2)
    if pack == 2:
        return pack, stages, consumer_regs, PAIR_PRODUCER_REGS
    if pack == 3:
        return pack, stages, min(consumer_regs, PACK3_REGS), PACK3_PRODUCER_REGS
    return pack, stages, min(consumer_regs, PACK4_REGS), PACK4_PRODUCER_REGS


def tma_layout_ok(t: torch.Tensor) -> bool:
    """Whether a [B, H, N, D] tensor can be a TMA descriptor's global memory: unit last stride, the other strides
    and the base 16-byte aligned (the runtime's transposed [B, N, H, D] buffers qualify)."""
    size = t.element_size()
    return t.dim() == 4 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:3])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def ws_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *, table: bool = True) -> bool:
    """Whether this kernel can run the launch (on a Hopper GPU, which the caller checks): dense [B, H, N, D]
    bf16/fp16 on CUDA with TMA-ready strides (tma_layout_ok), d 64/128, 64-blocks, a kv-space index of full and
    partial lists (window/sink masks included) and, when ``table``, a column table (columns without one stay with
    the Triton kernel), GQA groups of any size (2, 3 or 4 heads per item by _pack; where that does not divide the
    group, the spare warpgroups of its smaller items idle) and MHA (two query blocks of a head per item)."""
    return q.is_cuda and ws_shapes_fit(q, k, v, index, table=table)


def ws_shapes_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *, table: bool = True) -> bool:
    """ws_eligible less the device: layouts, dtypes, head dim, block size and the index's contents."""
    if q.dim() != 4 or q.dtype not in _GL_DTYPES or not all(t.dtype == q.dtype and tma_layout_ok(t) for t in (q, k, v)):
        return False
    if q.shape[-1] not in (64, 128) or index.block_m != TILE or index.block_n != TILE or index.head_space != "kv":
        return False
    if index.col_count is not None and (index.col_table is None or not table):
        return False
    return q.shape[1] % k.shape[1] == 0


def block_sparse_ws_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *,
                              scale: float, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                              heads: torch.Tensor | None = None, stages: int | None = None, programs: int | None = None,
                              consumer_regs: int = 224) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hq, Nq, D] like q, lse fp32 [B, Hq, Nq] (written into out/lse when given: out tma_layout_ok, lse
    contiguous): block_sparse_attention's dense kv-space path, the index's column table included. ws_eligible says what it takes; the
    caller has checked the index and the head map (block_sparse.check_index).
    heads: int32 [Hs] KV heads this launch serves (index row i is KV head heads[i]; the other heads of out/lse
    are left untouched), or None for all of them.
    stages: K/V ring depth, None for _plan's (3; 4 for three d-128 warpgroups and for MHA, where it is at least 4 and
    even: _plan). H200, 32K, block top-k: one block per tile x 3 stages ran 4-10% faster than two blocks per tile x
    2 stages, the most that fit (benchmarks/RESULTS.md, Run 15).
    programs: CTAs to launch (default one per SM, at most one per work item); each takes its next item from a
    shared counter, so any count gives the same bits, and fewer leave SMs to concurrent work.
    consumer_regs: registers per consumer thread (setmaxnreg). 224 and 232 time the same on an H200; at 232 the
    ptxas of triton 3.9 spills one prologue value of the GROUP 2 kernel, at 216 the table kernels spill. With three or four
    consumer warpgroups (_pack) at most PACK3_REGS or PACK4_REGS."""
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    table = index.col_table if index.col_table is not None and index.col_table.ids.shape[-1] else None
    pack, stages, consumer_regs, producer_regs = _plan(group, head_dim, table is not None, stages, consumer_regs)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device) if lse is None else lse
    n_qb = triton.cdiv(q_len, TILE)
    heads = None if heads is None else heads.contiguous()  # the kernel reads it at unit stride
    idx_heads = kv_heads if heads is None else heads.shape[0]
    packs = idx_heads * triton.cdiv(group, pack)  # some of a group's items may hold fewer heads (_item)
    n_items = batch * packs * (triton.cdiv(n_qb, 2) if group == 1 else n_qb)  # MHA: two query blocks per item
    if n_items == 0:  # the producer reads its first item's counts before it checks the item against n_items
        return out, lse
    grid = (min(n_items, programs or _sm_count(q.device)),)
    k_desc, v_desc = _head_descriptor(k), _head_descriptor(v)
    if table is not None:
        # Each index row's slots as a contiguous slab (column_slabs.py), read through the same [1, 1, 64, D] boxes.
        kc, vc = column_slabs(k, v, table.ids, heads, 1, batch)
        table, table_strides = table_operands(table)
        table_args = (table.ids, table.bits, table.clean, table.span, table.ids.shape[-1])
        kc_desc, vc_desc = _head_descriptor(kc), _head_descriptor(vc)
    else:
        table_args = (index.full_count,) * 4 + (0,)
        table_strides = (0,) * 8
        kc_desc, vc_desc = k_desc, v_desc
    # Both counts are read with full_count's strides: check_index has made sure the counts share them.
    _block_sparse_ws_fwd[grid](
        _head_descriptor(q), k_desc, v_desc, _head_descriptor(out), kc_desc, vc_desc, lse,
        torch.zeros(1, dtype=torch.int32, device=q.device),  # the item scheduler's tickets
        index.full_count, index.full_idx, index.partial_count, index.partial_idx, *table_args[:4],
        index.full_count if heads is None else heads, table_args[4],
        n_items, n_qb, packs, q_heads, q_len, kv_len, index.window, index.sink, scale * LOG2E,
        *index_strides(index.full_count), *index_strides(index.full_idx), *index_strides(index.partial_idx),
        *table_strides,
        HEAD_DIM=head_dim, PACK=pack, GROUP=group, STAGES=stages, WINDOW=index.window >= 0,
        TABLE=table is not None, USE_HEAD_MAP=heads is not None,
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4,
    )
    return out, lse
