"""SPAVA inside a transformers model: each rank runs every layer on its local tokens only.

Registration goes through ``models.attention.install`` (with a mask function that builds no mask: our
attention knows its own structure), as runtime/hf.py does. The per-run facts — mode, layout,
the rank's global positions, the process group — live in one ``RankContext`` that ``attach`` sets on
every attention module of the text model (the way runtime/hf.py hands its Runner over) and
``detach`` removes.

Modes: "decode" (one new token per step over this rank's kept keys, decode.py), "spava" (the approximate attention, local sequence [anchor ; block_r ; block_{2W-1-r} ; query]),
"ring" (exact zigzag ring attention over the zigzag sharding, exact.py) and "torch_cp" (exact: torch's own
context parallelism — the forward runs inside ``exact.torch_context_parallel``, which shards the positions,
and each global layer calls causal SDPA, which torch turns into its ring attention). A hybrid model's
sliding-window layers run exactly in every mode: under SPAVA each rank all-gathers the last `window`
keys of every virtual host's block (a halo), enough for every local row's window (sliding.py); under
"ring" and "torch_cp" they go round our zigzag ring with the window applied (torch CP has no windowed
attention; its load-balanced shard is the zigzag layout, which ``exact.check_zigzag_shard`` checks).

Attention time per rank: each call is timed on the host (CPU tensors) or between two CUDA events on the
current stream (GPU tensors: the host clock would see only the launches); ``attention_seconds`` sums both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .attention import spava_attention
from .exact import cp_attention, ring_attention, zigzag_positions
from .fused import Engine
from .layout import Layout

ATTN_NAME = "sparsesearch_spava"
# One engine for every layer and prefill of the process: its dense indices are cached per piece shape, so a
# model's layers (and the timed prefills after an untimed one) build each once instead of once per call.
ENGINE = Engine("auto")
_CTX = "_sparsesearch_spava_ctx"


@dataclass
class RankContext:
    """What one rank's attention calls need. pos: long [N_r] global positions of the local tokens."""

    mode: str
    n: int
    pos: torch.Tensor
    layout: Layout | None = None
    group: object = None
    stats: dict = field(default_factory=dict)
    kept: dict | None = None  # layer -> (k, v) [B, Hkv, N_r, D] post-RoPE, when a decode follows (decode.py)
    shards: dict | None = None  # mode "decode": layer -> decode.LocalKV, this rank's keys; pos = [the new token's position]

    @classmethod
    def spava(cls, layout: Layout, rank: int, group=None) -> "RankContext":
        return cls("spava", layout.n, torch.tensor(layout.local_positions(rank)), layout, group)

    @classmethod
    def torch_cp(cls, n: int, pos: torch.Tensor, group=None) -> "RankContext":
        """pos: the shard that exact.torch_context_parallel yields (torch's load-balanced layout)."""
        return cls("torch_cp", n, pos, None, group)

    @classmethod
    def decoding(cls, n: int, shards: dict, group=None) -> "RankContext":
        """The distributed decode after a prefill of n tokens (decode.distributed_decode sets pos per step)."""
        return cls("decode", n, torch.tensor([n]), None, group, shards=shards)

    @classmethod
    def ring(cls, n: int, rank: int, world: int, group=None) -> "RankContext":
        return cls("ring", n, torch.tensor(zigzag_positions(n, world, rank)), None, group)


def spava_hf_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """AttentionInterface function: q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] post-RoPE -> ([B, N_r, Hq, D], None)."""
    ctx: RankContext = getattr(module, _CTX)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = getattr(module, "sliding_window", None)  # set on a hybrid model's sliding layers only
    rank = dist.get_rank(ctx.group)
    if ctx.kept is not None:  # the local KV a decode needs; references, no copy (the layer made them)
        ctx.kept[module.layer_idx] = (key, value)
    clock = _start_clock(query)
    if ctx.mode == "decode":
        from .decode import decode_attention

        out = decode_attention(query, key, value, ctx.shards[module.layer_idx], int(ctx.pos[0]), scale, window, ctx.group, ctx.stats)
    elif ctx.mode == "torch_cp" and window is None:
        out = cp_attention(query, key, value, scale)
    elif ctx.mode in ("ring", "torch_cp"):  # torch_cp's sliding layers: our ring on torch's (zigzag) shard
        out = ring_attention(query, key, value, ctx.pos.to(query.device), ctx.n, scale, ctx.group, window=window, stats=ctx.stats, engine=ENGINE)
    elif window is not None:
        from .sliding import sliding_attention

        out = sliding_attention(query, key, value, ctx.layout, rank, scale, window, ctx.group, stats=ctx.stats)
    else:
        out = spava_attention(query, key, value, ctx.layout, rank, scale, ctx.group, stats=ctx.stats, engine=ENGINE)
    _stop_clock(ctx.stats, clock)
    return out.transpose(1, 2), None


def _start_clock(query: torch.Tensor):
    """A start mark for one attention call: a recorded CUDA event for GPU tensors, else the host clock."""
    if query.is_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _stop_clock(stats: dict, start) -> None:
    """Close the call started at `start`: host seconds into stats["attention_s"], or the (start, end) event pair
    into stats["attention_events"], read later by attention_seconds (reading now would synchronize per layer)."""
    if isinstance(start, float):
        stats["attention_s"] = stats.get("attention_s", 0.0) + time.perf_counter() - start
        return
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    stats.setdefault("attention_events", []).append((start, end))


def attention_seconds(stats: dict) -> float:
    """Seconds this rank spent in attention calls so far: host-timed calls plus the GPU time between each CUDA
    event pair (waits for a peer's data included). Folds the pairs into stats["attention_s"] (synchronizing
    on the last one), so calling it twice counts nothing twice."""
    events = stats.pop("attention_events", [])
    if events:
        events[-1][1].synchronize()
        stats["attention_s"] = stats.get("attention_s", 0.0) + sum(a.elapsed_time(b) for a, b in events) / 1e3
    return stats.get("attention_s", 0.0)


def has_sliding_layers(model) -> bool:
    """Whether any attention layer of the model is a sliding-window layer (a hybrid such as Gemma 3)."""
    return any(w is not None for w in attention_windows(model))


def attention_windows(model) -> list[int | None]:
    """Per layer, the sliding window of its attention module (None on global layers)."""
    return [getattr(m, "sliding_window", None) for m in _text_attention(model)]


def _text_attention(model) -> list:
    """The text model's attention modules in layer order, one per layer (ValueError otherwise)."""
    from ..runtime.hf import _attention_modules, model_info

    info = model_info(model)
    modules = sorted(_attention_modules(model, info.num_layers), key=lambda m: m.layer_idx)
    if [m.layer_idx for m in modules] != list(range(info.num_layers)):
        raise ValueError(f"found {len(modules)} attention modules for {info.num_layers} layers; unsupported model layout")
    return modules


def _no_mask(*args, **kwargs):
    return None


def attach(model, ctx: RankContext) -> None:
    """Route the model's attention through SPAVA / the ring for this rank (undo with ``detach``)."""
    from ..models.attention import install

    modules = _text_attention(model)
    for module in modules:
        setattr(module, _CTX, ctx)
    install(model, ATTN_NAME, spava_hf_attention, mask=_no_mask)


def detach(model) -> None:
    """Undo ``attach``: no rank context left on the modules, the previous attention implementation back."""
    from ..models.attention import uninstall

    for module in model.modules():
        if hasattr(module, _CTX):
            delattr(module, _CTX)
    uninstall(model, ATTN_NAME)


def tail_logits(model, ids: torch.Tensor, ctx: RankContext, tail: int, *, owner: bool, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill of this rank's tokens; logits of the last `tail` positions of the whole prompt.

    ids long [B, n] (the whole prompt: every rank holds the token ids, only its own pass the layers);
    embeds [B, n, hidden], when given, are fed instead (a VLM's merged embeddings, vision.py).
    owner: whether this rank contributes the tail positions it holds (the query is replicated under
    SPAVA, so only one rank contributes there). Returns fp32 [B, tail, V], identical on every rank.
    """
    attach(model, ctx)
    try:
        pos = ctx.pos.to(ids.device)
        keep = (pos >= ctx.n - tail).nonzero().flatten()
        with torch.no_grad():
            inputs = {"input_ids": ids[:, pos]} if embeds is None else {"inputs_embeds": embeds[:, pos]}
            out = model(**inputs, position_ids=pos[None].expand(ids.shape[0], -1), use_cache=False, logits_to_keep=keep)
    finally:
        detach(model)
    logits = out.logits.float()
    buf = logits.new_zeros((ids.shape[0], tail, logits.shape[-1]))
    if owner:
        buf[:, pos[keep] - (ctx.n - tail)] = logits
    dist.all_reduce(buf, group=ctx.group)
    return buf
