"""NVIDIA ModelOpt ``sparse_attention_config``: the block ModelOpt's HF export puts in a model's config.json, which
TensorRT-LLM and ModelOpt's vLLM plugin read (docs/peers.md, "Where a searched artifact can be deployed"; the
schema is ``modelopt/torch/sparsity/attention_sparsity/conversion.py`` ``export_sparse_attention_config`` and its
reader ``plugins/sparse_attn_config.py`` ``load_from_checkpoint_metadata``, nvidia-modelopt 0.47).

ModelOpt configures attention per module class plus an ``ignore`` list of modules kept dense, with algorithms of
its own (``skip_softmax``: a calibrated threshold; ``sparse_softmax``: N:M). None of our pattern families has an
equivalent, so this export carries only what the two share:

* ``config_groups.group_0``: ``algorithm`` "skip_softmax", ``targets`` the model's attention class (named from
  the architecture, ModelOpt's own fallback "Attention" when it has no ``*ForCausalLM`` name), ``ignore`` the
  layers where every head runs dense in our runtime (as ``model.layers.{L}.self_attn``), ``target_sparsity``
  ``{"prefill": 1 - mean density}`` over the other layers' heads whose density the artifact measured;
* ``producer``: ``{"name": "sparsesearch", "version": ...}``.

Dropped: every per-head pattern and its parameters (ModelOpt runs its own skip-softmax in every layer not
ignored), TriangleMix's triangle, modality rows, decode. No ``threshold_scale_factor`` is written: ModelOpt
calibrates (a, b) on the model, we do not, and an invented pair would set thresholds nobody measured. ModelOpt
0.47's reader applies ``ignore`` and ``target_sparsity`` only with a calibrated ``threshold_scale_factor``;
without it, it resolves the group to its preset ``SKIP_SOFTMAX_TRITON_DEFAULT``. The block is therefore a record
for ModelOpt's calibration (which layers to keep dense, what sparsity the search reached), not a config that runs
our patterns.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean

from ..artifacts.io import Artifact
from ._common import effective_rows, write_file_atomic

FORMAT = "modelopt"
ALGORITHM = "skip_softmax"
ALGORITHMS = ("skip_softmax", "sparse_softmax", "triton_sparse_softmax")  # what ModelOpt 0.47's reader knows
LAYER_NAME = "model.layers.{layer}.self_attn"
FALLBACK_TARGET = "Attention"  # ModelOpt's own target when no attention class is known
ARCH_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")


def attention_class(architecture: str | None) -> str:
    """transformers' attention class name of an architecture ("LlamaForCausalLM" -> "LlamaAttention")."""
    for suffix in ARCH_SUFFIXES:
        if architecture and architecture.endswith(suffix) and len(architecture) > len(suffix):
            return architecture[: -len(suffix)] + "Attention"
    return FALLBACK_TARGET


def dense_layers(rows: dict[tuple[int, int], dict], num_layers: int) -> list[int]:
    """Layers whose every head runs dense (``rows`` as ``effective_rows`` returns them)."""
    patterns: dict[int, set[str]] = {layer: set() for layer in range(num_layers)}
    for (layer, _), row in rows.items():
        patterns[layer].add(row["pattern"])
    return [layer for layer, kinds in patterns.items() if kinds == {"dense"}]


def measured_sparsity(rows: dict[tuple[int, int], dict], ignore: list[int]) -> float | None:
    """1 - mean measured density of the heads outside ``ignore`` (None when none was measured)."""
    densities = [row["density"] for (layer, _), row in rows.items() if layer not in ignore and row.get("density") is not None]
    return round(1.0 - fmean(densities), 6) if densities else None


def export_modelopt(artifact: Artifact) -> dict:
    """The ``sparse_attention_config`` block (module docstring)."""
    manifest = artifact.manifest
    model = manifest["model"]
    rows, _ = effective_rows(artifact, FORMAT)
    ignore = dense_layers(rows, model["num_layers"])
    group = {"algorithm": ALGORITHM, "targets": [attention_class(model.get("text_architecture") or model.get("architecture"))]}
    if ignore:
        group["ignore"] = [LAYER_NAME.format(layer=layer) for layer in ignore]
    sparsity = measured_sparsity(rows, ignore)
    if sparsity is not None:
        group["target_sparsity"] = {"prefill": sparsity}
    producer = manifest.get("producer") or {}
    return {"config_groups": {"group_0": group},
            "producer": {"name": "sparsesearch", "version": str(producer.get("version", "unknown"))}}


def write_modelopt(artifact: Artifact, out) -> Path:
    """Write the block as JSON at ``out`` whole or not at all."""
    return write_file_atomic(out, (json.dumps(export_modelopt(artifact), indent=1, sort_keys=True) + "\n").encode())
