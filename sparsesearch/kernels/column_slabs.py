"""Column slabs: the K/V rows of a column table's slots, copied once per launch into contiguous slabs.

A vertical-slash index gathers thousands of single key columns per query block (index.ColumnTable states
them as slots of one ascending table per head). Gathered token by token, each tile of columns costs a
row address per thread and cannot be a bulk copy; that held vertical-heavy indexes at 0.45 efficiency
(benchmarks/RESULTS.md). Copying each index head's slots once into a contiguous [V, D] slab (a few MB)
lets block_sparse read them as plain tiles — TMA copies on Hopper — like full key blocks.

One program copies TILE slots of one index head, K and V, in one launch (no index arithmetic on the
host). Slot ids out of [0, kv_len) are clamped (a padded slot's id is 0, and a malformed one must not
read out of bounds); the kernel masks unused slots anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..index import ColumnTable
from ._common import block_d

TILE = 32  # slots per program: 32 rows x d=128 bf16 = 8 KiB of K and of V


@triton.jit(do_not_specialize=("n_slots", "kv_len", "heads", "group", "stride_ib", "stride_ih"))
def _column_slabs(
    K, V, IDS, HEAD_MAP, KC, VC, n_slots, kv_len, heads, group,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ib, stride_ih,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, USE_HEAD_MAP: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    # Index row h reads the KV head of its query head (group > 1: a query-space index) or its own KV head.
    src = tl.load(HEAD_MAP + h) if USE_HEAD_MAP else h
    kv_h = src // group
    slots = tile * TILE + tl.arange(0, TILE)
    live = slots < n_slots
    ids = tl.load(IDS + b.to(tl.int64) * stride_ib + h.to(tl.int64) * stride_ih + slots, mask=live, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), kv_len - 1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = live[:, None] & (offs_d[None, :] < HEAD_DIM)
    out = (bh.to(tl.int64) * n_slots + slots)[:, None] * HEAD_DIM + offs_d[None, :]
    k_rows = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + ids[:, None] * stride_kn + offs_d[None, :]
    tl.store(KC + out, tl.load(k_rows, mask=ok, other=0.0), mask=ok)
    v_rows = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + ids[:, None] * stride_vn + offs_d[None, :]
    tl.store(VC + out, tl.load(v_rows, mask=ok, other=0.0), mask=ok)


def column_slabs(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, heads: torch.Tensor | None, group: int,
                 batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows of every index head's table slots as two contiguous slabs [B, H, V, D].

    k/v [B, Hkv, N, D] (last dim contiguous); ids int32 [B or 1 (stride 0), H, V] (ColumnTable.ids); heads: the
    launch's head map (index row i is head heads[i] of the index's space) or None; group: query heads per
    KV head for a query-space index, 1 for a kv-space one.
    """
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    n_heads, n_slots = ids.shape[1], ids.shape[2]
    head_dim = k.shape[-1]
    kc = k.new_empty(batch, n_heads, n_slots, head_dim)
    vc = v.new_empty(batch, n_heads, n_slots, head_dim)
    if n_slots == 0 or batch == 0:
        return kc, vc
    _column_slabs[(triton.cdiv(n_slots, TILE), batch * n_heads)](
        k, v, ids, heads if heads is not None else ids, kc, vc, n_slots, k.shape[2], n_heads, group,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ids.stride(0), ids.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), TILE=TILE, USE_HEAD_MAP=heads is not None, num_warps=4,
    )
    return kc, vc


def table_operands(table: ColumnTable) -> tuple[ColumnTable, tuple[int, ...]]:
    """The table as the block-sparse kernels read it, and its 8 strides in their argument order: ids (batch, head),
    bits (batch, head, query block), clean and span (batch, head, query block; one stride set for both, so they
    are made contiguous when they differ)."""
    if table.clean.stride() != table.span.stride():
        table = table.map(lambda _, t: t.contiguous())
    return table, (*table.ids.stride()[:2], *table.bits.stride()[:3], *table.clean.stride())
