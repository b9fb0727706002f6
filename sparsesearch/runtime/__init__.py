"""Runtime: plan an artifact once per model, run sparse attention per call through transformers."""

from .hf import ATTN_NAME, apply, load_sparse_model, model_info, remove, runner_of, set_modality, sparsesearch_attention
from .plan import DEFAULT_MIN_TOKENS, LayerPlan, Plan, build_plan
from .run import Runner

__all__ = ["ATTN_NAME", "DEFAULT_MIN_TOKENS", "LayerPlan", "Plan", "Runner", "apply", "build_plan", "load_sparse_model", "runner_of", "model_info", "remove", "set_modality", "sparsesearch_attention"]
