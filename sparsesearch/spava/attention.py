"""SPAVA's approximate attention on one rank of a torch.distributed group (paper 001 §3.3, App. A, B.4).

Rank r holds q/k/v of its local sequence [anchor ; block_a ; block_b ; query] (layout.py: block_a is
virtual host r, block_b is 2W-1-r), all post-RoPE with global positions. Per call:

1. passing selection: score each local block's keys against the mean query vector (over query tokens
   and the GQA group), max-pool width 5, top-p per KV head -> P_a, P_b [B, Hkv, p, 2D] (K‖V);
2. both selections all-gathered asynchronously while
3. the query partial runs: query rows over [anchor slice r ; block_a ; block_b] without a causal mask
   (the query follows every context token), plus the query's own keys causally on rank 0 (one
   bottom-right causal piece over [context ; query] there); its
   (out, lse) all-gathered asynchronously too;
4. anchor rows: causal over the anchor; block_a rows: bottom-right causal over
   [passing of vhosts < r ; anchor ; block_a] (after P_a arrives);
5. block_b rows likewise over [passing of vhosts < 2W-1-r ; anchor ; block_b] (after P_b arrives);
6. query partials merged by lse over the W ranks (sparsesearch.merge; an empty shard has lse = -inf).

With one process every collective is a copy and the result is dense attention over
[anchor ; block_0 ; block_1 ; query] with block_1 seeing the passing of block_0 only — approximate
unless p covers block_0; the W = 1 path is the same code (STYLE habit 14).

The pieces run through fused.Engine: plain torch chunked over rows (the CPU path and the reference) or
the block-sparse Triton kernel / SDPA on CUDA (fused.py). The collectives go through comm.py: real ones on
a process group, or a replay of what the rank would receive (simulate.py, one GPU standing in for rank r).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..merge import merge_partials
from .comm import Collectives, Exchange
from .fused import Engine, as_engine
from .layout import Layout

POOL = 5  # max-pool width over key scores (APB / SPAVA code: kernel 5, stride 1, padding 2)
QUERY_OWNER = 0  # the rank whose query partial includes the query's own keys


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


_PLAIN = Engine("torch")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain path of one piece: q [B, Hq, M, D] over k/v [B, Hkv, K, D], bottom-right causal or every
    key -> fp32 out [B, Hq, M, D], lse [B, Hq, M]. (fused.Engine runs the same pieces on kernels.)"""
    return _PLAIN.attend(q, k, v, scale, causal)


def _passing_for(vhost: int, world: int, got_a: torch.Tensor, got_b: torch.Tensor) -> torch.Tensor:
    """Passing KVs of every vhost before `vhost`, [B, Hkv, vhost·p, 2D].

    got_a [W, ...] holds vhosts 0..W-1 (rank s sent vhost s); got_b [W, ...] holds vhost 2W-1-s at s.
    """
    parts = [got_a[h] for h in range(min(vhost, world))]
    parts += [got_b[2 * world - 1 - h] for h in range(world, vhost)]
    if not parts:
        return got_a.new_empty((*got_a.shape[1:3], 0, got_a.shape[-1]))
    return torch.cat(parts, dim=2)


def _rows_over(q_rows, passing, k_anchor, v_anchor, k_blk, v_blk, scale, engine: Engine) -> torch.Tensor:
    """Block rows over [passing ; anchor ; block], bottom-right causal. -> out [B, Hq, M, D]."""
    d = k_blk.shape[-1]
    k = torch.cat([passing[..., :d].to(k_blk.dtype), k_anchor, k_blk], dim=2)
    v = torch.cat([passing[..., d:].to(v_blk.dtype), v_anchor, v_blk], dim=2)
    return engine.attend(q_rows, k, v, scale, causal=True, need_lse=False)[0]


def select_passing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 on rank r's local q/k/v (shapes as spava_attention): the passing K‖V of its two blocks,
    (P_a, P_b) each [B, Hkv, p, 2D]."""
    la, na, nb, nq = layout.local_sizes(rank)
    sa, sb, sq = la, la + na, la + na + nb
    qm = query_mean(q[:, :, sq : sq + nq], k.shape[1])
    pick = lambda s, e: gather_kv(k[:, :, s:e], v[:, :, s:e], passing_indices(qm, k[:, :, s:e], layout.passing))
    return pick(sa, sb), pick(sb, sq)


def query_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rank: int, scale: float,
                  engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the query rows over [anchor slice r ; block_a ; block_b] with no causal mask (the query
    follows every context token), on the owner also over its own keys causally — one bottom-right causal
    piece over [context ; query] there. -> (out [B, Hq, q, D], lse fp32 [B, Hq, q])."""
    la, na, nb, nq = layout.local_sizes(rank)
    sa, sq = la, la + na + nb
    a0, a1 = layout.anchor_slice(rank)
    stop = sq + nq if rank == QUERY_OWNER else sq
    k_ctx = torch.cat([k[:, :, a0:a1], k[:, :, sa:stop]], dim=2)
    v_ctx = torch.cat([v[:, :, a0:a1], v[:, :, sa:stop]], dim=2)
    return engine.attend(q[:, :, sq:], k_ctx, v_ctx, scale, causal=rank == QUERY_OWNER)


def spava_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rank: int, scale: float,
                    group=None, stats: dict | None = None, engine: Engine | str | None = None,
                    exchange: Exchange | None = None) -> torch.Tensor:
    """SPAVA attention of rank `rank`'s local tokens.

    q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] over [anchor ; block_a ; block_b ; query] (layout.local_sizes),
    post-RoPE. Returns out [B, Hq, N_r, D] in q's dtype. stats, when given, gets "bytes_sent" added
    (this rank's payload into the collectives, counted once per peer). engine: how the pieces run
    (fused.Engine; None = auto: kernels on CUDA, plain torch elsewhere). exchange: the collectives
    (comm.Collectives on `group` by default; comm.Replay runs the rank without a process group).
    """
    la, na, nb, nq = layout.local_sizes(rank)
    if q.shape[2] != la + na + nb + nq:
        raise ValueError(f"rank {rank} holds {q.shape[2]} tokens, its layout says {la + na + nb + nq}")
    engine = as_engine(engine)
    exchange = Collectives(group) if exchange is None else exchange
    sent_before = exchange.bytes_sent
    passing_before = sum(exchange.sent_by.get(name, 0) for name in ("passing_a", "passing_b"))
    world = layout.world
    cut = lambda t, s, e: t[:, :, s:e]
    sa, sb, sq = la, la + na, la + na + nb

    # 1-2. selections, sent while the query partial runs.
    sel_a, sel_b = select_passing(q, k, v, layout, rank)
    got_a, wait_a = exchange.all_gather("passing_a", sel_a)
    got_b, wait_b = exchange.all_gather("passing_b", sel_b)
    # 3. query partial, exact; its (out, lse) travel while the context rows run.
    o_q, lse_q = query_partial(q, k, v, layout, rank, scale, engine)
    got_o, wait_o = exchange.all_gather("query_out", o_q)
    got_lse, wait_lse = exchange.all_gather("query_lse", lse_q)

    out = torch.empty_like(q)
    k_anchor, v_anchor = cut(k, 0, la), cut(v, 0, la)
    out[:, :, :la] = engine.attend(cut(q, 0, la), k_anchor, v_anchor, scale, causal=True, need_lse=False)[0]
    # 4. block_a once the passing of vhosts < r is here.
    wait_a()
    vh_a, vh_b = layout.vhosts(rank)
    out[:, :, sa:sb] = _rows_over(cut(q, sa, sb), _passing_for(vh_a, world, got_a, got_b), k_anchor, v_anchor,
                                  cut(k, sa, sb), cut(v, sa, sb), scale, engine)
    # 5. block_b needs every vhost before 2W-1-r: all of got_a and part of got_b.
    wait_b()
    out[:, :, sb:sq] = _rows_over(cut(q, sb, sq), _passing_for(vh_b, world, got_a, got_b), k_anchor, v_anchor,
                                  cut(k, sb, sq), cut(v, sb, sq), scale, engine)
    # 6. the query's partials from every rank, merged by lse.
    wait_o()
    wait_lse()
    out[:, :, sq:] = merge_partials(got_o, got_lse, dim=0)[0]
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + exchange.bytes_sent - sent_before
        passing = sum(exchange.sent_by.get(name, 0) for name in ("passing_a", "passing_b")) - passing_before
        stats["bytes_passing"] = stats.get("bytes_passing", 0) + passing
    return out
