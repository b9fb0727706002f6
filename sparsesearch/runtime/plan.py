"""Plan: an artifact turned, once, into what each layer runs. Plain data; no tensors of the model.

Per layer the plan holds head groups — heads that share one pattern and one parameter set — so that a
call runs one index build and one kernel launch per group, never a Python loop over heads. A layer whose
heads are all dense runs SDPA; a TriangleMix layer (methods.trianglemix.start_layer and deeper) runs the
triangle kernel for every head.

Hybrid models (Gemma 3): a sliding-window layer of the *model* (ModelInfo.layer_types) is a "window"
layer whatever the artifact says — one group, every head, ashape(sink 0, local sliding_window), which is
exactly the model's own attention. TriangleMix from a start layer applies to the global layers only (a
sliding layer's window already bounds its cost; triangle would drop its last keys' context — paper 002
probes full-attention models).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts.columns import WINDOW_BLOCK, check_window_rows, is_global, params_from_row, window_params
from ..execute import HeadGroup
from ..patterns.boundary import scope_name
from ..models.info import ModelInfo

DEFAULT_MIN_TOKENS = 1024  # below this, sparse attention does not pay for its index; SDPA runs


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    kind: str  # "dense" | "sparse" | "triangle" | "window" (a hybrid model's sliding layer: its own window)
    groups: tuple[HeadGroup, ...] = ()  # the global (all x all) patterns: every head's, fallback included
    triangle: object | None = None  # TriangleParams when kind == "triangle"
    # Boundary heads (paper 000 §3.2): (head, type) for heads whose type is k, q or 2d, and the region
    # patterns as (scope "q_mod>k_mod", groups). They run when a call carries modality ids.
    boundary: tuple[tuple[int, str], ...] = ()
    regions: tuple[tuple[str, tuple[HeadGroup, ...]], ...] = ()

    def region_groups(self, scope: str) -> tuple[HeadGroup, ...]:
        return next((groups for name, groups in self.regions if name == scope), ())


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


def artifact_min_tokens(manifest: dict) -> int:
    """The dense cut-off an artifact carries (methods.mminference.dense_cutoff, measured by calibrate on its
    device; search/cutoff.py), else DEFAULT_MIN_TOKENS. A measured "never faster" (min_tokens null) means
    dense up to the longest length measured."""
    cutoff = ((manifest.get("methods") or {}).get("mminference") or {}).get("dense_cutoff")
    if not cutoff:
        return DEFAULT_MIN_TOKENS
    return runtime_min_tokens(cutoff)


def runtime_min_tokens(cutoff: dict) -> int:
    """The runtime threshold a cut-off record implies: its min_tokens, or one past the longest measured
    length when sparse never won (dense wherever it was measured to be faster)."""
    return cutoff["min_tokens"] if cutoff.get("min_tokens") is not None else int(cutoff["measured_up_to"]) + 1


def build_plan(manifest: dict, heads, info: ModelInfo, *, min_tokens: int | None = None, last_row_only: bool = False) -> Plan:
    """Plan from an artifact's manifest and heads table (a pandas DataFrame with the HEADS_SCHEMA columns).
    min_tokens None: the artifact's own cut-off (``artifact_min_tokens``).

    Every head runs its global (all x all) row. A head whose rows carry boundary k, q or 2d also gets its
    region rows (patterns/boundary.py): calls that carry modality ids (Runner.modality) run those; calls
    without fall back to the global row. Heads with no row run dense.
    """
    min_tokens = artifact_min_tokens(manifest) if min_tokens is None else min_tokens
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    head_space = manifest.get("head_index_space", "query")
    space_heads = info.num_kv_heads if head_space == "kv" else info.num_heads
    notes = []
    rows = heads.to_dict("records") if heads is not None and len(heads) else []
    check_window_rows(rows, info.layer_types, info.sliding_window)
    for row in rows:
        layer, head = int(row["layer"]), int(row["head"])
        if not 0 <= layer < info.num_layers or not 0 <= head < space_heads:
            raise ValueError(f"heads row (layer {layer}, head {head}) outside the model's {info.num_layers} layers x {space_heads} {head_space} heads")
    kinds = {(int(r["layer"]), int(r["head"])): r["boundary"] for r in rows if r["boundary"] != "none"}
    by_layer = _grouped([r for r in rows if is_global(r)])
    by_region: dict[int, dict[str, dict]] = {}
    for row in rows:
        if not is_global(row) and (int(row["layer"]), int(row["head"])) in kinds:
            scope = scope_name(row["q_modality"], row["k_modality"])
            by_region.setdefault(int(row["layer"]), {}).setdefault(scope, []).append(row)
    if kinds:
        counts = {k: sum(1 for v in kinds.values() if v == k) for k in sorted(set(kinds.values()))}
        notes.append(f"boundary heads {counts}: their region patterns run when a call carries modality ids "
                     "(runtime.set_modality), on gathered copies of each region's rows and keys")
    tri = (manifest.get("methods") or {}).get("trianglemix") or {}
    start = tri.get("start_layer")
    tri_params = None
    if start is not None:
        from ..patterns.triangle import TriangleParams

        tri_params = TriangleParams(sink=int(tri["sink"]), window=int(tri["window"]), last=int(tri["last"]))
    layers = []
    every_head = tuple(range(space_heads))
    for layer in range(info.num_layers):
        window = info.window_of(layer)
        if window is not None:
            group = HeadGroup("ashape", window_params(window), every_head, WINDOW_BLOCK, WINDOW_BLOCK)
            layers.append(LayerPlan(layer, "window", (group,)))
            continue
        if tri_params is not None and layer >= int(start):
            layers.append(LayerPlan(layer, "triangle", triangle=tri_params))
            continue
        groups = _groups(by_layer.get(layer, {}))
        boundary = tuple(sorted((h, kind) for (l, h), kind in kinds.items() if l == layer))
        regions = tuple((scope, _groups(_grouped(scope_rows, keep_dense=True).get(layer, {}))) for scope, scope_rows in sorted(by_region.get(layer, {}).items()))
        layers.append(LayerPlan(layer, "sparse" if groups or boundary else "dense", groups, boundary=boundary, regions=regions))
    return Plan(head_space, tuple(layers), min_tokens, tuple(notes), last_row_only)


def _grouped(rows: list[dict], keep_dense: bool = False) -> dict[int, dict[tuple, list[int]]]:
    """layer -> {(pattern, params, block_m, block_n): heads}; dense rows only with keep_dense (a region's
    dense pattern still has to run on the region; a global dense head just takes SDPA)."""
    by_layer: dict[int, dict[tuple, list[int]]] = {}
    for row in rows:
        if row["pattern"] == "dense" and not keep_dense:
            continue
        key = (row["pattern"], params_from_row(row), int(row["block_m"]), int(row["block_n"]))
        by_layer.setdefault(int(row["layer"]), {}).setdefault(key, []).append(int(row["head"]))
    return by_layer


def _groups(keyed: dict[tuple, list[int]]) -> tuple[HeadGroup, ...]:
    return tuple(
        HeadGroup(pattern, params, tuple(sorted(ids)), bm, bn)
        for (pattern, params, bm, bn), ids in sorted(keyed.items(), key=lambda kv: min(kv[1]))
    )
