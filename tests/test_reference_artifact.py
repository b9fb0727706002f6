"""The reference artifact the tool produced for SmolLM2 (README) must keep loading and planning: a schema or
runtime change that breaks it needs a migration, not a silent failure."""

from pathlib import Path

from sparsesearch.artifacts import load_artifact
from sparsesearch.runtime import build_plan

REFERENCE = Path(__file__).resolve().parents[1] / "artifacts" / "reference" / "smollm2-135m-4k"


def test_reference_artifact_loads_and_plans():
    art = load_artifact(REFERENCE)
    info = art.model_info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    tri = art.manifest["methods"]["trianglemix"]
    assert art.manifest["methods"]["mminference"]["fidelity"]["samples"] >= 1
    plan = build_plan(art.manifest, art.heads, info)
    counts = plan.summary()
    assert counts.get("triangle", 0) == info.num_layers - tri["start_layer"]
    assert counts.get("sparse", 0) + counts.get("triangle", 0) + counts.get("dense", 0) == info.num_layers
    assert 0.0 < art.heads["density"].mean() <= 0.35
