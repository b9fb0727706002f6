"""Summaries of a loaded artifact: what `sparsesearch inspect` shows (plain data, rendered by the CLI)."""

from __future__ import annotations

from collections import Counter
from statistics import fmean

from .columns import is_global
from .io import Artifact
from .tables import HEADS_FILE

METRICS = ("density", "recall", "output_error", "latency_ms", "score")


def effective_densities(manifest: dict, rows: list[dict]) -> dict[tuple[int, int], float | None]:
    """Per (layer, head): the attention density the runtime computes — the global row's, or for a K/Q/2D
    head the calibration's density of its composed regions (manifest boundary_search scores)."""
    report = ((manifest.get("methods") or {}).get("mminference") or {}).get("boundary_search")
    scores = report.get("scores", {}) if isinstance(report, dict) else {}
    out = {}
    for r in rows:
        if not is_global(r):
            continue
        layer, head = int(r["layer"]), int(r["head"])
        kind = r["boundary"]
        entry = scores.get(str(layer), {}).get(kind)
        out[(layer, head)] = entry["density"][head] if kind != "none" and entry and "density" in entry else r.get("density")
    return out


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"count": len(values), "min": min(values), "mean": fmean(values), "max": max(values)}


def reasons(rows: list[dict]) -> list[dict]:
    """The rows that carry a ``reason`` (why the pick is not the head's best admissible sparse candidate),
    in stored order: layer, head, modality pair, pattern and the reason."""
    return [{"layer": r["layer"], "head": r["head"], "q_modality": r["q_modality"], "k_modality": r["k_modality"],
             "pattern": r["pattern"], "reason": r["reason"]} for r in rows if r.get("reason")]


def ties(rows: list[dict]) -> list[dict]:
    """The rows whose pick tied a candidate of another kind (heads.parquet ``tie``: it won on cost between
    equal objectives, a coin toss between the two kinds), in stored order: layer, head, modality pair,
    pattern, the tied kind and the pick's output error."""
    return [{"layer": r["layer"], "head": r["head"], "q_modality": r["q_modality"], "k_modality": r["k_modality"],
             "pattern": r["pattern"], "tie": r["tie"], "output_error": r["output_error"]} for r in rows if r.get("tie")]


def summarize(artifact: Artifact) -> dict:
    """Model, provenance, methods, files, and per-layer pattern and boundary mix with mean density and
    score. Per-layer figures and metrics cover the global (all x all) rows, one per head; the modality
    region rows of multi-modal calibrations are counted in ``modality_pairs``. On a hybrid model each layer
    says whether it is "sliding" (its rows are the model's window, ``window``) or "global" (searched).
    ``reasons``: the rows whose pick is not their best admissible candidate, with why (``reasons``);
    ``ties``: the rows whose pick tied another kind (``ties``), and per layer the global rows that did."""
    m = artifact.manifest
    model = m["model"]
    rows = artifact.head_rows() if HEADS_FILE in artifact.tables else []
    global_rows = [r for r in rows if is_global(r)]
    patterns = sorted({r["pattern"] for r in global_rows})
    types = model.get("layer_types") or ["full_attention"] * model["num_layers"]
    layers = []
    for layer in range(model["num_layers"]):
        mine = [r for r in global_rows if r["layer"] == layer]
        counts = Counter(r["pattern"] for r in mine)
        densities = [r["density"] for r in mine if r["density"] is not None]
        scores = [r["score"] for r in mine if r["score"] is not None]
        sliding = types[layer] == "sliding_attention"
        layers.append({
            "layer": layer,
            # A hybrid model's sliding layer: its rows are the model's own window (not searched; columns.py).
            "attention": "sliding" if sliding else "global",
            "window": model.get("sliding_window") if sliding else None,
            "rows": len(mine),
            "patterns": {p: counts.get(p, 0) for p in patterns},
            "boundaries": dict(sorted(Counter(r["boundary"] for r in mine if r["boundary"] != "none").items())),
            "ties": sum(1 for r in mine if r.get("tie")),
            "mean_density": fmean(densities) if densities else None,
            "mean_score": fmean(scores) if scores else None,
        })
    return {
        "path": str(artifact.path),
        "schema_version": m["schema_version"],
        "created": m["created"],
        "producer": m["producer"],
        "model": {k: model[k] for k in ("id", "revision", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "dtype")}
        | {"sliding_layers": [i for i, t in enumerate(types) if t == "sliding_attention"], "sliding_window": model.get("sliding_window")},
        "head_index_space": m["head_index_space"],
        "provenance": m["provenance"],
        "methods": {name: entry for name, entry in m["methods"].items() if entry is not None},
        "calibration": m["calibration"],
        "files": m["files"],
        "rows": len(rows),
        "patterns": dict(sorted(Counter(r["pattern"] for r in rows).items())),
        "boundaries": dict(sorted(Counter(r["boundary"] for r in rows).items())),
        "modality_pairs": dict(sorted(Counter(f"{r['q_modality']}->{r['k_modality']}" for r in rows).items())),
        "metrics": {name: _stats([r[name] for r in global_rows if r[name] is not None]) for name in METRICS},
        "layers": layers,
        "reasons": reasons(rows),
        "ties": ties(rows),
        # How stable each head's pick was across calibration samples (search/stability.py; None with one sample).
        "stability": ((m.get("methods") or {}).get("mminference") or {}).get("stability"),
    }
