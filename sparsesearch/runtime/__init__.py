"""Runtime: plan an artifact once per model, run sparse attention per call through transformers, and
NOSA's offloaded decode (nosa_config, nosa_proxies, nosa_selection, nosa_device, nosa_engine, offload_cache).

The public names below come from their modules on first use: importing the package (as ``sparsesearch.nosa``
does for the NOSA modules) imports none of them, so only ``hf`` and ``offload_cache`` load transformers.
"""

from __future__ import annotations

import importlib

_FROM = {
    "ATTN_NAME": "hf", "apply": "hf", "load_sparse_model": "hf", "model_info": "hf", "nosa_cache": "hf", "remove": "hf",
    "runner_of": "hf", "set_modality": "hf", "sparsesearch_attention": "hf",
    "DEFAULT_MIN_TOKENS": "plan", "LayerPlan": "plan", "Plan": "plan", "build_plan": "plan",
    "Runner": "run",
}


def __getattr__(name: str):
    if name in _FROM:
        return getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTN_NAME", "DEFAULT_MIN_TOKENS", "LayerPlan", "Plan", "Runner", "apply", "build_plan", "load_sparse_model", "nosa_cache", "runner_of", "model_info", "remove", "set_modality", "sparsesearch_attention"]
