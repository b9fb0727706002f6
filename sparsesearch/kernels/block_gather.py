"""Copy whole KV blocks from the host store into GPU slots: NOSI's missed-block fetch (paper 004 App. D).

One program per (copied block, chunk of its elements) reads the block's K and V straight from the source
(pinned host memory read through UVA on a GPU; a host tensor under TRITON_INTERPRET=1) and writes its slot.
A block of one (sequence, KV head) is ``block * head_dim`` contiguous elements in both layouts:

    store: [B, Hkv, capacity, D]     block j of (b, h) starts at ((b * Hkv + h) * capacity + j * block) * D
    slots: [B, Hkv, k, block, D]     slot s of (b, h) starts at ((b * Hkv + h) * k + s) * block * D

The launcher takes the (b, h, block, slot) lists of the misses; ``gather_blocks_torch`` is its torch twin
(the test oracle and the fallback where Triton cannot read the source).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024


@triton.jit
def _copy_blocks(src_k, src_v, dst_k, dst_v, src_off, dst_off, ELEMS: tl.constexpr, CHUNK_: tl.constexpr):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    s = tl.load(src_off + pid)
    d = tl.load(dst_off + pid)
    offs = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    ok = offs < ELEMS
    tl.store(dst_k + d + offs, tl.load(src_k + s + offs, mask=ok), mask=ok)
    tl.store(dst_v + d + offs, tl.load(src_v + s + offs, mask=ok), mask=ok)


def _offsets(store: torch.Tensor, slots: torch.Tensor, b, h, blocks, slot_ids):
    batch, kv_heads, capacity, dim = store.shape
    k, block = slots.shape[2], slots.shape[3]
    src = ((b * kv_heads + h) * capacity + blocks * block) * dim
    dst = ((b * kv_heads + h) * k + slot_ids) * block * dim
    return src.long(), dst.long()


def check_gather(store_k, store_v, slots_k, slots_v, blocks) -> None:
    if store_k.shape != store_v.shape or slots_k.shape != slots_v.shape:
        raise ValueError(f"K and V must match: store {tuple(store_k.shape)} vs {tuple(store_v.shape)}, slots {tuple(slots_k.shape)} vs {tuple(slots_v.shape)}")
    if store_k.dtype != slots_k.dtype:
        raise ValueError(f"store dtype {store_k.dtype} != slot dtype {slots_k.dtype}")
    if not (store_k.is_contiguous() and store_v.is_contiguous() and slots_k.is_contiguous() and slots_v.is_contiguous()):
        raise ValueError("store and slots must be contiguous")
    if blocks.numel() and (int(blocks.max()) + 1) * slots_k.shape[3] > store_k.shape[2]:
        raise ValueError(f"block {int(blocks.max())} lies past the store's capacity {store_k.shape[2]}")


def gather_blocks(store_k, store_v, slots_k, slots_v, b, h, blocks, slot_ids) -> None:
    """slots[b, h, slot] <- store[b, h, block * B : (block + 1) * B] for every listed miss (in place).

    store_*: [B, Hkv, capacity, D]; slots_*: [B, Hkv, k, block, D]; b, h, blocks, slot_ids: long [n]."""
    check_gather(store_k, store_v, slots_k, slots_v, blocks)
    if blocks.numel() == 0:
        return
    src, dst = _offsets(store_k, slots_k, b, h, blocks, slot_ids)
    elems = slots_k.shape[3] * slots_k.shape[4]
    grid = (blocks.numel(), triton.cdiv(elems, CHUNK))
    _copy_blocks[grid](store_k, store_v, slots_k, slots_v, src.to(slots_k.device), dst.to(slots_k.device), ELEMS=elems, CHUNK_=CHUNK)


def gather_blocks_torch(store_k, store_v, slots_k, slots_v, b, h, blocks, slot_ids) -> None:
    """The torch twin of ``gather_blocks`` (same arguments, same result)."""
    check_gather(store_k, store_v, slots_k, slots_v, blocks)
    block = slots_k.shape[3]
    rows = blocks[:, None] * block + torch.arange(block, device=blocks.device)[None, :]  # [n, block]
    for store, slots in ((store_k, slots_k), (store_v, slots_v)):
        slots[b, h, slot_ids] = store[b[:, None], h[:, None], rows].to(slots.device)
