"""Putting an attention function into a transformers model and taking it out again.

This is the one place where the project meets transformers' ``AttentionInterface``. The runtime
(runtime/hf.py), the q/k/v capture (capture.py), NOSA's decode and sweep (nosa/) and SPAVA (spava/model.py)
all come through it.

- ``register(name, fn, mask)`` registers ``fn`` under ``name`` with ``AttentionInterface`` and ``mask`` (SDPA's
  mask builder unless given) with ``AttentionMaskInterface``. It is idempotent: transformers keeps one entry
  per name.
- ``set_text_attention(model, name)`` points the *text decoder* (only) at ``name``. A vision tower keeps
  its own implementation, so a VLM's image encoder never runs a text pattern. On a text-only model that is
  the whole model.
- ``install(model, name, fn, mask)`` / ``uninstall(model, name)`` do both, and remember and put back the
  implementation that was there before. The previous implementation is kept on the model under an
  attribute named after ``name``. Installers of different names therefore nest: each puts back what it
  found. Installing the same name twice keeps the first previous implementation.
- ``routed(model, name, var, value)`` is the same for the span of a ``with`` block, with a context variable
  set for the registered function to read. The previous implementation comes back on exit, also when the
  block raises.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch


def register(name: str, fn: Callable, mask: Callable | None = None) -> str:
    """Register ``fn`` (and ``mask``, default SDPA's mask builder) under ``name``; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask if mask is None else mask)
    return name


def text_attention(model: torch.nn.Module) -> str:
    """The text decoder's attention implementation now."""
    return model.config.get_text_config()._attn_implementation


def set_text_attention(model: torch.nn.Module, name: str) -> None:
    """Point the text decoder (only) at attention implementation ``name``."""
    config = model.config
    text_config = config.get_text_config()
    if text_config is config:
        model.set_attn_implementation(name)
    else:
        key = next(k for k in config.sub_configs if getattr(config, k, None) is text_config)
        model.set_attn_implementation({key: name})
    if text_config._attn_implementation != name:
        raise ValueError(
            f"{model.__class__.__name__} did not accept attention implementation '{name}' "
            "(it does not dispatch through transformers' AttentionInterface)"
        )


def _previous_key(name: str) -> str:
    return f"_sparsesearch_previous_attention_{name}"


def install(model: torch.nn.Module, name: str, fn: Callable, mask: Callable | None = None) -> None:
    """Register ``fn`` under ``name`` and switch the text decoder to it, remembering what ran before (kept
    from the first install when ``name`` is installed again)."""
    register(name, fn, mask)
    key = _previous_key(name)
    if not hasattr(model, key):
        setattr(model, key, text_attention(model))
    set_text_attention(model, name)


def uninstall(model: torch.nn.Module, name: str) -> None:
    """Undo ``install(model, name, ...)``: the remembered implementation back, the attribute gone. A model
    ``name`` was never installed on is left as it is."""
    key = _previous_key(name)
    previous = getattr(model, key, None)
    if previous is not None:
        set_text_attention(model, previous)
        delattr(model, key)


@contextmanager
def routed(model: torch.nn.Module, name: str, var: ContextVar, value) -> Iterator[None]:
    """Within the block ``var`` holds ``value`` and the text decoder runs implementation ``name`` (registered
    by the caller); both are restored on exit, also when the block raises."""
    previous = text_attention(model)
    token = var.set(value)
    try:
        set_text_attention(model, name)
        yield
    finally:
        var.reset(token)
        if text_attention(model) != previous:
            set_text_attention(model, previous)
