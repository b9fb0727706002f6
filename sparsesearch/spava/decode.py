"""Decoding after a distributed prefill: the paper's distributed decode, or the KV cache gathered on one rank.

After SPAVA's prefill (or the exact ring's) every rank holds the post-RoPE K/V of its local tokens, layer by
layer (``RankContext.kept``, filled by model.spava_hf_attention). Every position of the prompt is held by
exactly one *owner* (``owned_positions``): under SPAVA, each rank owns its two blocks and the query owner
(rank 0) also owns the anchor and the query, which every rank holds a copy of; in the ring, each rank owns
its zigzag chunks. Two decoders use that ownership:

* ``distributed_decode`` — docs/peers.md 2(b) step 7, the paper's method (default). Each rank keeps only the
  K/V it owns (``LocalKV``, one per layer; a sliding layer keeps only keys a future position can see), and
  rank 0 (``SAMPLER``) also the K/V of the tokens generated so far. Per token, every rank runs the model's
  layers on the one new token: all ranks hold the same hidden state, so QKV projections, MLP and norms are
  replicated, not split — the paper's scheme; only attention is distributed. Each layer's attention is the
  new query over the rank's own keys (no causal mask: every kept key precedes it; a sliding layer's keys
  cut to the window by global position), one all-gather of (out, lse) packed in one fp32 tensor, and the
  lse merge (sparsesearch.merge; an empty shard has lse = -inf and weight 0). Routed through the same
  AttentionInterface registration as the prefill (``RankContext`` mode "decode", model.py).
  The next token is the argmax on the sampling rank, broadcast to the others (8 bytes per batch row):
  every rank computes the same logits only up to rounding in the replicated layers (kernels and reduction
  orders may differ between devices), and a token that differed between ranks would desynchronise the
  ranks' inputs for good; the broadcast makes agreement a fact, not an assumption, and lets the other
  ranks skip the LM head.
* ``decode_after_prefill`` — gather: the owned K/V gathered to one rank (``assemble_cache``, one layer at
  a time: peak memory the cache plus one layer from every rank), put in position order in the model's own
  cache type (a transformers ``DynamicCache`` built from the config: hybrid models such as Gemma 3 get
  their sliding layers), and the ordinary model decodes greedily there; tokens are broadcast at the end.
  One big transfer, then local steps with no collective; the cache must fit one device.

Generation stops after exactly `steps` tokens (no EOS stop), so SPAVA's and dense generation are
compared position by position. The first token is the argmax of the prefill's last logits (identical on
every rank: tail_logits all-reduces them); `steps - 1` decode steps follow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..merge import merge_partials
from ..models.forward import cache_kwarg
from .attention import QUERY_OWNER
from .comm import Collectives
from .exact import zigzag_positions
from .fused import as_engine
from .model import RankContext, attach, attention_seconds, attention_windows, detach, tail_logits

SAMPLER = QUERY_OWNER  # samples the next token and holds the generated tokens' K/V (it owns the query too)
DECODERS = ("distributed", "gather")


def owned_positions(ctx: RankContext, rank: int, world: int) -> list[int]:
    """Global positions whose K/V rank r contributes to the cache; over the ranks, each of 0..n-1 exactly once."""
    if ctx.mode == "ring":
        return zigzag_positions(ctx.n, world, rank)
    if ctx.mode != "spava":  # torch CP's shards are torch's; another rank's are not known from this context
        raise ValueError(f"decoding after a {ctx.mode!r} prefill is not supported (spava or ring)")
    lay = ctx.layout
    mine = [p for j in lay.vhosts(rank) for p in range(*lay.block(j))]
    if rank == QUERY_OWNER:  # anchor and query are replicated: one copy, from the rank whose query partial is causal
        mine = [*range(lay.l_a), *mine, *range(lay.n_ctx, lay.n)]
    return mine


def _check_kept(ctx: RankContext, world: int) -> list[int]:
    """The layers of ctx.kept, checked (every layer from 0; owned positions partition the prompt)."""
    if not ctx.kept:
        raise ValueError("no kept K/V: set ctx.kept = {} before the prefill (decode.spava_generate does)")
    layers = sorted(ctx.kept)
    if layers != list(range(len(layers))):
        raise ValueError(f"kept K/V of layers {layers}: every layer from 0 must be there")
    owned = sorted(p for s in range(world) for p in owned_positions(ctx, s, world))
    if owned != list(range(ctx.n)):
        raise ValueError(f"the ranks' owned positions do not cover 0..{ctx.n - 1} exactly once")
    return layers


@dataclass
class LocalKV:
    """One layer's keys on one rank during the distributed decode.

    k, v [B, Hkv, cap, D] with the first `length` filled; pos long [cap] (CPU) their global positions,
    ascending. cap = the owned prompt keys kept, plus room for the generated tokens on the sampler (grows).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    length: int
    grows: bool

    def append(self, k: torch.Tensor, v: torch.Tensor, p: int) -> None:
        """The new token's k, v [B, Hkv, 1, D] at global position p."""
        if self.length == self.k.shape[2]:
            raise ValueError(f"decode cache full at {self.length} keys: more steps than it was sized for")
        self.k[:, :, self.length] = k[:, :, 0]
        self.v[:, :, self.length] = v[:, :, 0]
        self.pos[self.length] = p
        self.length += 1

    def visible(self, p: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys the query at position p attends: all kept ones, or within `window` (p - pos < window).
        -> k, v views [B, Hkv, M, D]; M may be 0 (an empty shard)."""
        start = 0
        if window is not None:  # positions ascend, so the window is a suffix
            start = int(torch.searchsorted(self.pos[: self.length], p - window + 1))
        return self.k[:, :, start : self.length], self.v[:, :, start : self.length]


def local_kv(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, extra: int) -> LocalKV:
    """Copy the kept keys idx long [M] of k, v [B, Hkv, N_r, D] (global positions pos long [M], ascending) into
    a LocalKV with room for `extra` generated tokens."""
    if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise ValueError("kept positions must ascend (the window is cut as a suffix)")
    b, h, _, d = k.shape
    ks, vs = k.new_empty((b, h, len(idx) + extra, d)), v.new_empty((b, h, len(idx) + extra, d))
    ks[:, :, : len(idx)] = k[:, :, idx.to(k.device)]
    vs[:, :, : len(idx)] = v[:, :, idx.to(v.device)]
    full = torch.cat([pos, pos.new_full((extra,), -1)])
    return LocalKV(ks, vs, full, len(idx), extra > 0)


def decode_shards(model, ctx: RankContext, rank: int, world: int, extra: int, dst: int = SAMPLER) -> dict[int, LocalKV]:
    """This rank's LocalKV per layer from ctx.kept (released layer by layer, so the peak is one layer's copy).

    The owned positions only (no replica counted twice); on a sliding layer only those a query at position
    >= n can see (pos > n - window). dst gets room for `extra` generated tokens.
    """
    layers = _check_kept(ctx, world)
    windows = attention_windows(model)
    local = {p: i for i, p in enumerate(ctx.pos.tolist())}
    owned = owned_positions(ctx, rank, world)
    shards = {}
    for layer in layers:
        window = windows[layer]
        keep = [p for p in owned if window is None or p > ctx.n - window]
        k, v = ctx.kept.pop(layer)
        shards[layer] = local_kv(k, v, torch.tensor([local[p] for p in keep], dtype=torch.long), torch.tensor(keep, dtype=torch.long),
                                 extra if rank == dst else 0)
    return shards


_KERNELS = as_engine("triton")


def decode_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The new token over one shard, no mask: q [B, Hq, 1, D], k/v [B, Hkv, M, D] -> fp32 out [B, Hq, 1, D],
    lse [B, Hq, 1] (M = 0: out 0, lse -inf).

    GQA packed: with one position and no mask, a KV head's G query heads are G rows over the same keys
    ([B, Hkv, G, D]), so K/V are read once per KV head, never repeated. On CUDA the rows go to the fused
    engine's block-sparse kernel (split-K over long shards, fused.py); elsewhere two fp32 matmuls, which
    on CPU take a tenth of the plain engine's chunked, masked path at SmolLM2's decode shapes.
    kernel: force the kernel (True; on CPU under TRITON_INTERPRET=1) or the matmuls (False); None: by device.
    """
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    rows = q.reshape(b, hkv, hq // hkv, d)
    if q.is_cuda if kernel is None else kernel:
        o, lse = _KERNELS.attend(rows, k, v, scale, causal=False)
    else:
        s = torch.matmul(rows.float(), k.float().transpose(-1, -2)) * scale
        lse = torch.logsumexp(s, dim=-1)  # -inf over no key; exp(s - lse) is then empty and o = 0
        o = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return o.float().reshape(b, hq, 1, d), lse.reshape(b, hq, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: LocalKV, p: int, scale: float,
                     window: int | None, group=None, stats: dict | None = None) -> torch.Tensor:
    """One layer's attention of the new token at global position p, over every rank's keys.

    q [B, Hq, 1, D], k/v [B, Hkv, 1, D] post-RoPE (the new token's; kept when shard.grows). Local partial over
    shard.visible(p, window), no causal mask; its out [B, Hq, 1, D] and lse [B, Hq, 1] travel packed as one
    fp32 [B, Hq, 1, D+1] tensor in one all-gather (fp32: the merge is exact to rounding, and D+1 floats per
    head is small next to one collective's latency); merged by lse -> out [B, Hq, 1, D] in q's dtype, the
    same on every rank. stats gets "bytes_sent" (the packed tensor to each of W - 1 peers).
    """
    if shard.grows:
        shard.append(k, v, p)
    k_vis, v_vis = shard.visible(p, window)
    o, lse = decode_partial(q, k_vis, v_vis, scale)
    d = q.shape[-1]
    exchange = Collectives(group)
    got, wait = exchange.all_gather("decode", torch.cat([o.float(), lse[..., None]], dim=-1))
    wait()
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + exchange.bytes_sent
    return merge_partials(got[..., :d], got[..., d], dim=0)[0].to(q.dtype)


def distributed_decode(model, ctx: RankContext, last_logits: torch.Tensor, steps: int, dst: int = SAMPLER):
    """The paper's decode (module docstring): `steps` greedy tokens, every rank attending only the keys it owns.

    last_logits [B, V]: the prompt's last-position logits (identical on every rank). Call on every rank of
    ctx.group after a prefill with ctx.kept set. -> (tokens long [B, steps] on every rank, step logits fp32
    [B, steps - 1, V] on dst / None elsewhere, the LocalKV per layer). ctx.kept is released; ctx.stats gets
    "decode_setup_s", "decode_steps_s", "decode_setup_bytes" (0), "decode_bytes_sent" (per-layer
    all-gathers plus, on dst, the token broadcasts) and "decode_attention_s" (local partials, all-gathers, merges).
    """
    rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    start = time.perf_counter()
    shards = decode_shards(model, ctx, rank, world, steps - 1, dst)
    ctx.kept = None
    dec = RankContext.decoding(ctx.n, shards, ctx.group)
    ctx.stats.update(decode_setup_s=time.perf_counter() - start, decode_setup_bytes=0)
    first = last_logits.argmax(-1)
    out, logits = [first], []
    # the LM head runs on dst only: an empty logits_to_keep elsewhere
    keep = torch.arange(1 if rank == dst else 0, device=first.device)
    start = time.perf_counter()
    attach(model, dec)
    try:
        with torch.no_grad():
            for i in range(1, steps):
                p = ctx.n + i - 1
                dec.pos = torch.tensor([p])
                pos = torch.full((first.shape[0], 1), p, device=first.device)
                lg = model(input_ids=out[-1][:, None], position_ids=pos, use_cache=False, logits_to_keep=keep).logits
                nxt = lg[:, -1].argmax(-1) if rank == dst else torch.empty_like(first)
                dist.broadcast(nxt, src=dst, group=ctx.group)
                if rank == dst:
                    logits.append(lg[:, -1].float())
                out.append(nxt)
    finally:
        detach(model)
    broadcast = (steps - 1) * first.numel() * first.element_size() * (world - 1) if rank == dst else 0
    ctx.stats.update(decode_steps_s=time.perf_counter() - start, decode_bytes_sent=dec.stats.get("bytes_sent", 0) + broadcast,
                     decode_attention_s=attention_seconds(dec.stats))
    step_logits = _stack_logits(logits, first, last_logits.shape[-1]) if rank == dst else None
    return torch.stack(out, dim=1), step_logits, shards


def _stack_logits(logits: list[torch.Tensor], first: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] per step -> fp32 [B, steps - 1, V] (an empty step axis when nothing was decoded)."""
    if not logits:
        return torch.empty((first.shape[0], 0, vocab), device=first.device)
    return torch.stack(logits, dim=1)


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
    layers = _check_kept(ctx, world)
    owners = [owned_positions(ctx, s, world) for s in range(world)]
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


def greedy(model, cache, first: torch.Tensor, start: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding over a filled cache: first long [B] (the token after the prompt, fed at position
    `start`) -> (long [B, steps] starting with `first`, step logits fp32 [B, steps - 1, V]). The cache grows
    by steps - 1 positions."""
    out, logits = [first], []
    with torch.no_grad():
        for i in range(1, steps):
            pos = torch.tensor([start + i - 1], device=first.device)
            lg = model(input_ids=out[-1][:, None], **cache_kwarg(model, cache), position_ids=pos[None].expand(first.shape[0], -1),
                       cache_position=pos, use_cache=True).logits[:, -1].float()
            logits.append(lg)
            out.append(lg.argmax(-1))
    return torch.stack(out, dim=1), _stack_logits(logits, first, model.get_output_embeddings().weight.shape[0])


def decode_after_prefill(model, ctx: RankContext, last_logits: torch.Tensor, steps: int, dst: int = 0):
    """Gather: assemble the cache on dst, decode `steps` tokens there, broadcast them.

    last_logits [B, V]: the prompt's last-position logits (identical on every rank, as tail_logits returns).
    -> (tokens long [B, steps] on every rank, step logits fp32 [B, steps - 1, V] on dst / None elsewhere,
    the cache on dst / None elsewhere). ctx.kept is released; ctx.stats gets the same decode_* keys as
    distributed_decode (the cache transfer is the setup; the tokens' broadcast at the end counts as the steps').
    """
    rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
    start = time.perf_counter()
    cache = assemble_cache(model, ctx, dst)
    ctx.kept = None
    ctx.stats.update(decode_setup_s=time.perf_counter() - start, decode_setup_bytes=ctx.stats["cache_bytes_sent"])
    start = time.perf_counter()
    first = last_logits.argmax(-1)
    tokens, logits = greedy(model, cache, first, ctx.n, steps) if rank == dst else (first.new_empty((first.shape[0], steps)), None)
    dist.broadcast(tokens, src=dst, group=ctx.group)
    sent = tokens.numel() * tokens.element_size() * (world - 1) if rank == dst else 0
    ctx.stats.update(decode_steps_s=time.perf_counter() - start, decode_bytes_sent=sent)
    return tokens, logits, cache


def decode(model, ctx: RankContext, last_logits: torch.Tensor, steps: int, how: str = "distributed", dst: int = SAMPLER):
    """`steps` greedy tokens after a prefill by `how` ("distributed" or "gather") -> (tokens, step logits, state):
    state is the LocalKV per layer (distributed) or the cache on dst (gather)."""
    _check(steps, how)
    run = distributed_decode if how == "distributed" else decode_after_prefill
    return run(model, ctx, last_logits, steps, dst)


def _check(steps: int, how: str) -> None:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if how not in DECODERS:
        raise ValueError(f"decode must be one of {', '.join(DECODERS)}, got {how!r}")


def spava_generate(model, ids: torch.Tensor, ctx: RankContext, steps: int, *, decoder: str = "distributed", tail: int = 1,
                   dst: int = SAMPLER, embeds: torch.Tensor | None = None):
    """Distributed prefill of ids long [B, n] (SPAVA or ring, per ctx), then `steps` greedy tokens (``decode``).

    -> (tokens long [B, steps] on every rank, logits fp32 [B, tail, V] of the prompt's last positions,
    step logits fp32 [B, steps - 1, V] on dst / None elsewhere, the decoder's state). Call on every rank of
    ctx.group.
    """
    _check(steps, decoder)
    rank = dist.get_rank(ctx.group)
    ctx.kept = {}
    logits = tail_logits(model, ids, ctx, tail, owner=ctx.mode == "ring" or rank == QUERY_OWNER, embeds=embeds)
    tokens, step_logits, state = decode(model, ctx, logits[:, -1], steps, decoder, dst)
    return tokens, logits, step_logits, state


def dense_prefill(model, ids: torch.Tensor):
    """The ordinary model's own prefill of ids long [B, n] -> (its cache, last-position logits [B, 1, V])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1).logits
    return cache, logits


def dense_generate(model, ids: torch.Tensor, steps: int):
    """The ordinary model's own prefill of ids long [B, n] then the same greedy loop -> (tokens long [B, steps], cache)."""
    cache, logits = dense_prefill(model, ids)
    return greedy(model, cache, logits[:, -1].argmax(-1), ids.shape[1], steps)[0], cache
