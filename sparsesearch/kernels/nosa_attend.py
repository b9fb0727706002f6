"""NOSA decode attention over the slots, fetching missed blocks from pinned memory inside the kernel.

After the slot map kernel (kernels/nosa_select.py) a step's selected blocks are either resident in their
device slot or were just assigned a free slot and still live only in the host store. The torch-era step
gathered the latter into their slots (two UVA launches) and then ran SDPA with an additive mask built
from the slot map. Here one launch does both, split along the slots (flash-decoding):

* program (pair, split) walks its share of the k + 1 slots (the tail block is slot k); a slot with a
  pending fetch (``fetch_from`` >= 0: its host block row) is read straight from pinned memory through UVA
  and written to its slot for later steps, every other slot from HBM. The PCIe reads of the few programs
  that miss overlap the HBM reads of all the others: the transfer is hidden behind the step's attention
  instead of running before it;
* the query rows are the G heads of the KV head's group (one K/V read serves the group; padded to 16
  rows for ``tl.dot``); validity and the eviction bias (proxy ``trained``: the per-token score is
  ED-DMA's additive logit bias) come from the slot map and the score row, so no mask tensor exists;
* a second launch merges the splits' partial outputs by their log-sum-exp (skipped with one split).

Shapes are those of runtime/nosa_device.py's SlotDecoder; every tensor contiguous; no host sync, so a step stays
CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, dot_f32, fill_splits, group_rows, sm_count

NUM_WARPS = 4  # launch settings of the slot attention (benchmarks/nosa_attend.py sweeps them)
NUM_STAGES = 2


@triton.jit
def _slot_attend_kernel(q, slots_k, slots_v, keys_host, values_host, slot_map, fetch_from, scores, lengths, out, part_acc, part_ml,
                        kv_heads, k, capacity, per_split, n_splits, qk_scale,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BIAS: tl.constexpr,
                        SPLIT: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """Program (pair, split): online softmax of the group's G query rows over slots [split·per_split,
    +per_split) of the pair's k + 1; the partial (acc, max, sum) to scratch, or the output with one split."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    length = tl.load(lengths + pid // kv_heads).to(tl.int32)
    tail = (length - 1) // BS
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    o = tl.arange(0, BS)
    row_q = (pid.to(tl.int64) * G + g) * D
    qv = tl.load(q + row_q[:, None] + d[None, :], mask=g[:, None] < G, other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    tile = o[:, None] * D + d[None, :]
    s_lo = sp * per_split
    s_hi = tl.minimum(s_lo + per_split, k + 1)
    for s in range(s_lo, s_hi):
        # Per-slot branches, not masked loads: a branch-free body (masked loads of both the slot and the host
        # row, selected by where) ran at 1.1 TB/s where this one runs at 3.0 (H200, batch 16).
        is_tail = s == k
        blk = tl.load(slot_map + pid.to(tl.int64) * k + s, mask=s < k, other=-1)
        blk = tl.where(is_tail, tail, blk)
        if blk >= 0:
            src = tl.load(fetch_from + pid.to(tl.int64) * k + s, mask=s < k, other=-1)
            at = (pid.to(tl.int64) * (k + 1) + s) * (BS * D)
            if src >= 0:  # assigned this step: read it over PCIe and keep it in its slot
                kt = tl.load(keys_host + src * (BS * D) + tile)
                vt = tl.load(values_host + src * (BS * D) + tile)
                tl.store(slots_k + at + tile, kt)
                tl.store(slots_v + at + tile, vt)
            else:
                kt = tl.load(slots_k + at + tile)
                vt = tl.load(slots_v + at + tile)
            n_ok = tl.where(is_tail, (length - 1) % BS + 1, BS)
            if DOT_F32:
                qk = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)))
            elif IEEE:  # float32 caches: full-precision dots, as the torch path (TF32 was 6e-4 off on an H200)
                qk = tl.dot(qv, tl.trans(kt), input_precision="ieee")
            else:
                qk = tl.dot(qv, tl.trans(kt))
            qk = qk * qk_scale
            if BIAS:  # natural-log bias -> the log2 domain of the softmax below
                qk += tl.load(scores + pid.to(tl.int64) * capacity + blk.to(tl.int64) * BS + o)[None, :] * 1.4426950408889634
            qk = tl.where((o < n_ok)[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: a live slot has at least one token
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32))
            elif IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    if SPLIT:
        row_p = (pid.to(tl.int64) * n_splits + sp) * GP + g
        tl.store(part_acc + row_p[:, None] * D + d[None, :], acc)
        tl.store(part_ml + 2 * row_p, m_i)
        tl.store(part_ml + 2 * row_p + 1, l_i)
    else:
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + row_q[:, None] + d[None, :], res.to(out.dtype.element_ty), mask=g[:, None] < G)


@triton.jit
def _merge_kernel(part_acc, part_ml, out, n_splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """Program (pair): the splits' partials merged by log-sum-exp (splits with nothing seen: max -inf,
    weight 0)."""
    pid = tl.program_id(0)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    top = tl.full([GP], float("-inf"), tl.float32)
    for s in range(n_splits):
        top = tl.maximum(top, tl.load(part_ml + 2 * ((pid.to(tl.int64) * n_splits + s) * GP + g)))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for s in range(n_splits):
        row = (pid.to(tl.int64) * n_splits + s) * GP + g
        w = tl.math.exp2(tl.load(part_ml + 2 * row) - shift)
        total += w * tl.load(part_ml + 2 * row + 1)
        acc += w[:, None] * tl.load(part_acc + row[:, None] * D + d[None, :])
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out + ((pid.to(tl.int64) * G + g) * D)[:, None] + d[None, :], res.to(out.dtype.element_ty), mask=g[:, None] < G)


def default_splits(pairs: int, slots: int, device: torch.device) -> int:
    """Splits along the slots so that pairs x splits programs fill the GPU about twice (a small batch
    would otherwise leave most SMs idle); 1 where the pairs alone do, or on a CPU."""
    if device.type != "cuda":
        return 1
    return fill_splits(pairs, slots, sm_count(device.index if device.index is not None else torch.cuda.current_device()))


class AttendScratch:
    """The split partials (float32), allocated once per decoder shape so a step keeps static addresses."""

    def __init__(self, pairs: int, splits: int, group_pad: int, dim: int, device):
        self.splits = splits
        self.acc = torch.empty(pairs, splits, group_pad, dim, dtype=torch.float32, device=device)
        self.ml = torch.empty(pairs, splits, group_pad, 2, dtype=torch.float32, device=device)


def shape_refusal(block: int) -> str | None:
    """Why the slot attention cannot serve this block size (None: it can): a block is one key tile."""
    if block < 16 or block & (block - 1):
        return f"the slot attention takes a power-of-two block >= 16, got {block}"
    return None


def slot_attend(q: torch.Tensor, slots_k: torch.Tensor, slots_v: torch.Tensor, keys_host: torch.Tensor, values_host: torch.Tensor,
                slot_map: torch.Tensor, fetch_from: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, scratch: AttendScratch,
                *, block: int, scale: float, bias: bool, out: torch.Tensor | None = None,
                num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """Attention of the step's query over every resident slot and the tail, fetching pending blocks.

    q [B, Hq, D]; slots_k/v [B, Hkv, (k+1)·block, D] (device); keys_host/values_host [B, Hkv, capacity, D]
    (pinned); slot_map long [B, Hkv, k] (block id or -1, as updated this step); fetch_from long [B·Hkv, k]
    (host block row of a slot assigned this step, else -1); scores float32 [B, Hkv, capacity] (the logit
    bias when ``bias``); lengths long [B] (tokens including the step's). Returns [B, Hq, D] in q's dtype.
    """
    batch, q_heads, dim = q.shape
    kv_heads, k = slot_map.shape[1], slot_map.shape[2]
    group = q_heads // kv_heads
    pairs = batch * kv_heads
    why = shape_refusal(block)
    if why is not None:
        raise ValueError(why)
    gp = group_rows(group)
    if scratch.acc.shape[0] != pairs or scratch.acc.shape[2:] != (gp, dim):
        raise ValueError(f"attention scratch made for {tuple(scratch.acc.shape)}, the step needs pairs {pairs}, rows {gp}, head_dim {dim}")
    splits = scratch.splits
    per_split = -(-(k + 1) // splits)
    out = torch.empty_like(q) if out is None else out
    _slot_attend_kernel[(pairs, splits)](q, slots_k, slots_v, keys_host, values_host, slot_map, fetch_from, scores, lengths, out,
                                         scratch.acc, scratch.ml, kv_heads, k, scores.shape[-1], per_split, splits, scale * LOG2E,
                                         G=group, GP=gp, D=dim, BS=block, BIAS=bias, SPLIT=splits > 1, DOT_F32=dot_f32(q.dtype),
                                         IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _merge_kernel[(pairs,)](scratch.acc, scratch.ml, out, splits, G=group, GP=gp, D=dim)
    return out
