"""NOSA's per-step selection and slot map in five launches (paper 004 Eq. 3-5, nosa/selection.py's reading).

The torch path of a decode step (nosa/device.py) spends some 80 small launches per layer on selection:
query scores, block pooling, two stable sorts, the slot-map set difference, the attention mask. At batch
16 that fixed cost was most of an 8B step on an H200 (benchmarks/RESULTS.md). Here every phase is one
launch over (sequence, KV head) pairs and, where the phase allows, chunks of units or blocks, so that a
small batch still fills the GPU (one program per pair ran the phases one after another: 180 µs per
layer at 32K, batch 16, on an H200):

1. ``_logits_kernel`` (pair, unit chunk): logits of the G query heads against BM compressed keys (one
   ``tl.dot``, the keys read once), kept in scratch, with the chunk's max and sum of exp per head;
2. ``_block_scores_kernel`` (pair, block chunk): each head's softmax normaliser from the chunk stats, the
   group-summed probability max-pooled over units [r·j - 1, r·j + r - 1]; sink and window forced (+inf);
3. ``_aware_kernel`` (pair, block chunk): the query-aware set, by each block's rank among the valid
   blocks in (score desc, index asc) order, counted against every other valid block (exact on ties: the
   stable sort's order); rank < n_init + n_win + k_q; the agnostic keys with that set forced;
4. ``_selected_kernel`` (pair, block chunk): the selected set, rank < k, by the same counting;
5. ``_slot_map_kernel`` (pair): a slot whose block stays selected keeps it, the others are freed; the
   i-th missing block (block order) goes to the i-th free slot (slot order) for i < ``ranks``, written as
   the fetch list (host block row, slot row) for the UVA gather (kernels/gather.py), misses past
   ``ranks`` counted as dropped; then the attention's additive mask over slots and tail: 0 (or the
   eviction score, ED-DMA's logit bias) on resident tokens, -inf elsewhere.

Ranking by counting costs O(valid blocks) per block; at 32K context and block 64, 512 compares per
block, split over the block chunks' programs. Static shapes throughout, no host sync: a step stays
CUDA-graph capturable. Tensors are contiguous; shapes are those of nosa/device.py's SlotDecoder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_UNITS = 64  # compressed keys per phase-1 tile
BLOCK_BLOCKS = 64  # blocks per block-score program
RANK_ROWS = 32  # blocks ranked per program
RANK_COLS = 1024  # keys compared per load (the whole row up to 64K tokens at block 64)


@triton.jit
def _rank_below(keys, base, jj, kj, n_valid, BJ: tl.constexpr, BI: tl.constexpr):
    """For blocks jj [BJ] with keys kj: how many valid blocks i < n_valid outrank them by (key desc, index
    asc). keys + base: the pair's key row. BI keys per load: wide, so a row is one or two loads (the
    loop's load latency, not the compares, bounded a narrow version)."""
    rank = tl.zeros([BJ], dtype=tl.int32)
    for i0 in range(0, n_valid, BI):
        ii = i0 + tl.arange(0, BI)
        ki = tl.load(keys + base + ii, mask=ii < n_valid, other=float("-inf"))
        beats = (ki[None, :] > kj[:, None]) | ((ki[None, :] == kj[:, None]) & (ii[None, :] < jj[:, None]))
        beats = beats & (ii[None, :] < n_valid)
        rank += tl.sum(beats.to(tl.int32), axis=1)
    return rank


@triton.jit
def _frame(lengths, pid, kv_heads, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr):
    """The pair's sequence length, seen compressed keys and tail block."""
    length = tl.load(lengths + pid // kv_heads).to(tl.int32)
    n_seen = tl.where(length >= KERNEL, (length - KERNEL) // STRIDE + 1, 0)
    return length, n_seen, (length - 1) // BS


@triton.jit
def _logits_kernel(units, q, lengths, logits, stats, kv_heads, n_units_cap, n_chunks, scale,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                   KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr):
    """Program (pair, chunk): logits [G, BM] of the group's query heads against BM compressed keys (one
    dot, the keys read once), kept in scratch, and the chunk's max and sum of exp per head."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    mm = c * BM + tl.arange(0, BM)
    live = mm < n_seen
    neg = float("-inf")
    mx = tl.full([GP], neg, tl.float32)
    sm = tl.zeros([GP], tl.float32)
    if c * BM < n_seen:
        qv = tl.load(q + (pid.to(tl.int64) * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0).to(units.dtype.element_ty)
        u = tl.load(units + (pid.to(tl.int64) * n_units_cap + mm[:, None]) * D + d[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            s = tl.dot(qv, tl.trans(u), input_precision="ieee") * scale
        else:
            s = tl.dot(qv, tl.trans(u)) * scale
        s = tl.where(live[None, :], s, neg)
        tl.store(logits + (pid.to(tl.int64) * GP + g[:, None]) * n_units_cap + mm[None, :], s, mask=live[None, :])
        mx = tl.max(s, axis=1)
        sm = tl.sum(tl.exp(s - mx[:, None]), axis=1)
    row = (pid.to(tl.int64) * n_chunks + c) * GP + g
    tl.store(stats + 2 * row, mx)
    tl.store(stats + 2 * row + 1, sm)


@triton.jit
def _block_scores_kernel(logits, stats, lengths, key_q, kv_heads, n_units_cap, n_blocks, n_chunks, n_init, n_win,
                         G: tl.constexpr, GP: tl.constexpr, CP: tl.constexpr, BB: tl.constexpr, RATIO: tl.constexpr,
                         RP: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr):
    """Program (pair, block chunk): each head's softmax normaliser from the chunks' stats, then for blocks
    jj the group-summed probability max-pooled over units [r·j - 1, r·j + r - 1]; sink and window blocks
    forced to +inf. Blocks at or past the tail are not candidates and are left alone."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    jj = tl.program_id(1) * BB + tl.arange(0, BB)
    if tl.program_id(1) * BB < tail:
        neg = float("-inf")
        cc = tl.arange(0, CP)
        g = tl.arange(0, GP)
        at = ((pid.to(tl.int64) * n_chunks + cc[:, None]) * GP + g[None, :]) * 2
        c_ok = cc[:, None] < n_chunks
        cmx = tl.load(stats + at, mask=c_ok, other=neg)
        csm = tl.load(stats + at + 1, mask=c_ok, other=0.0)
        mx = tl.max(cmx, axis=0)
        shift = tl.where(mx == neg, 0.0, mx)
        total = tl.sum(csm * tl.exp(cmx - shift[None, :]), axis=0)  # [GP]
        t = tl.arange(0, RP)
        um = jj[:, None] * RATIO - 1 + t[None, :]
        ok = (t[None, :] <= RATIO) & (um >= 0) & (um < n_seen)
        p = tl.zeros([BB, RP], tl.float32)
        for h in tl.static_range(G):
            m_h = tl.sum(tl.where(g == h, shift, 0.0), axis=0)
            inv = tl.sum(tl.where(g == h, tl.where(total > 0, 1.0 / total, 0.0), 0.0), axis=0)
            lg = tl.load(logits + (pid.to(tl.int64) * GP + h) * n_units_cap + um, mask=ok, other=neg)
            p += tl.exp(lg - m_h) * inv
        sq = tl.max(tl.where(ok, p, neg), axis=1)
        forced = (jj < n_init) | (jj >= tail - n_win)
        tl.store(key_q + pid.to(tl.int64) * n_blocks + jj, tl.where(forced, float("inf"), sq), mask=jj < tail)


@triton.jit
def _aware_kernel(key_q, se, key_e, lengths, kv_heads, n_blocks, count_qa,
                  BB: tl.constexpr, BI: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr):
    """Program (pair, block chunk): the query-aware set (rank by query score < n_init + n_win + k_q) and
    the agnostic keys with it forced to +inf."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    jj = tl.program_id(1) * BB + tl.arange(0, BB)
    if tl.program_id(1) * BB < tail:
        row = pid.to(tl.int64) * n_blocks
        valid = jj < tail
        kj = tl.load(key_q + row + jj, mask=valid, other=float("-inf"))
        aware = valid & (_rank_below(key_q, row, jj, kj, tail, BB, BI) < count_qa)
        e = tl.load(se + row + jj, mask=valid, other=float("-inf"))
        tl.store(key_e + row + jj, tl.where(aware, float("inf"), e), mask=valid)


@triton.jit
def _selected_kernel(key_e, sel, in_map, lengths, kv_heads, n_blocks, k,
                     BB: tl.constexpr, BI: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr):
    """Program (pair, block chunk): the selected set (rank by the forced agnostic keys < k) over every block
    row (past the tail: unselected); in_map cleared for the slot-map kernel."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    jj = tl.program_id(1) * BB + tl.arange(0, BB)
    row = pid.to(tl.int64) * n_blocks
    valid = jj < tail
    chosen = valid
    if tl.program_id(1) * BB < tail:
        kj = tl.load(key_e + row + jj, mask=valid, other=float("-inf"))
        chosen = valid & (_rank_below(key_e, row, jj, kj, tail, BB, BI) < k)
    tl.store(sel + row + jj, chosen.to(tl.int8), mask=jj < n_blocks)
    tl.store(in_map + row + jj, tl.zeros([BB], tl.int8), mask=jj < n_blocks)


@triton.jit
def _slot_map_kernel(lengths, scores, slot_map, sel, in_map, free_slot, fetch_src, fetch_dst, mask, counters,
                     kv_heads, n_blocks, k, ranks, capacity,
                     BB: tl.constexpr, KP: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr,
                     BIAS: tl.constexpr):
    """Program (pair): slot map by set difference, the fetch list, the counters and the attention mask."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    row_b = pid.to(tl.int64) * n_blocks
    row_k = pid.to(tl.int64) * k
    row_r = pid.to(tl.int64) * ranks
    neg = float("-inf")
    s_ids = tl.arange(0, KP)
    r_ok = s_ids < ranks
    tl.store(fetch_src + row_r + s_ids, tl.full([KP], -1, tl.int64), mask=r_ok)
    tl.store(fetch_dst + row_r + s_ids, tl.full([KP], -1, tl.int64), mask=r_ok)

    # slots whose block stays selected keep it; the rest are freed, ranked in slot order
    s_live = s_ids < k
    old = tl.load(slot_map + row_k + s_ids, mask=s_live, other=-1)
    safe = tl.where(old >= 0, old, 0)
    still = tl.load(sel + row_b + safe, mask=s_live & (old >= 0), other=0)
    keep = s_live & (old >= 0) & (still != 0)
    tl.store(in_map + row_b + safe, tl.full([KP], 1, tl.int8), mask=keep)
    free = (s_live & ~keep).to(tl.int32)
    free_rank = tl.cumsum(free, axis=0) - free
    tl.store(free_slot + row_k + free_rank, s_ids, mask=free != 0)
    tl.store(slot_map + row_k + s_ids, tl.where(keep, old, -1), mask=s_live)
    tl.debug_barrier()  # the program's warps exchange in_map, free_slot and slot_map through memory

    # the i-th missing block (block order) -> the i-th free slot, for i < ranks; the rest are dropped
    carry = 0
    for j0 in range(0, tail, BB):
        jj = j0 + tl.arange(0, BB)
        valid = jj < tail
        chosen = tl.load(sel + row_b + jj, mask=valid, other=0)
        there = tl.load(in_map + row_b + jj, mask=valid, other=1)
        miss = (valid & (chosen != 0) & (there == 0)).to(tl.int32)
        rank = carry + tl.cumsum(miss, axis=0) - miss
        take = (miss != 0) & (rank < ranks)
        slot = tl.load(free_slot + row_k + rank, mask=take, other=0)
        tl.store(fetch_src + row_r + rank, row_b + jj, mask=take)
        tl.store(fetch_dst + row_r + rank, pid.to(tl.int64) * (k + 1) + slot, mask=take)
        tl.store(slot_map + row_k + slot, jj.to(tl.int64), mask=take)
        carry += tl.sum(miss, axis=0)
    tl.atomic_add(counters, tl.minimum(carry, ranks).to(tl.int64))
    tl.atomic_add(counters + 1, tl.maximum(carry - ranks, 0).to(tl.int64))
    tl.debug_barrier()

    # additive mask over the k slots and the tail slot: bias (or 0) on resident tokens, -inf elsewhere
    o = tl.arange(0, BS)
    width = (k + 1) * BS
    row_s = pid.to(tl.int64) * capacity
    for s0 in range(0, k, KP):
        ss = s0 + tl.arange(0, KP)
        blk = tl.load(slot_map + row_k + ss, mask=ss < k, other=-1)
        tok = tl.where(blk >= 0, blk, 0)[:, None] * BS + o[None, :]
        if BIAS:
            val = tl.load(scores + row_s + tok, mask=(blk >= 0)[:, None], other=0.0)
        else:
            val = tl.zeros([KP, BS], tl.float32)
        val = tl.where((blk >= 0)[:, None], val, neg)
        tl.store(mask + pid.to(tl.int64) * width + ss[:, None] * BS + o[None, :], val.to(mask.dtype.element_ty), mask=(ss < k)[:, None])
    seen = o <= (length - 1) % BS
    if BIAS:
        val = tl.load(scores + row_s + tail * BS + o, mask=seen, other=0.0)
    else:
        val = tl.zeros([BS], tl.float32)
    tl.store(mask + pid.to(tl.int64) * width + k * BS + o, tl.where(seen, val, neg).to(mask.dtype.element_ty))


class SelectScratch:
    """The kernel's per-(sequence, KV head) scratch rows and outputs, allocated once per decoder so that a
    step's launches keep static addresses (CUDA graphs). pairs = B · Hkv."""

    def __init__(self, pairs: int, group: int, n_units: int, n_blocks: int, k: int, block: int, dtype: torch.dtype, device):
        gp = max(16, triton.next_power_of_2(group))  # tl.dot's smallest tile side
        f32 = dict(dtype=torch.float32, device=device)
        self.logits = torch.empty(pairs, gp, max(n_units, 1), **f32)
        self.stats = torch.empty(pairs, triton.cdiv(max(n_units, 1), BLOCK_UNITS), gp, 2, **f32)  # per chunk and head: max, sum of exp
        self.key_q = torch.empty(pairs, n_blocks, **f32)
        self.key_e = torch.empty(pairs, n_blocks, **f32)
        self.sel = torch.zeros(pairs, n_blocks, dtype=torch.int8, device=device)
        self.in_map = torch.zeros(pairs, n_blocks, dtype=torch.int8, device=device)
        self.free_slot = torch.zeros(pairs, k, dtype=torch.int32, device=device)
        self.fetch = {r: (torch.empty(pairs * r, dtype=torch.int64, device=device), torch.empty(pairs * r, dtype=torch.int64, device=device))
                      for r in {0, k}}
        self.mask = torch.empty(pairs, (k + 1) * block, dtype=dtype, device=device)
        self.group_pad = gp

    def fits(self, pairs: int, group: int, n_units: int, n_blocks: int, k: int, block: int, dtype: torch.dtype) -> bool:
        """Whether a decoder of this shape can use these buffers."""
        return (self.logits.shape[::2] == (pairs, max(n_units, 1)) and self.sel.shape == (pairs, n_blocks) and self.free_slot.shape[1] == k
                and self.mask.shape[1] == (k + 1) * block and self.mask.dtype == dtype and self.group_pad == max(16, triton.next_power_of_2(group)))

    def nbytes(self) -> int:
        tensors = [self.logits, self.stats, self.key_q, self.key_e, self.sel, self.in_map, self.free_slot, self.mask]
        return sum(t.numel() * t.element_size() for t in tensors + [x for pair in self.fetch.values() for x in pair])

    def fetch_lists(self, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) int64 [pairs · ranks]: one pair of buffers per fetch-list length, kept for graphs."""
        if ranks not in self.fetch:
            pairs = self.sel.shape[0]
            device = self.sel.device
            self.fetch[ranks] = (torch.empty(pairs * ranks, dtype=torch.int64, device=device), torch.empty(pairs * ranks, dtype=torch.int64, device=device))
        return self.fetch[ranks]


def select_and_map(units: torch.Tensor, q: torch.Tensor, lengths: torch.Tensor, se: torch.Tensor, scores: torch.Tensor,
                   slot_map: torch.Tensor, counters: torch.Tensor, scratch: SelectScratch, *, block: int, k: int, k_q: int,
                   n_init: int, n_win: int, kernel: int, stride: int, ranks: int, scale: float, bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: selection (Eq. 3-5), slot map update, fetch list and attention mask for every
    (sequence, KV head).

    units [B, Hkv, M, D] compressed keys (cache dtype); q [B, Hq, D]; lengths long [B] (tokens including
    the step's); se float32 [B, Hkv, NB] frozen agnostic block scores; scores float32 [B, Hkv, capacity]
    per-token agnostic scores (the logit bias when ``bias``); slot_map long [B, Hkv, k] (block id or -1),
    updated in place; counters long [2] (+= fetched, dropped). Returns the fetch list (src, dst) int64
    [B · Hkv · ranks]: host block rows of the [B·Hkv·NB, block, D] store and slot rows of the
    [B·Hkv·(k+1), block, D] slot buffer, -1 where there is nothing to fetch. scratch.mask [B·Hkv,
    (k+1)·block] holds the attention mask and scratch.sel [B·Hkv, NB] the selected set afterwards.
    """
    batch, kv_heads, n_units, dim = units.shape
    group = q.shape[1] // kv_heads
    n_blocks = se.shape[-1]
    if block % stride or block // stride < 1:
        raise ValueError(f"block {block} must be a multiple of the pooling stride {stride}")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the fused selection, got {dim}")
    ratio = block // stride
    kp = triton.next_power_of_2(max(k, ranks, 1))
    src, dst = scratch.fetch_lists(ranks)
    pairs = batch * kv_heads
    cap_units, n_chunks = scratch.logits.shape[2], scratch.stats.shape[1]
    frame = dict(KERNEL=kernel, STRIDE=stride, BS=block)
    block_chunks = triton.cdiv(n_blocks, BLOCK_BLOCKS)
    rank_chunks, wide = triton.cdiv(n_blocks, RANK_ROWS), min(triton.next_power_of_2(n_blocks), RANK_COLS)
    _logits_kernel[(pairs, n_chunks)](units, q, lengths, scratch.logits, scratch.stats, kv_heads, cap_units, n_chunks, scale,
                                      G=group, GP=scratch.group_pad, D=dim, BM=BLOCK_UNITS, IEEE=units.dtype == torch.float32, **frame)
    _block_scores_kernel[(pairs, block_chunks)](scratch.logits, scratch.stats, lengths, scratch.key_q, kv_heads, cap_units, n_blocks, n_chunks,
                                                n_init, n_win, G=group, GP=scratch.group_pad, CP=triton.next_power_of_2(n_chunks),
                                                BB=BLOCK_BLOCKS, RATIO=ratio, RP=triton.next_power_of_2(ratio + 1), **frame)
    _aware_kernel[(pairs, rank_chunks)](scratch.key_q, se, scratch.key_e, lengths, kv_heads, n_blocks, n_init + n_win + k_q,
                                        BB=RANK_ROWS, BI=wide, **frame)
    _selected_kernel[(pairs, rank_chunks)](scratch.key_e, scratch.sel, scratch.in_map, lengths, kv_heads, n_blocks, k, BB=RANK_ROWS, BI=wide, **frame)
    _slot_map_kernel[(pairs,)](lengths, scores, slot_map, scratch.sel, scratch.in_map, scratch.free_slot, src, dst, scratch.mask, counters,
                               kv_heads, n_blocks, k, ranks, scores.shape[-1], BB=BLOCK_BLOCKS, KP=kp, BIAS=bias, **frame)
    return src, dst
