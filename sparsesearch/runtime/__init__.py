"""Runtime: plan an artifact once per model, run sparse attention per call through transformers."""

from .hf import ATTN_NAME, apply, load_model, model_info, remove, runner_of, set_modality, sparsesearch_attention
from .plan import DEFAULT_MIN_TOKENS, HeadGroup, LayerPlan, Plan, build_plan
from .run import Runner

__all__ = ["ATTN_NAME", "DEFAULT_MIN_TOKENS", "HeadGroup", "LayerPlan", "Plan", "Runner", "apply", "build_plan", "load_model", "runner_of", "model_info", "remove", "set_modality", "sparsesearch_attention"]

from .hf import nosa_cache  # noqa: E402 - NOSA offloaded decode (sparsesearch/nosa/engine.py)

__all__ += ["nosa_cache"]
