"""transformers integration: the registered attention function, apply / remove, load_sparse_model.

Registration goes through ``models.attention.install`` (``AttentionInterface`` and ``AttentionMaskInterface``;
no module is patched; the text decoder only): the mask function is transformers' own ``sdpa_mask``, so
``attention_mask`` is None exactly when attention is causal without padding. Each attention module of the text model gets a
reference to the model's Runner and its layer's plan as plain attributes, which ``remove`` deletes.

Dense SDPA runs (through transformers' own SDPA function, so logits are bit-identical to the stock
model) for: dense layers, prompts shorter than the plan's ``min_tokens``, decoding and chunked prefill
(q_len != kv_len), dropout, and padding that is not one contiguous run per sequence.

A hybrid model's sliding-window layers (plan kind "window") run exactly the model's own attention: on
prefill without padding from ``min_tokens`` on, our kernel with the window index (ashape sink 0, local
window — what transformers' sliding mask admits); otherwise transformers' SDPA with the sliding mask it
passed. Their mask is never read as padding (its last row is the window, not a run of real tokens).
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..models.attention import install, uninstall
from ..models.info import ModelInfo
from .nosa_engine import attach, config_from_artifact, detach, engine_of, route
from .plan import Plan, build_plan
from .run import Runner

ATTN_NAME = "sparsesearch"
_RUNNER = "_sparsesearch_runner"
_LAYER = "_sparsesearch_layer"


def sparsesearch_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """AttentionInterface function: q [B, Hq, N, D], k/v [B, Hkv, N, D] post-RoPE -> ([B, N, Hq, D], None).
    With an artifact's methods.nosa applied and a NOSA cache in use (``nosa_cache``), decode steps run over
    the offloaded cache's slots and the prefill below fills its host store (runtime/nosa_engine.py)."""

    def prefill():
        return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    if query.is_cuda and query.device.index != torch.cuda.current_device():
        # a model split over GPUs by device_map: Triton launches on the current device, this layer lives on another
        with torch.cuda.device(query.device):
            return route(module, query, key, value, attention_mask, scaling, prefill)
    return route(module, query, key, value, attention_mask, scaling, prefill)


def _attention(module, query, key, value, attention_mask, dropout: float, scaling: float | None, **kwargs):
    runner: Runner | None = getattr(module, _RUNNER, None)
    layer = getattr(module, _LAYER, None)
    q_len, kv_len = query.shape[2], key.shape[2]
    if runner is not None and layer is not None and layer.kind == "window":
        if q_len == kv_len >= runner.plan.min_tokens and not (dropout and module.training) and _unpadded(attention_mask):
            return runner.attend(layer, query, key, value, scale=scaling).transpose(1, 2), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    sparse = (
        runner is not None and layer is not None and layer.kind != "dense" and q_len == kv_len
        and q_len >= runner.plan.min_tokens and not (dropout and module.training)
    )
    if sparse and attention_mask is not None:
        runs = _padding_runs(attention_mask, q_len)
        if runs is not None:
            return _attend_padded(runner, layer, query, key, value, scaling, runs), None
        sparse = False
    last_row = (
        runner is not None and layer is not None and runner.plan.last_row_only and layer.layer == len(runner.plan.layers) - 1
        and q_len == kv_len and q_len >= runner.plan.min_tokens and attention_mask is None
    )
    if last_row:
        return runner.attend_last_row(query, key, value, scale=scaling).transpose(1, 2), None
    if not sparse:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = runner.attend(layer, query, key, value, scale=scaling)
    return out.transpose(1, 2), None


def _unpadded(mask: torch.Tensor | None) -> bool:
    """Whether a layer's mask holds no padding: None (plain causal), or a bool [B, 1, N, N] mask whose
    diagonal is all True — every real token sees itself, and a padding key is masked on every row, its
    own included. O(N) to check; the window itself comes from the plan, not from the mask."""
    if mask is None:
        return True
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    return bool(mask.diagonal(dim1=-2, dim2=-1).all())


def _padding_runs(mask: torch.Tensor, n: int) -> list[tuple[int, int]] | None:
    """Per sequence, the one contiguous run [start, stop) of real tokens; None if some sequence has another shape.

    mask: bool [B, 1, N, N] (True = attend) as sdpa_mask builds it; the last row sees every real key.
    """
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != n:
        return None
    valid = mask[:, 0, -1, :]
    runs = []
    for row in valid:
        ids = row.nonzero().flatten()
        if ids.numel() == 0 or int(ids[-1] - ids[0]) + 1 != ids.numel():
            return None
        runs.append((int(ids[0]), int(ids[-1]) + 1))
    return runs


def _attend_padded(runner: Runner, layer, q, k, v, scale, runs) -> torch.Tensor:
    """Each sequence's real tokens alone (a loop over the batch, not over heads); padding rows get zeros."""
    batch, heads, n, dim = q.shape
    out = torch.zeros(batch, n, heads, dim, dtype=q.dtype, device=q.device)
    for b, (start, stop) in enumerate(runs):
        sl = slice(start, stop)
        qs, ks, vs = q[b : b + 1, :, sl], k[b : b + 1, :, sl], v[b : b + 1, :, sl]
        if stop - start >= runner.plan.min_tokens:
            res = runner.attend(layer, qs, ks, vs, scale=scale, modality=_sequence_modality(runner, b, n, sl))
        else:
            group = q.shape[1] // k.shape[1]
            res = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
        out[b, sl] = res[0].transpose(0, 1)
    return out


def _sequence_modality(runner: Runner, b: int, n: int, sl: slice) -> torch.Tensor | None:
    """The modality ids of sequence b's real tokens, when the runner holds ids for this [.., n] call."""
    m = runner.modality
    if m is None:
        return None
    m = m if m.dim() == 2 else m[None]
    return m[min(b, m.shape[0] - 1), sl] if m.shape[-1] == n else None


def set_modality(model, modality: torch.Tensor | None) -> None:
    """Modality ids (int [N] or [B, N]: 0 text, 1 image, 2 video; models.modality_ids makes them from
    input_ids) of the prompt the next prefill runs, for the artifact's boundary heads; None clears them.
    Calls of another length (decode steps, other prompts) ignore them."""
    runner = runner_of(model)
    if runner is None:
        raise ValueError("no sparsesearch artifact is applied to this model (runtime.apply first)")
    if modality is not None and (modality.dim() not in (1, 2) or modality.dtype.is_floating_point):
        raise ValueError(f"modality must be int [N] or [B, N], got {modality.dtype} {tuple(modality.shape)}")
    runner.modality = modality


def model_info(model) -> ModelInfo:
    """ModelInfo read off a loaded model (the same facts artifacts record: sparsesearch.models)."""
    from ..models import info_from_model

    return info_from_model(model)


def _attention_modules(model, num_layers: int):
    """The text model's attention modules: they carry `layer_idx` and project q/k/v."""
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and hasattr(module, "q_proj") and hasattr(module, "k_proj"):
            yield module


def apply(model, artifact, *, min_tokens: int | None = None, last_row_only: bool = False, nosa: bool = True) -> Plan:
    """Plan the artifact for this model and route its attention through sparsesearch. Returns the plan.

    artifact: an object with ``manifest`` (dict) and ``heads`` (DataFrame), e.g. from artifacts.load_artifact.
    nosa: when the artifact has ``methods.nosa``, offload decode with its recommended configuration for
    generations given ``nosa_cache(model)`` as their cache (others decode as before).
    min_tokens None: the artifact's measured dense cut-off (plan.artifact_min_tokens).
    """
    from ..kernels._common import SUPPORTED_HEAD_DIMS

    info = model_info(model)
    plan = build_plan(artifact.manifest, artifact.heads, info, min_tokens=min_tokens, last_row_only=last_row_only)
    if info.head_dim not in SUPPORTED_HEAD_DIMS and any(layer.kind != "dense" for layer in plan.layers):
        raise ValueError(f"sparse kernels support head_dim {SUPPORTED_HEAD_DIMS}; this model has {info.head_dim}")
    runner = Runner(plan)
    modules = list(_attention_modules(model, info.num_layers))
    if len({m.layer_idx for m in modules}) != info.num_layers:
        raise ValueError(f"found attention modules for {len({m.layer_idx for m in modules})} of {info.num_layers} layers; unsupported model layout")
    for module in modules:
        setattr(module, _RUNNER, runner)
        setattr(module, _LAYER, plan.layer(module.layer_idx))
    if nosa and (artifact.manifest.get("methods") or {}).get("nosa"):
        attach(model, config_from_artifact(artifact))
    install(model, ATTN_NAME, sparsesearch_attention)
    return plan


def nosa_cache(model):
    """A fresh offloaded NOSA cache (a transformers Cache) for ``model.generate(past_key_values=...)``; the
    applied artifact must have methods.nosa."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError("no NOSA configuration is applied to this model (runtime.apply with an artifact that has methods.nosa)")
    return engine.new_cache()


def remove(model) -> None:
    """Undo ``apply``: the previous attention implementation and no sparsesearch attributes left."""
    detach(model)
    for module in model.modules():
        for name in (_RUNNER, _LAYER):
            if hasattr(module, name):
                delattr(module, name)
    uninstall(model, ATTN_NAME)


def runner_of(model) -> Runner | None:
    """The Runner ``apply`` attached to this model (None when no artifact is applied)."""
    for module in model.modules():
        runner = getattr(module, _RUNNER, None)
        if runner is not None:
            return runner
    return None


def load_sparse_model(spec: str, *, artifact=None, min_tokens: int | None = None, **kwargs):
    """``sparsesearch.models.load_model`` plus, when ``artifact`` (a path) is given, its validation against
    the model and ``apply``. Returns (model, tokenizer, info, plan or None): one more item than
    ``models.load_model``, hence its own name."""
    from ..artifacts import load_artifact
    from ..models import load_model

    model, tokenizer, info = load_model(spec, **kwargs)
    if artifact is None:
        return model, tokenizer, info, None
    loaded = load_artifact(artifact, model_info=info)
    return model, tokenizer, info, apply(model, loaded, min_tokens=min_tokens)
