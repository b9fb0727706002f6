"""Capture per-layer post-RoPE Q, K, V (and optionally the dense output and lse) of a forward pass.

Mechanism: one attention function is registered with transformers under ``CAPTURE_ATTENTION``
(``AttentionInterface.register``, plus the SDPA mask builder under the same name in
``AttentionMaskInterface`` so masks are built exactly as for "sdpa"). While ``attention_capture`` is
active, the *text decoder's* config is switched to that name through ``model.set_attn_implementation``
(vision towers keep theirs); each attention module then calls our function with its post-RoPE
``query [B, Hq, N, D]``, ``key``/``value [B, Hkv, N, D]`` (GQA not repeated) and ``module.layer_idx``.
The function computes the real attention with transformers' own ``sdpa_attention_forward`` — the forward
pass is the "sdpa" forward — and hands the tensors to the sink of the active capture, held in a
``ContextVar`` (so concurrent or nested captures do not see each other). The previous implementation
is restored on exit, also on exceptions. No module is patched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from .attention import register, routed
from .info import ModelInfo
from .modality import token_modality_ids

CAPTURE_ATTENTION = "sparsesearch_capture"

# sink(module, query, key, value, attention_mask, output [B, N, Hq, D], scaling)
Tensor = torch.Tensor
Sink = Callable[[torch.nn.Module, Tensor, Tensor, Tensor, Tensor | None, Tensor, float], None]
_ACTIVE_SINK: ContextVar[Sink | None] = ContextVar("sparsesearch_capture_sink", default=None)
_LSE_BUDGET = 1 << 26  # score elements per lse chunk: 256 MiB of float32


@dataclass
class LayerCapture:
    """What one decoder layer's attention saw in one forward pass.

    q: [B, Hq, N, D] post-RoPE queries; k, v: [B, Hkv, N, D] post-RoPE keys and values (GQA native);
    output: [B, Hq, N, D] the attention output the model used (before o_proj), or None;
    lse: [B, Hq, N] float32 natural-log log-sum-exp of the scaled, masked scores, or None;
    modality_ids: [B, N] long (see ``modality.MODALITIES``), or None without input_ids;
    scale: the softmax scale the layer used; padding_mask: [B, N] bool (True = real token) when the
    inputs carried an attention_mask, else None (plain causal attention).
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    output: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    modality_ids: torch.Tensor | None = None
    scale: float | None = None
    padding_mask: torch.Tensor | None = None


def register_capture_attention() -> str:
    """Register ``CAPTURE_ATTENTION`` with transformers (idempotent) and return the name."""
    return register(CAPTURE_ATTENTION, _capture_attention_forward)


def _capture_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The registered function: SDPA attention, plus a copy of its inputs to the active sink."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sink = _ACTIVE_SINK.get()
    if sink is not None:
        scaling = kwargs.get("scaling")
        scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        sink(module, query, key, value, attention_mask, output, scaling)
    return output, weights


@contextmanager
def attention_capture(model: torch.nn.Module, sink: Sink) -> Iterator[None]:
    """Within the block, every text-decoder attention call of ``model`` also calls ``sink``.

    The text decoder computes attention with SDPA while the block is active, whatever it used before;
    its previous implementation is restored on exit, also when the block raises.
    """
    register_capture_attention()
    with routed(model, CAPTURE_ATTENTION, _ACTIVE_SINK, sink):
        yield


def capture_qkv(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | torch.Tensor,
    *,
    layers: list[int] | None = None,
    on_layer: Callable[[int, LayerCapture], None] | None = None,
    to_cpu: bool = True,
    with_output: bool = False,
    with_lse: bool = False,
    info: ModelInfo | None = None,
) -> list[LayerCapture] | None:
    """Run one prefill forward of ``model`` on ``inputs`` and capture each layer's post-RoPE Q, K, V.

    inputs: the model's keyword inputs (input_ids [B, N], attention_mask, pixel_values, ...) or an
    input_ids LongTensor; tensors are moved to the model's device. layers: layer indices to capture
    (None = all). on_layer: streaming mode; called as ``on_layer(layer, capture)`` inside the forward as
    soon as a layer's attention has run, and nothing is kept (returns None). Otherwise returns the
    captures in layer order. to_cpu: move each layer's tensors to CPU as soon as they are captured, so a
    7B model at 25K tokens keeps only one layer on the GPU. with_output / with_lse: also keep the dense
    attention output and its lse (computed in row chunks, never a full N x N score matrix; the lse
    honours the mask the layer used, sliding windows included). info: for modality ids (default: read
    from ``model.config``).
    """
    from .resolve import modality_token_ids_of

    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    device = next(model.parameters()).device
    inputs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    text_config = model.config.get_text_config()
    num_layers = int(text_config.num_hidden_layers)
    wanted = set(range(num_layers)) if layers is None else {int(layer) for layer in layers}
    bad = sorted(layer for layer in wanted if not 0 <= layer < num_layers)
    if bad:
        raise ValueError(f"layers {bad} out of range for a model with {num_layers} layers")

    token_ids = info.modality_token_ids if info is not None else modality_token_ids_of(model.config)
    modality = None
    if inputs.get("input_ids") is not None:
        modality = token_modality_ids(inputs["input_ids"], token_ids)
    padding = inputs.get("attention_mask")
    padding = padding.bool() if isinstance(padding, torch.Tensor) and padding.ndim == 2 else None
    if to_cpu:
        modality = modality.cpu() if modality is not None else None
        padding = padding.cpu() if padding is not None else None

    kept: list[LayerCapture] = []
    calls = [0]

    def sink(module, query, key, value, attention_mask, output, scaling):
        layer = getattr(module, "layer_idx", None)
        layer = calls[0] if layer is None else int(layer)
        calls[0] += 1
        if layer not in wanted:
            return
        move = (lambda t: t.detach().to("cpu")) if to_cpu else (lambda t: t.detach())
        lse = attention_lse(query, key, attention_mask, scale=scaling) if with_lse else None
        capture = LayerCapture(
            layer=layer,
            q=move(query),
            k=move(key),
            v=move(value),
            output=move(output.transpose(1, 2)).contiguous() if with_output else None,
            lse=move(lse) if lse is not None else None,
            modality_ids=modality,
            scale=scaling,
            padding_mask=padding,
        )
        if on_layer is not None:
            on_layer(layer, capture)
        else:
            kept.append(capture)

    # no_grad, not inference_mode: probes later differentiate through captured tensors.
    with torch.no_grad(), attention_capture(model, sink):
        model(**inputs, use_cache=False)
    if on_layer is not None:
        return None
    return sorted(kept, key=lambda c: c.layer)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    budget: int = _LSE_BUDGET,
) -> torch.Tensor:
    """Natural-log log-sum-exp of scaled scores per query row, float32 [B, Hq, Nq]; GQA native.

    q: [B, Hq, Nq, D]; k: [B, Hkv, Nk, D]. attention_mask: None for causal (bottom-right aligned), or a
    4D mask broadcastable to [B, Hq, Nq, Nk], bool (True = admitted) or additive float. Rows are taken
    in chunks of at most ``budget`` score elements. A row with no admitted key gives -inf.
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    grouped_q = q.reshape(batch, kv_heads, group, q_len, dim)  # query head h uses KV head h // group
    keys_t = k.float().transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, Nk]
    chunk = max(1, budget // max(1, batch * q_heads * kv_len))
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    cols = torch.arange(kv_len, device=q.device)
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        scores = (grouped_q[:, :, :, start:stop].float() @ keys_t) * scale  # [B, Hkv, G, c, Nk]
        if attention_mask is None:
            rows = torch.arange(start, stop, device=q.device) + (kv_len - q_len)
            scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        else:
            mask = _grouped_rows(attention_mask[..., start:stop, :], kv_heads, group)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.float()
        lse[:, :, start:stop] = torch.logsumexp(scores, dim=-1).reshape(batch, q_heads, stop - start)
    return lse


def _grouped_rows(mask: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """A [B|1, H|1, c, Nk] mask slice viewed as [B|1, Hkv|1, G|1, c, Nk] to broadcast over grouped scores."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


