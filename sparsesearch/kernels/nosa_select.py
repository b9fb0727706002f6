"""NOSA's per-step selection and slot map in four launches (paper 004 Eq. 3-5, runtime/nosa_selection.py's reading).

The torch path of a decode step (runtime/nosa_device.py) spends some 80 small launches per layer on selection:
query scores, block pooling, two stable sorts, the slot-map set difference, the attention mask. At batch
16 that fixed cost was most of an 8B step on an H200 (benchmarks/RESULTS.md). Here every phase is one
launch over (sequence, KV head) pairs and, where the phase allows, chunks of units or blocks, so that a
small batch still fills the GPU (one program per pair ran the phases one after another: 180 µs per
layer at 32K, batch 16, on an H200):

1. ``_logits_kernel`` (pair, unit chunk): logits of the G query heads against BM compressed keys (one
   ``tl.dot``, the keys read once), kept in scratch, with the chunk's max and sum of exp per head;
2. ``_block_scores_kernel`` (pair, block chunk): each head's softmax normaliser from the chunk stats, the
   group-summed probability max-pooled over units [r·j - 1, r·j + r - 1]; sink and window forced (+inf);
3. ``_select_kernel`` (pair): the query-aware set (the n_init + n_win + k_q best query scores, sink and
   window forced), then the selected set (the k best agnostic scores with it forced), both by
   ``_top_mask``: keys in float order as int32, a 32-step bisection for the count-th largest, ties to
   the lower block index (the stable sort's order); the block row is held in registers;
4. ``_slot_map_kernel`` (pair): a slot whose block stays selected keeps it, the others are freed; the
   i-th missing block (block order) goes to the i-th free slot (slot order) for i < ``ranks``, written as
   the fetch list (host block row, slot row) for the UVA gather (kernels/gather.py), misses past
   ``ranks`` counted as dropped; per slot, the host row it is to be filled from (kernels/nosa_attend.py
   reads it there, fetching inside the attention); for SDPA, the attention's additive mask over slots and
   tail: 0 (or the eviction score, ED-DMA's logit bias) on resident tokens, -inf elsewhere.

Ranking by counting every other block (O(blocks²) per pair) took 30-60 µs per launch at 32K and batch
16 on an H200 and grew with the batch; the bisection is O(32 · blocks). Static shapes throughout, no
host sync: a step stays CUDA-graph capturable. Tensors are contiguous; shapes are those of runtime/nosa_device.py's SlotDecoder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import group_rows

BLOCK_UNITS = 64  # compressed keys per phase-1 tile
BLOCK_BLOCKS = 64  # blocks per block-score program
SELECT_WARPS = 8  # the top-k program's warps: its 64 bisection steps are reductions over the block row (H200, 32K, batch 16: 2 warps 47 µs, 4 21, 8 15, 16 17)


@triton.jit
def _top_mask(key, valid, count, NBP: tl.constexpr):
    """The ``count`` best valid entries of key [NBP] by (key desc, index asc): bool [NBP], exact on ties.

    Keys map to int32 in float order; a 32-step bisection finds the count-th largest, T; every key above T
    is in, and of the keys equal to T the lowest indices fill what is left (the stable sort's order).
    O(32 x NBP) per row, where ranking by counting was O(NBP²)."""
    bits = key.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # int order = float order (no NaN here)
    lo = tl.full([], -2147483648, tl.int64)  # every valid key is >= lo
    hi = tl.full([], 2147483648, tl.int64)  # no key is >= hi
    for _ in tl.static_range(32):
        mid = (lo + hi) // 2
        enough = tl.sum((valid & (ordered >= mid)).to(tl.int32), axis=0) >= count
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    above = valid & (ordered > lo)
    tie = (valid & (ordered == lo)).to(tl.int32)
    room = count - tl.sum(above.to(tl.int32), axis=0)
    return above | ((tie != 0) & (tl.cumsum(tie, axis=0) - tie < room))


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
def _select_kernel(key_q, se, sel, in_map, lengths, kv_heads, n_blocks, count_qa, k,
                   NBP: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr):
    """Program (pair): the query-aware set (the n_init + n_win + k_q best query scores, sink and window
    forced), then the selected set (the k best agnostic scores with the query-aware set forced), over
    every block row (past the tail: unselected); in_map cleared for the slot-map kernel."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    jj = tl.arange(0, NBP)
    row = pid.to(tl.int64) * n_blocks
    valid = jj < tail
    aware = _top_mask(tl.load(key_q + row + jj, mask=valid, other=float("-inf")), valid, count_qa, NBP)
    e = tl.where(aware, float("inf"), tl.load(se + row + jj, mask=valid, other=float("-inf")))
    chosen = _top_mask(e, valid, k, NBP)
    tl.store(sel + row + jj, chosen.to(tl.int8), mask=jj < n_blocks)
    tl.store(in_map + row + jj, tl.zeros([NBP], tl.int8), mask=jj < n_blocks)


@triton.jit
def _slot_map_kernel(lengths, scores, slot_map, sel, in_map, free_slot, fetch_src, fetch_dst, fetch_from, mask, counters,
                     kv_heads, n_blocks, k, ranks, capacity,
                     BB: tl.constexpr, KP: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, BS: tl.constexpr,
                     BIAS: tl.constexpr, MASK: tl.constexpr):
    """Program (pair): slot map by set difference, the fetch list (and per slot: the host row it is to
    be filled from, for kernels/nosa_attend.py), the counters and, with MASK, the attention mask."""
    pid = tl.program_id(0)
    length, n_seen, tail = _frame(lengths, pid, kv_heads, KERNEL, STRIDE, BS)
    row_b = pid.to(tl.int64) * n_blocks
    row_k = pid.to(tl.int64) * k
    row_r = pid.to(tl.int64) * ranks
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
    tl.store(fetch_from + row_k + s_ids, tl.full([KP], -1, tl.int64), mask=s_live)
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
        tl.store(fetch_from + row_k + slot, row_b + jj, mask=take)
        carry += tl.sum(miss, axis=0)
    tl.atomic_add(counters, tl.minimum(carry, ranks).to(tl.int64))
    tl.atomic_add(counters + 1, tl.maximum(carry - ranks, 0).to(tl.int64))
    if MASK:
        tl.debug_barrier()
        _write_mask(scores, slot_map, mask, pid, k, capacity, length, tail, KP, BS, BIAS)


@triton.jit
def _write_mask(scores, slot_map, mask, pid, k, capacity, length, tail, KP: tl.constexpr, BS: tl.constexpr, BIAS: tl.constexpr):
    """The pair's additive attention mask over the k slots and the tail slot (for SDPA), from its updated
    slot map: the bias (or 0) on resident tokens, -inf elsewhere."""
    row_k = pid.to(tl.int64) * k
    neg = float("-inf")
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
        gp = group_rows(group)
        f32 = dict(dtype=torch.float32, device=device)
        self.logits = torch.empty(pairs, gp, max(n_units, 1), **f32)
        self.stats = torch.empty(pairs, triton.cdiv(max(n_units, 1), BLOCK_UNITS), gp, 2, **f32)  # per chunk and head: max, sum of exp
        self.key_q = torch.empty(pairs, n_blocks, **f32)
        self.sel = torch.zeros(pairs, n_blocks, dtype=torch.int8, device=device)
        self.in_map = torch.zeros(pairs, n_blocks, dtype=torch.int8, device=device)
        self.free_slot = torch.zeros(pairs, k, dtype=torch.int32, device=device)
        self.fetch_from = torch.full((pairs, k), -1, dtype=torch.int64, device=device)
        self.mask = torch.empty(pairs, (k + 1) * block, dtype=dtype, device=device)
        self.group_pad = gp
        self.fetch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fetch_lists(k)  # a block start's list, before any graph capture

    def fits(self, pairs: int, group: int, n_units: int, n_blocks: int, k: int, block: int, dtype: torch.dtype) -> bool:
        """Whether a decoder of this shape can use these buffers."""
        return (self.logits.shape[::2] == (pairs, max(n_units, 1)) and self.sel.shape == (pairs, n_blocks) and self.free_slot.shape[1] == k
                and self.mask.shape[1] == (k + 1) * block and self.mask.dtype == dtype and self.group_pad == group_rows(group))

    def fetch_lists(self, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) int64 [pairs · ranks]: one pair of buffers per fetch-list length, kept for graphs."""
        if ranks not in self.fetch:
            pairs = self.sel.shape[0]
            device = self.sel.device
            self.fetch[ranks] = (torch.empty(pairs * ranks, dtype=torch.int64, device=device), torch.empty(pairs * ranks, dtype=torch.int64, device=device))
        return self.fetch[ranks]


def shape_refusal(dim: int, block: int, stride: int) -> str | None:
    """Why the fused selection cannot serve this shape (None: it can)."""
    if block % stride or block // stride < 1:
        return f"block {block} must be a multiple of the pooling stride {stride}"
    if dim < 16 or dim & (dim - 1):
        return f"head_dim must be a power of two >= 16 for the fused selection, got {dim}"
    return None


def select_and_map(units: torch.Tensor, q: torch.Tensor, lengths: torch.Tensor, se: torch.Tensor, scores: torch.Tensor,
                   slot_map: torch.Tensor, counters: torch.Tensor, scratch: SelectScratch, *, block: int, k: int, k_q: int,
                   n_init: int, n_win: int, kernel: int, stride: int, ranks: int, scale: float, bias: bool,
                   mask: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: selection (Eq. 3-5), slot map update, fetch list and attention mask for every
    (sequence, KV head).

    units [B, Hkv, M, D] compressed keys (cache dtype); q [B, Hq, D]; lengths long [B] (tokens including
    the step's); se float32 [B, Hkv, NB] frozen agnostic block scores; scores float32 [B, Hkv, capacity]
    per-token agnostic scores (the logit bias when ``bias``); slot_map long [B, Hkv, k] (block id or -1),
    updated in place; counters long [2] (+= fetched, dropped). Returns the fetch list (src, dst) int64
    [B · Hkv · ranks]: host block rows of the [B·Hkv·NB, block, D] store and slot rows of the
    [B·Hkv·(k+1), block, D] slot buffer, -1 where there is nothing to fetch; scratch.fetch_from [B·Hkv, k]
    holds the same per slot (kernels/nosa_attend.py fetches from it). With ``mask``, scratch.mask [B·Hkv,
    (k+1)·block] holds the attention mask (for SDPA); scratch.sel [B·Hkv, NB] the selected set afterwards.
    """
    batch, kv_heads, n_units, dim = units.shape
    group = q.shape[1] // kv_heads
    n_blocks = se.shape[-1]
    why = shape_refusal(dim, block, stride)
    if why is not None:
        raise ValueError(why)
    ratio = block // stride
    kp = triton.next_power_of_2(max(k, ranks, 1))
    src, dst = scratch.fetch_lists(ranks)
    pairs = batch * kv_heads
    cap_units, n_chunks = scratch.logits.shape[2], scratch.stats.shape[1]
    frame = dict(KERNEL=kernel, STRIDE=stride, BS=block)
    block_chunks = triton.cdiv(n_blocks, BLOCK_BLOCKS)
    _logits_kernel[(pairs, n_chunks)](units, q, lengths, scratch.logits, scratch.stats, kv_heads, cap_units, n_chunks, scale,
                                      G=group, GP=scratch.group_pad, D=dim, BM=BLOCK_UNITS, IEEE=units.dtype == torch.float32, **frame)
    _block_scores_kernel[(pairs, block_chunks)](scratch.logits, scratch.stats, lengths, scratch.key_q, kv_heads, cap_units, n_blocks, n_chunks,
                                                n_init, n_win, G=group, GP=scratch.group_pad, CP=triton.next_power_of_2(n_chunks),
                                                BB=BLOCK_BLOCKS, RATIO=ratio, RP=triton.next_power_of_2(ratio + 1), **frame)
    _select_kernel[(pairs,)](scratch.key_q, se, scratch.sel, scratch.in_map, lengths, kv_heads, n_blocks, n_init + n_win + k_q, k,
                             NBP=triton.next_power_of_2(n_blocks), num_warps=SELECT_WARPS, **frame)
    _slot_map_kernel[(pairs,)](lengths, scores, slot_map, scratch.sel, scratch.in_map, scratch.free_slot, src, dst, scratch.fetch_from,
                               scratch.mask, counters, kv_heads, n_blocks, k, ranks, scores.shape[-1], BB=BLOCK_BLOCKS, KP=kp, BIAS=bias,
                               MASK=mask, **frame)
    return src, dst
