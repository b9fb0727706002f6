"""NOSA's per-step selection and slot map in one launch (paper 004 Eq. 3-5, nosa/selection.py's reading).

The torch path of a decode step (nosa/device.py) spends some 80 small launches per layer on selection:
query scores, block pooling, two stable sorts, the slot-map set difference, the attention mask. At batch
16 that fixed cost was most of an 8B step on an H200 (benchmarks/RESULTS.md). Here one program per
(sequence, KV head) runs every phase on data it alone owns, with scratch rows in global memory and a
barrier between phases (the program's warps exchange through them):

1. logits of the G query heads against the seen compressed keys (one ``tl.dot`` per tile, the keys read
   once at HBM rate), online max / sum per head; logits kept in scratch;
2. softmax per head, summed over the group -> per-unit probability;
3. max-pool to blocks over units [r·j - 1, r·j + r - 1]; sink and window blocks forced (+inf);
4. the query-aware set: rank of each valid block by (score desc, index asc), counted against every other
   valid block (exact on ties, the stable sort's order); rank < n_init + n_win + k_q;
5. the selected set: the same ranking of the frozen query-agnostic scores with the query-aware set forced,
   rank < k;
6. slot map by set difference: a slot whose block stays selected keeps it, the others are freed;
7. the i-th missing block (block order) goes to the i-th free slot (slot order) for i < ``ranks``; the fetch
   list (host block row, slot row) is written for the UVA gather (kernels/gather.py), misses past
   ``ranks`` are counted as dropped;
8. the attention's additive mask over slots and tail: 0 (or the eviction score, ED-DMA's logit bias) on
   resident tokens, -inf elsewhere.

Ranking by counting is O(valid blocks²) per program; at 32K context and block 64 that is 512² compares,
far below the bytes phase 1 reads. Static shapes throughout, no host sync: a step stays CUDA-graph
capturable. Tensors are contiguous; shapes are those of nosa/device.py's SlotDecoder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_UNITS = 64  # compressed keys per phase-1 tile
BLOCK_BLOCKS = 64  # blocks per ranking tile (both sides)


@triton.jit
def _rank_below(keys, base, jj, kj, n_valid, BB: tl.constexpr):
    """For blocks jj [BB] with keys kj: how many valid blocks i < n_valid outrank them by (key desc, index
    asc). keys + base: the program's key row."""
    rank = tl.zeros([BB], dtype=tl.int32)
    for i0 in range(0, n_valid, BB):
        ii = i0 + tl.arange(0, BB)
        ki = tl.load(keys + base + ii, mask=ii < n_valid, other=float("-inf"))
        beats = (ki[None, :] > kj[:, None]) | ((ki[None, :] == kj[:, None]) & (ii[None, :] < jj[:, None]))
        beats = beats & (ii[None, :] < n_valid)
        rank += tl.sum(beats.to(tl.int32), axis=1)
    return rank


@triton.jit
def _select_kernel(
    units, q, lengths, se, scores, slot_map,  # inputs; slot_map is updated in place
    logits, unit_p, key_q, key_e, sel, in_map, free_slot,  # per-program scratch rows
    fetch_src, fetch_dst, mask, counters,  # outputs
    kv_heads, n_units_cap, n_blocks, k, ranks, count_qa, n_init, n_win, capacity, scale,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr,
    RATIO: tl.constexpr, RP: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr,
    BIAS: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)  # b * kv_heads + h
    b = pid // kv_heads
    length = tl.load(lengths + b).to(tl.int32)
    n_seen = tl.where(length >= KERNEL, (length - KERNEL) // STRIDE + 1, 0)
    tail = (length - 1) // BS  # the block holding the current token: its own slot, outside the budget
    row_u = pid.to(tl.int64) * n_units_cap
    row_b = pid.to(tl.int64) * n_blocks
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    neg = float("-inf")

    # 1. logits [G, seen units], online max / sum per query head
    qv = tl.load(q + (pid.to(tl.int64) * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
    qv = qv.to(units.dtype.element_ty)
    mx = tl.full([GP], neg, tl.float32)
    sm = tl.zeros([GP], tl.float32)
    for m0 in range(0, n_seen, BM):
        mm = m0 + tl.arange(0, BM)
        live = mm < n_seen
        u = tl.load(units + (row_u + mm[:, None]) * D + d[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            s = tl.dot(qv, tl.trans(u), input_precision="ieee") * scale
        else:
            s = tl.dot(qv, tl.trans(u)) * scale
        s = tl.where(live[None, :], s, neg)
        tl.store(logits + (pid.to(tl.int64) * GP + g[:, None]) * n_units_cap + mm[None, :], s, mask=live[None, :])
        new = tl.maximum(mx, tl.max(s, axis=1))
        shift = tl.where(new == neg, 0.0, new)  # no unit yet: keep exp() away from -inf - -inf
        sm = sm * tl.exp(mx - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
        mx = new
    tl.debug_barrier()

    # 2. per-unit probability: softmax per head, summed over the group's real heads
    shift = tl.where(mx == neg, 0.0, mx)
    inv = tl.where(sm > 0, 1.0 / sm, 0.0)
    for m0 in range(0, n_seen, BM):
        mm = m0 + tl.arange(0, BM)
        live = mm < n_seen
        s = tl.load(logits + (pid.to(tl.int64) * GP + g[:, None]) * n_units_cap + mm[None, :],
                    mask=(g[:, None] < G) & live[None, :], other=neg)
        p = tl.sum(tl.exp(s - shift[:, None]) * inv[:, None], axis=0)
        tl.store(unit_p + row_u + mm, p, mask=live)
    tl.debug_barrier()

    # 3. block scores: max over units [r·j - 1, r·j + r - 1], sink and window forced
    t = tl.arange(0, RP)
    for j0 in range(0, tail, BB):
        jj = j0 + tl.arange(0, BB)
        um = jj[:, None] * RATIO - 1 + t[None, :]
        ok = (t[None, :] <= RATIO) & (um >= 0) & (um < n_seen)
        sq = tl.max(tl.load(unit_p + row_u + um, mask=ok, other=neg), axis=1)
        forced = (jj < n_init) | (jj >= tail - n_win)
        tl.store(key_q + row_b + jj, tl.where(forced, float("inf"), sq), mask=jj < tail)
    tl.debug_barrier()

    # 4. query-aware set by rank; the agnostic keys with it forced
    for j0 in range(0, tail, BB):
        jj = j0 + tl.arange(0, BB)
        valid = jj < tail
        kj = tl.load(key_q + row_b + jj, mask=valid, other=neg)
        aware = valid & (_rank_below(key_q, row_b, jj, kj, tail, BB) < count_qa)
        e = tl.load(se + row_b + jj, mask=valid, other=neg)
        tl.store(key_e + row_b + jj, tl.where(aware, float("inf"), e), mask=valid)
    tl.debug_barrier()

    # 5. selected set (every block row written: blocks past the tail are unselected); in_map cleared
    for j0 in range(0, n_blocks, BB):
        jj = j0 + tl.arange(0, BB)
        valid = jj < tail
        kj = tl.load(key_e + row_b + jj, mask=valid, other=neg)
        chosen = valid & (_rank_below(key_e, row_b, jj, kj, tail, BB) < k)
        tl.store(sel + row_b + jj, chosen.to(tl.int8), mask=jj < n_blocks)
        tl.store(in_map + row_b + jj, tl.zeros([BB], tl.int8), mask=jj < n_blocks)
    s_ids = tl.arange(0, KP)
    r_ok = s_ids < ranks
    tl.store(fetch_src + pid.to(tl.int64) * ranks + s_ids, tl.full([KP], -1, tl.int64), mask=r_ok)
    tl.store(fetch_dst + pid.to(tl.int64) * ranks + s_ids, tl.full([KP], -1, tl.int64), mask=r_ok)
    tl.debug_barrier()

    # 6. slots whose block stays selected keep it; the rest are freed, ranked in slot order
    s_live = s_ids < k
    old = tl.load(slot_map + pid.to(tl.int64) * k + s_ids, mask=s_live, other=-1)
    safe = tl.where(old >= 0, old, 0)
    still = tl.load(sel + row_b + safe, mask=s_live & (old >= 0), other=0)
    keep = s_live & (old >= 0) & (still != 0)
    tl.store(in_map + row_b + safe, tl.full([KP], 1, tl.int8), mask=keep)
    free = (s_live & ~keep).to(tl.int32)
    free_rank = tl.cumsum(free, axis=0) - free
    tl.store(free_slot + pid.to(tl.int64) * k + free_rank, s_ids, mask=free != 0)
    tl.store(slot_map + pid.to(tl.int64) * k + s_ids, tl.where(keep, old, -1), mask=s_live)
    tl.debug_barrier()

    # 7. the i-th missing block (block order) -> the i-th free slot, for i < ranks; the rest are dropped
    carry = 0
    for j0 in range(0, tail, BB):
        jj = j0 + tl.arange(0, BB)
        valid = jj < tail
        chosen = tl.load(sel + row_b + jj, mask=valid, other=0)
        there = tl.load(in_map + row_b + jj, mask=valid, other=1)
        miss = (valid & (chosen != 0) & (there == 0)).to(tl.int32)
        rank = carry + tl.cumsum(miss, axis=0) - miss
        take = (miss != 0) & (rank < ranks)
        slot = tl.load(free_slot + pid.to(tl.int64) * k + rank, mask=take, other=0)
        tl.store(fetch_src + pid.to(tl.int64) * ranks + rank, row_b + jj, mask=take)
        tl.store(fetch_dst + pid.to(tl.int64) * ranks + rank, pid.to(tl.int64) * (k + 1) + slot, mask=take)
        tl.store(slot_map + pid.to(tl.int64) * k + slot, jj.to(tl.int64), mask=take)
        carry += tl.sum(miss, axis=0)
    tl.atomic_add(counters, tl.minimum(carry, ranks).to(tl.int64))
    tl.atomic_add(counters + 1, tl.maximum(carry - ranks, 0).to(tl.int64))
    tl.debug_barrier()

    # 8. additive mask over the k slots and the tail slot: bias (or 0) on resident tokens, -inf elsewhere
    o = tl.arange(0, BS)
    width = (k + 1) * BS
    row_s = pid.to(tl.int64) * capacity
    for s0 in range(0, k, KP):
        ss = s0 + tl.arange(0, KP)
        blk = tl.load(slot_map + pid.to(tl.int64) * k + ss, mask=ss < k, other=-1)
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
        self.unit_p = torch.empty(pairs, max(n_units, 1), **f32)
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
        return (self.unit_p.shape == (pairs, max(n_units, 1)) and self.sel.shape == (pairs, n_blocks) and self.free_slot.shape[1] == k
                and self.mask.shape[1] == (k + 1) * block and self.mask.dtype == dtype and self.group_pad == max(16, triton.next_power_of_2(group)))

    def nbytes(self) -> int:
        tensors = [self.logits, self.unit_p, self.key_q, self.key_e, self.sel, self.in_map, self.free_slot, self.mask]
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
    _select_kernel[(pairs,)](
        units, q, lengths, se, scores, slot_map,
        scratch.logits, scratch.unit_p, scratch.key_q, scratch.key_e, scratch.sel, scratch.in_map, scratch.free_slot,
        src, dst, scratch.mask, counters,
        kv_heads, scratch.unit_p.shape[1], n_blocks, k, ranks, n_init + n_win + k_q, n_init, n_win, scores.shape[-1], scale,
        G=group, GP=scratch.group_pad, D=dim, BM=BLOCK_UNITS, BB=BLOCK_BLOCKS, KP=kp, RATIO=ratio,
        RP=triton.next_power_of_2(ratio + 1), KERNEL=kernel, STRIDE=stride, BS=block, BIAS=bias,
        IEEE=units.dtype == torch.float32, num_warps=4,
    )
    return src, dst
