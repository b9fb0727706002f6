"""Models: load (directory, hub cache, GGUF, ``smollm2-135m``), describe (ModelInfo), modality ids per
token, and capture of post-RoPE Q/K/V through a registered attention function.

Public API::

    resolve_model_info(spec, *, trust_remote_code=False) -> ModelInfo          # config only, fast
    load_model(spec, *, dtype="auto", device="auto", trust_remote_code=False,
               attn_implementation="sdpa") -> (model, tokenizer_or_processor, ModelInfo)
    info_from_model(model, *, spec=None, revision="") -> ModelInfo             # a model loaded elsewhere
    modality_ids(input_ids [B, N], info) -> LongTensor [B, N]                  # MODALITIES = text, image, video
    capture_qkv(model, inputs, *, layers=None, on_layer=None, to_cpu=True,
                with_output=False, with_lse=False, info=None) -> list[LayerCapture] | None

Supported architectures and notes: docs/models.md.
"""

from .capture import CAPTURE_ATTENTION, LayerCapture, attention_capture, attention_lse, capture_qkv
from .info import FULL, SLIDING, ModelInfo
from .load import load_model
from .modality import IMAGE, MODALITIES, TEXT, VIDEO, modality_ids, token_modality_ids
from .resolve import (
    GEMMA3_ALIAS,
    SMOLLM2_ALIAS,
    SUPPORTED_ARCHITECTURES,
    file_sha256,
    hub_cache_dir,
    info_from_model,
    resolve_model_info,
    weights_sha256,
)

__all__ = [
    "CAPTURE_ATTENTION",
    "FULL",
    "IMAGE",
    "MODALITIES",
    "GEMMA3_ALIAS",
    "SLIDING",
    "SMOLLM2_ALIAS",
    "SUPPORTED_ARCHITECTURES",
    "TEXT",
    "VIDEO",
    "LayerCapture",
    "ModelInfo",
    "attention_capture",
    "attention_lse",
    "capture_qkv",
    "file_sha256",
    "hub_cache_dir",
    "info_from_model",
    "load_model",
    "modality_ids",
    "resolve_model_info",
    "token_modality_ids",
    "weights_sha256",
]
