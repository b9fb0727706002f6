"""Load a model (weights, tokenizer or processor) for a spec resolved by ``resolve.py``."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from . import dequantized
from .info import ModelInfo
from .resolve import VLM_ARCHITECTURES, ResolvedModel, resolve

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(
    spec: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
):
    """Load ``spec`` (directory, hub id from the cache, .gguf file or ``smollm2-135m``) in eval mode.

    dtype: "auto" keeps the checkpoint's dtype on CUDA (bfloat16 for GGUF, which is dequantised) and
    uses float32 on CPU; or one of "float32", "bfloat16", "float16". device: "auto" (CUDA when
    available), "cpu" or "cuda". Returns ``(model, tokenizer_or_processor, info)``: a processor for VLMs
    when the directory has one, else a tokenizer, else None (a directory without tokenizer files);
    ``info.dtype`` is the dtype actually loaded. device_map / max_memory: the model split over several GPUs
    by accelerate (an accelerate strategy name or a {module: device} dict; {gpu index: "20GiB"}), checked by
    ``split.check_split`` before this; None: the whole model on ``device``.
    """
    device = check_load_options(dtype, device)
    resolved = resolve(spec, trust_remote_code=trust_remote_code)
    torch_dtype = _choose_dtype(dtype, device, resolved)

    import transformers

    model_class = getattr(transformers, resolved.info.architecture)
    kwargs = dict(
        config=resolved.config,  # already read: saves re-parsing it (≈3 s for a GGUF)
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        local_files_only=True,
    )
    source = resolved.path
    if resolved.gguf_file and dequantized.enabled():
        # read the weights dequantised by an earlier load (models/dequantized.py); the GGUF only the first time
        source = _dequantized(resolved, model_class, attn_implementation)
        del kwargs["config"]  # the directory's own: the GGUF's config object is the reader's, quantizer and all
    elif resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    elif device != "cpu":
        kwargs["device_map"] = device  # weights go straight to the GPU, no host-side copy of a 7B model
    model = model_class.from_pretrained(source, **kwargs).eval()
    tokenizer = _load_tokenizer(resolved, trust_remote_code, source)
    info: ModelInfo = replace(resolved.info, dtype=str(model.dtype).removeprefix("torch."))
    return model, tokenizer, info


def check_load_options(dtype: str, device: str) -> str:
    """Refuse a dtype or device ``load_model`` cannot honour (before any weights are read); returns the
    device "auto" resolves to here."""
    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"dtype '{dtype}' is not one of auto, {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise ValueError(f"device '{device}' is not one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device; use --device cpu")
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def _choose_dtype(dtype: str, device: str, resolved: ResolvedModel) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # half-precision matmuls are slow on CPU and SDPA's CPU kernels are fp32-first
    if resolved.gguf_file:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES.get(resolved.info.dtype, torch.bfloat16)


def _dequantized(resolved: ResolvedModel, model_class, attn_implementation: str):
    """The GGUF's dequantised directory (models/dequantized.py), built on first use from a float32 CPU load."""
    path = dequantized.cache_dir(resolved.info.revision)
    if not dequantized.ready(path):
        logger.info("dequantising %s once into %s", resolved.gguf_file, path)
        dequantized.build(path, lambda: (
            model_class.from_pretrained(resolved.path, config=resolved.config, gguf_file=resolved.gguf_file, dtype=torch.float32,
                                        attn_implementation=attn_implementation, local_files_only=True),
            _load_tokenizer(resolved, False),
        ))
    return path


def _load_tokenizer(resolved: ResolvedModel, trust_remote_code: bool, source=None):
    """The tokenizer (or a VLM's processor) of ``resolved``, from ``source`` when that is a directory other than
    the GGUF's (its dequantised copy, which holds the same tokenizer saved)."""
    from transformers import AutoProcessor, AutoTokenizer

    if source is not None and source != resolved.path:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    if resolved.gguf_file:
        return AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file, local_files_only=True)
    if not any((resolved.path / name).is_file() for name in TOKENIZER_FILES):
        logger.warning("model '%s' has no tokenizer files; returning no tokenizer", resolved.spec)
        return None
    common = dict(trust_remote_code=trust_remote_code, local_files_only=True)
    if resolved.info.architecture in VLM_ARCHITECTURES:
        try:
            return AutoProcessor.from_pretrained(resolved.path, **common)
        except (OSError, ValueError, TypeError) as exc:  # a text-only dump of a VLM: fall back to its tokenizer
            logger.warning("model '%s': no processor (%s); loading the tokenizer only", resolved.spec, exc)
    return AutoTokenizer.from_pretrained(resolved.path, **common)
