"""SPAVA's approximate attention on one rank of a torch.distributed group (paper 001 §3.3, App. A, B.4).

Rank r holds q/k/v of its local sequence [anchor ; block_a ; block_b ; query] (layout.py: block_a is
virtual host r, block_b is 2W-1-r), all post-RoPE with global positions. Per call:

1. passing selection: score each local block's keys against the mean query vector (over query tokens
   and the GQA group), max-pool width 5, top-p per KV head -> P_a, P_b [B, Hkv, p, 2D] (K‖V);
2. both selections all-gathered asynchronously while
3. the query partial runs: query rows over [anchor slice r ; block_a ; block_b] without a causal mask
   (the query follows every context token), plus the query's own keys causally on rank 0; its
   (out, lse) all-gathered asynchronously too;
4. anchor rows: causal over the anchor; block_a rows: bottom-right causal over
   [passing of vhosts < r ; anchor ; block_a] (after P_a arrives);
5. block_b rows likewise over [passing of vhosts < 2W-1-r ; anchor ; block_b] (after P_b arrives);
6. query partials merged by lse over the W ranks (sparsesearch.merge; an empty shard has lse = -inf).

With one process every collective is a copy and the result is dense attention over
[anchor ; block_0 ; block_1 ; query] with block_1 seeing the passing of block_0 only — approximate
unless p covers block_0; the W = 1 path is the same code (STYLE habit 14).

The attention math is plain torch, chunked over rows (sparsesearch.reference.masked_attention): no
n x n matrix is held at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..merge import merge_partials, merge_two
from ..reference import causal_mask_fn, masked_attention
from .layout import Layout

POOL = 5  # max-pool width over key scores (APB / SPAVA code: kernel 5, stride 1, padding 2)
QUERY_OWNER = 0  # the rank whose query partial includes the query's own keys
# torch >= 2.12 renames all_gather_into_tensor to all_gather_single (the old name warns); GPU hosts run 2.11.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def query_mean(q_query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean query vector per KV head: q_query [B, Hq, q, D] -> fp32 [B, Hkv, D] (mean over tokens and group)."""
    b, hq, n, d = q_query.shape
    return q_query.float().contiguous().view(b, kv_heads, hq // kv_heads, n, d).mean(dim=(2, 3))


def passing_indices(qm: torch.Tensor, k_block: torch.Tensor, p: int, pool: int = POOL) -> torch.Tensor:
    """Top-p key indices of one block by pooled query-to-key score.

    qm [B, Hkv, D] fp32 (query_mean), k_block [B, Hkv, L, D] -> long [B, Hkv, p], ascending.
    """
    b, h, length, _ = k_block.shape
    # contiguous fp32 copies: the oracle slices the global tensor, a rank its local one; same bits either way
    scores = torch.einsum("bhd,bhld->bhl", qm, k_block.float().contiguous())
    pooled = F.max_pool1d(scores.reshape(b * h, 1, length), pool, stride=1, padding=pool // 2).view(b, h, length)
    return pooled.topk(p, dim=-1).indices.sort(dim=-1).values


def gather_kv(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """K‖V at the selected positions: k, v [B, Hkv, L, D], idx [B, Hkv, p] -> [B, Hkv, p, 2D]."""
    kv = torch.cat([k, v], dim=-1)
    return kv.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, kv.shape[-1]))


def _full(kv_len: int):
    return lambda rows: torch.ones(1, 1, rows.numel(), kv_len, dtype=torch.bool, device=rows.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, M, D] over k/v [B, Hkv, K, D]: bottom-right causal or every key. -> fp32 out [B, Hq, M, D], lse [B, Hq, M]."""
    if k.shape[2] == 0:  # nothing to attend: an empty shard contributes o = 0, lse = -inf
        shape = q.shape[:3]
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full(shape, float("-inf"), dtype=torch.float32)
    mask = causal_mask_fn(q.shape[2], k.shape[2]) if causal else _full(k.shape[2])
    return masked_attention(q, k, v, mask, scale=scale)


def _gather_async(t: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """All-gather into one tensor, async: t [T, ...] -> ([W, T, ...] view, work). The output is flat along
    dim 0 ([W·T, ...]): the layout gloo requires and NCCL accepts."""
    world = dist.get_world_size(group)
    flat = t.new_empty((world * t.shape[0], *t.shape[1:]))
    work = _ALL_GATHER(flat, t.contiguous(), group=group, async_op=True)
    return flat.view(world, *t.shape), work


def _passing_for(vhost: int, world: int, got_a: torch.Tensor, got_b: torch.Tensor) -> torch.Tensor:
    """Passing KVs of every vhost before `vhost`, [B, Hkv, vhost·p, 2D].

    got_a [W, ...] holds vhosts 0..W-1 (rank s sent vhost s); got_b [W, ...] holds vhost 2W-1-s at s.
    """
    parts = [got_a[h] for h in range(min(vhost, world))]
    parts += [got_b[2 * world - 1 - h] for h in range(world, vhost)]
    if not parts:
        return got_a.new_empty((*got_a.shape[1:3], 0, got_a.shape[-1]))
    return torch.cat(parts, dim=2)


def _rows_over(q_rows, passing, k_anchor, v_anchor, k_blk, v_blk, scale):
    """Block rows over [passing ; anchor ; block], bottom-right causal. -> fp32 out [B, Hq, M, D]."""
    d = k_blk.shape[-1]
    k = torch.cat([passing[..., :d].to(k_blk.dtype), k_anchor, k_blk], dim=2)
    v = torch.cat([passing[..., d:].to(v_blk.dtype), v_anchor, v_blk], dim=2)
    return attend(q_rows, k, v, scale, causal=True)[0]


def spava_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rank: int, scale: float,
                    group=None, stats: dict | None = None) -> torch.Tensor:
    """SPAVA attention of rank `rank`'s local tokens.

    q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] over [anchor ; block_a ; block_b ; query] (layout.local_sizes),
    post-RoPE. Returns out [B, Hq, N_r, D] in q's dtype. stats, when given, gets "bytes_sent" added
    (this rank's payload into the collectives, counted once per peer).
    """
    la, na, nb, nq = layout.local_sizes(rank)
    if q.shape[2] != la + na + nb + nq:
        raise ValueError(f"rank {rank} holds {q.shape[2]} tokens, its layout says {la + na + nb + nq}")
    world, kv_heads = layout.world, k.shape[1]
    cut = lambda t, s, e: t[:, :, s:e]
    sa, sb, sq = la, la + na, la + na + nb
    q_query = cut(q, sq, sq + nq)

    # 1-2. selections, sent while the query partial runs.
    qm = query_mean(q_query, kv_heads)
    p = layout.passing
    sel_a = gather_kv(cut(k, sa, sb), cut(v, sa, sb), passing_indices(qm, cut(k, sa, sb), p))
    got_a, w1 = _gather_async(sel_a, group)
    sel_b = gather_kv(cut(k, sb, sq), cut(v, sb, sq), passing_indices(qm, cut(k, sb, sq), p))
    got_b, w2 = _gather_async(sel_b, group)

    # 3. query partial: non-causal over this rank's context keys (+ its own keys on the owner), exact.
    a0, a1 = layout.anchor_slice(rank)
    k_ctx = torch.cat([cut(k, a0, a1), cut(k, sa, sq)], dim=2)
    v_ctx = torch.cat([cut(v, a0, a1), cut(v, sa, sq)], dim=2)
    o_q, lse_q = attend(q_query, k_ctx, v_ctx, scale, causal=False)
    if rank == QUERY_OWNER:
        o_self, lse_self = attend(q_query, cut(k, sq, sq + nq), cut(v, sq, sq + nq), scale, causal=True)
        o_q, lse_q = merge_two(o_q, lse_q, o_self, lse_self)
    got_o, w3 = _gather_async(o_q, group)
    got_lse, w4 = _gather_async(lse_q, group)

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    k_anchor, v_anchor = cut(k, 0, la), cut(v, 0, la)
    out[:, :, :la] = attend(cut(q, 0, la), k_anchor, v_anchor, scale, causal=True)[0]
    # 4. block_a once the passing of vhosts < r is here.
    w1.wait()
    vh_a, vh_b = layout.vhosts(rank)
    out[:, :, sa:sb] = _rows_over(cut(q, sa, sb), _passing_for(vh_a, world, got_a, got_b), k_anchor, v_anchor,
                                  cut(k, sa, sb), cut(v, sa, sb), scale)
    # 5. block_b needs every vhost before 2W-1-r: all of got_a and part of got_b.
    w2.wait()
    out[:, :, sb:sq] = _rows_over(cut(q, sb, sq), _passing_for(vh_b, world, got_a, got_b), k_anchor, v_anchor,
                                  cut(k, sb, sq), cut(v, sb, sq), scale)
    # 6. the query's partials from every rank, merged by lse.
    w3.wait()
    w4.wait()
    out[:, :, sq:] = merge_partials(got_o, got_lse, dim=0)[0]
    if stats is not None:
        peers = world - 1
        sent = (sel_a.numel() * sel_a.element_size() + sel_b.numel() * sel_b.element_size()
                + o_q.numel() * o_q.element_size() + lse_q.numel() * lse_q.element_size())
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + sent * peers
    return out.to(q.dtype)
