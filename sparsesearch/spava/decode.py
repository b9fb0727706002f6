"""Decoding after a distributed prefill: the KV cache assembled on one rank, then ordinary greedy decoding.

After SPAVA's prefill (or the exact ring's) every rank holds the post-RoPE K/V of its local tokens, layer by
layer (``RankContext.kept``, filled by model.spava_hf_attention). Every position of the prompt is held by
exactly one *owner* (``owned_positions``): under SPAVA, each rank owns its two blocks and the query owner
(rank 0) also owns the anchor and the query, which every rank holds a copy of; in the ring, each rank owns
its zigzag chunks. ``assemble_cache`` gathers the owned K/V to one rank, one layer at a time (peak memory:
the cache plus one layer from every rank), puts them in position order and fills the model's own cache type
(a transformers ``DynamicCache`` built from the config: hybrid models such as Gemma 3 get their sliding
layers, which keep the last window of keys). The ordinary model then decodes greedily on that rank; the
tokens are broadcast so every rank returns them.

This is PEERS.md 2(b) step 7 read as "decode on one GPU": the paper's distributed decode (a local FA per
rank + merge per token) keeps the memory spread but pays a collective per layer per token; gathering once
suits the short answers the sweep measures. Generation stops after exactly `steps` tokens (no EOS stop),
so SPAVA's and dense generation are compared position by position.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .attention import QUERY_OWNER
from .exact import zigzag_positions
from .model import RankContext, tail_logits


def owned_positions(ctx: RankContext, rank: int, world: int) -> list[int]:
    """Global positions whose K/V rank r contributes to the cache; over the ranks, each of 0..n-1 exactly once."""
    if ctx.mode == "ring":
        return zigzag_positions(ctx.n, world, rank)
    lay = ctx.layout
    mine = [p for j in lay.vhosts(rank) for p in range(*lay.block(j))]
    if rank == QUERY_OWNER:  # anchor and query are replicated: one copy, from the rank whose query partial is causal
        mine = [*range(lay.l_a), *mine, *range(lay.n_ctx, lay.n)]
    return mine


def _gather_layer(kv: torch.Tensor, width: int, rank: int, dst: int, group) -> list[torch.Tensor] | None:
    """kv [B, Hkv, M_r, 2D] padded to `width` tokens and gathered on dst -> W tensors [B, Hkv, width, 2D] there."""
    padded = kv.new_zeros((*kv.shape[:2], width, kv.shape[-1]))
    padded[:, :, : kv.shape[2]] = kv
    world = dist.get_world_size(group)
    got = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, got, dst=dst, group=group)
    return got


def assemble_cache(model, ctx: RankContext, dst: int = 0):
    """The prompt's KV cache on rank `dst`, from every rank's kept K/V (ctx.kept, layer -> k/v [B, Hkv, N_r, D]).

    Returns a transformers DynamicCache (built from model.config) holding positions 0..n-1 in order on dst,
    None on the other ranks. Adds the bytes this rank sent to ctx.stats["cache_bytes_sent"].
    """
    from transformers import DynamicCache

    rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    if not ctx.kept:
        raise ValueError("no kept K/V: set ctx.kept = {} before the prefill (decode.spava_generate does)")
    layers = sorted(ctx.kept)
    if layers != list(range(len(layers))):
        raise ValueError(f"kept K/V of layers {layers}: every layer from 0 must be there")
    owners = [owned_positions(ctx, s, world) for s in range(world)]
    if sorted(p for pos in owners for p in pos) != list(range(ctx.n)):
        raise ValueError(f"the ranks' owned positions do not cover 0..{ctx.n - 1} exactly once")
    width = max(map(len, owners))
    local = {p: i for i, p in enumerate(ctx.pos.tolist())}
    k0 = ctx.kept[0][0]
    idx = torch.tensor([local[p] for p in owners[rank]], dtype=torch.long, device=k0.device)
    cache = DynamicCache(config=model.config) if rank == dst else None
    sent = 0
    for layer in layers:
        k, v = ctx.kept[layer]
        d = k.shape[-1]
        got = _gather_layer(torch.cat([k, v], dim=-1)[:, :, idx], width, rank, dst, ctx.group)
        if rank != dst:
            sent += k.shape[0] * k.shape[1] * width * 2 * d * k.element_size()
            continue
        full = k.new_empty((k.shape[0], k.shape[1], ctx.n, 2 * d))
        for s, pos in enumerate(owners):
            full[:, :, torch.tensor(pos, dtype=torch.long, device=k.device)] = got[s][:, :, : len(pos)]
        cache.update(full[..., :d], full[..., d:], layer)
    ctx.stats["cache_bytes_sent"] = ctx.stats.get("cache_bytes_sent", 0) + sent
    return cache


def greedy(model, cache, first: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Greedy decoding over a filled cache: first long [B] (the token after the prompt, fed at position
    `start`), -> long [B, steps] starting with `first`. The cache grows by steps - 1 positions."""
    out = [first]
    with torch.no_grad():
        for i in range(1, steps):
            pos = torch.tensor([start + i - 1], device=first.device)
            logits = model(input_ids=out[-1][:, None], past_key_values=cache, position_ids=pos[None].expand(first.shape[0], -1),
                           cache_position=pos, use_cache=True).logits
            out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, dim=1)


def decode_after_prefill(model, ctx: RankContext, last_logits: torch.Tensor, steps: int, dst: int = 0):
    """Assemble the cache on dst, decode `steps` tokens there, broadcast them.

    last_logits [B, V]: the prompt's last-position logits (identical on every rank, as tail_logits returns).
    -> (tokens long [B, steps] on every rank, the cache on dst / None elsewhere). ctx.kept is released.
    """
    rank = dist.get_rank(ctx.group)
    cache = assemble_cache(model, ctx, dst)
    ctx.kept = None
    first = last_logits.argmax(-1)
    tokens = greedy(model, cache, first, ctx.n, steps) if rank == dst else first.new_empty((first.shape[0], steps))
    dist.broadcast(tokens, src=dst, group=ctx.group)
    return tokens, cache


def spava_generate(model, ids: torch.Tensor, ctx: RankContext, steps: int, *, tail: int = 1, dst: int = 0,
                   embeds: torch.Tensor | None = None):
    """Distributed prefill of ids long [B, n] (SPAVA or ring, per ctx), then `steps` greedy tokens on rank dst.

    -> (tokens long [B, steps] on every rank, logits fp32 [B, tail, V] of the prompt's last positions,
    the cache on dst / None elsewhere). Call on every rank of ctx.group.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rank = dist.get_rank(ctx.group)
    ctx.kept = {}
    logits = tail_logits(model, ids, ctx, tail, owner=ctx.mode == "ring" or rank == QUERY_OWNER, embeds=embeds)
    tokens, cache = decode_after_prefill(model, ctx, logits[:, -1], steps, dst)
    return tokens, logits, cache


def dense_generate(model, ids: torch.Tensor, steps: int):
    """The ordinary model's own prefill of ids long [B, n] then the same greedy loop -> (tokens long [B, steps], cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return greedy(model, cache, logits[:, -1].argmax(-1), ids.shape[1], steps), cache
