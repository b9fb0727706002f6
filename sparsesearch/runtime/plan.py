"""Plan: an artifact turned, once, into what each layer runs. Plain data; no tensors of the model.

Per layer the plan holds head groups — heads that share one pattern and one parameter set — so that a
call runs one index build and one kernel launch per group, never a Python loop over heads. A layer whose
heads are all dense runs SDPA; a TriangleMix layer (methods.trianglemix.start_layer and deeper) runs the
triangle kernel for every head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts.columns import ALL_MODALITIES, params_from_row
from ..models.info import ModelInfo

DEFAULT_MIN_TOKENS = 1024  # below this, sparse attention does not pay for its index; SDPA runs


@dataclass(frozen=True)
class HeadGroup:
    """Heads (ids in the plan's head space) sharing one pattern + params + block shape."""

    pattern: str
    params: object
    heads: tuple[int, ...]
    block_m: int
    block_n: int


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    kind: str  # "dense" | "sparse" | "triangle"
    groups: tuple[HeadGroup, ...] = ()
    triangle: object | None = None  # TriangleParams when kind == "triangle"


@dataclass(frozen=True)
class Plan:
    head_space: str
    layers: tuple[LayerPlan, ...]
    min_tokens: int = DEFAULT_MIN_TOKENS
    notes: tuple[str, ...] = field(default=())
    # Paper 002 §2.4: in prefill, the last layer computes attention for the final query row only (the
    # only row the next token needs); logits at earlier positions are then not meaningful.
    last_row_only: bool = False

    def layer(self, idx: int) -> LayerPlan:
        return self.layers[idx]

    def summary(self) -> dict[str, int]:
        """Count of layers by kind, for logs and reports."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts


def build_plan(manifest: dict, heads, info: ModelInfo, *, min_tokens: int = DEFAULT_MIN_TOKENS, last_row_only: bool = False) -> Plan:
    """Plan from an artifact's manifest and heads table (a pandas DataFrame with the HEADS_SCHEMA columns).

    Rows for specific modality pairs need the boundary kernels (a later issue): those heads run dense and
    the plan says so in ``notes``. Heads with no row run dense.
    """
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    head_space = manifest.get("head_index_space", "query")
    space_heads = info.num_kv_heads if head_space == "kv" else info.num_heads
    notes = []
    rows = heads.to_dict("records") if heads is not None and len(heads) else []
    text_rows = [r for r in rows if r["q_modality"] == ALL_MODALITIES and r["k_modality"] == ALL_MODALITIES]
    if len(text_rows) != len(rows):
        notes.append(f"{len(rows) - len(text_rows)} modality-pair rows need boundary kernels (not yet in the runtime); those heads run dense")
    by_layer: dict[int, dict[tuple, list[int]]] = {}
    for row in text_rows:
        layer, head = int(row["layer"]), int(row["head"])
        if not 0 <= layer < info.num_layers or not 0 <= head < space_heads:
            raise ValueError(f"heads row (layer {layer}, head {head}) outside the model's {info.num_layers} layers x {space_heads} {head_space} heads")
        if row["pattern"] == "dense":
            continue
        params = params_from_row(row)
        key = (row["pattern"], params, int(row["block_m"]), int(row["block_n"]))
        by_layer.setdefault(layer, {}).setdefault(key, []).append(head)
    tri = (manifest.get("methods") or {}).get("trianglemix") or {}
    start = tri.get("start_layer")
    tri_params = None
    if start is not None:
        from ..patterns.triangle import TriangleParams

        tri_params = TriangleParams(sink=int(tri["sink"]), window=int(tri["window"]), last=int(tri["last"]))
    layers = []
    for layer in range(info.num_layers):
        if tri_params is not None and layer >= int(start):
            layers.append(LayerPlan(layer, "triangle", triangle=tri_params))
            continue
        groups = tuple(
            HeadGroup(pattern, params, tuple(sorted(ids)), bm, bn)
            for (pattern, params, bm, bn), ids in sorted(by_layer.get(layer, {}).items(), key=lambda kv: min(kv[1]))
        )
        layers.append(LayerPlan(layer, "sparse" if groups else "dense", groups))
    return Plan(head_space, tuple(layers), min_tokens, tuple(notes), last_row_only)
