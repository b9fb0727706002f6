"""sweep-nosa end to end (a tiny random Llama with SmolLM2's tokenizer; the real SmolLM2 marked slow),
resume after a kill, composing into an artifact, and bad input refused before the model loads."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import sparsesearch.models
import sparsesearch.nosa.sweep as sweep
from artifact_fixtures import make_artifact
from sparsesearch.artifacts import load_artifact
from sparsesearch_cli.app import app
from tiny_model import make_tiny_model

GRID = ["--budget", "128,256", "--kq-ratio", "0,0.5", "--block-size", "32", "--context", "300", "--decode-steps", "40"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, heads=4, kv_heads=2)


def run_cli(args):
    result = CliRunner().invoke(app, ["sweep-nosa", *[str(a) for a in args]])
    assert result.exit_code == 0, result.output
    return result


def test_sweep_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "art"
    result = run_cli(["--model", tiny_model, *GRID, "--proxy", "snapkv,h2o,persistence", "--out", out, "--json"])
    summary = json.loads(result.stdout)
    art = load_artifact(out)
    table = art.tables["nosa.parquet"]
    configs = summary["configs"]
    assert len(configs) == 3 * 4
    steps = summary["decode_steps"]
    assert len(table) == len(configs) * 2 * 2 * steps  # configs x layers x KV heads x steps
    assert all(c["violations"] == 0 for c in configs)  # every proxy is frozen between block boundaries
    assert all(c["stable_rows"] > 0 and c["unstable_rows"] > 0 for c in configs)
    section = art.manifest["methods"]["nosa"]
    assert section["recommended"]["proxy"] in ("snapkv", "h2o", "persistence")
    assert section["recommended"]["k"] * 32 == section["recommended"]["budget"]
    assert any(c["pareto_bytes"] for c in section["configs"])
    for c in configs:  # quality moves with the budget: a larger budget never has lower recall here
        assert 0 < c["recall"] <= 1 and c["kl"] >= 0 and c["h2d_bytes_per_token"] >= 0
    assert (tmp_path / "art.png").is_file()
    assert not (tmp_path / ".art.nosa-partial").exists()


def test_resume_after_a_kill(tiny_model, tmp_path, monkeypatch):
    settings = sweep.SweepSettings(model=tiny_model, budgets=(128, 256), kq_ratios=(0.0, 0.5), blocks=(32,), proxies=("vnorm",),
                                   context=300, decode_steps=20, out=tmp_path / "art", created="2025-01-01T00:00:00Z")
    real, calls = sweep.run_config, []

    def dies_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "run_config", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(settings)
    assert not (tmp_path / "art").exists() and len(list((tmp_path / ".art.nosa-partial").glob("vnorm-*.json"))) == 2
    monkeypatch.setattr(sweep, "run_config", real)
    resumed = sweep.run_sweep(settings)
    assert resumed.resumed == 2
    fresh = sweep.run_sweep(sweep.SweepSettings(**{**settings.__dict__, "out": tmp_path / "fresh"}))
    assert fresh.resumed == 0
    for a, b in zip(resumed.summaries, fresh.summaries):
        assert a["config"] == b["config"] and a["kl"] == pytest.approx(b["kl"]) and a["h2d_bytes_per_token"] == b["h2d_bytes_per_token"]


def test_into_composes_with_an_existing_artifact(tiny_model, tmp_path):
    from sparsesearch.artifacts import write_artifact
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.models import resolve_model_info

    info = resolve_model_info(tiny_model)
    tri = {"start_layer": 1, "sink": 8, "window": 512, "last": 128}
    base = write_artifact(tmp_path / "art", new_manifest(info, head_index_space="kv", provenance={"kind": "manual"}, methods={"trianglemix": tri}),
                          {"heads.parquet": []})
    run_cli(["--model", tiny_model, "--budget", "128", "--kq-ratio", "0.25", "--block-size", "32", "--context", "200", "--decode-steps", "8",
             "--into", base])
    art = load_artifact(base)
    assert art.manifest["methods"]["trianglemix"] == tri and art.manifest["methods"]["nosa"]["recommended"]["k_q"] == 1
    assert set(art.tables) == {"heads.parquet", "nosa.parquet"}


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(sparsesearch.models, "load_model", refuse)


@pytest.mark.parametrize("args, message", [
    (["--kq-ratio", "0,1.5"], "--kq-ratio 1.5 is outside [0, 1] (k_q > k)"),
    (["--budget", "64"], "--budget 64 (2 blocks of 32) is below sink + window + 1"),
    (["--block-size", "40", "--budget", "160"], "--block-size 40 is not a positive multiple of the pooling stride 16"),
    (["--context", "5000"], "exceeds the context of model"),
    (["--decode-steps", "0"], "--decode-steps must be > 0, got 0"),
    (["--proxy", "snapkv,lru"], "--proxy 'lru' is unknown"),
    (["--proxy", "snapkv", "--budget", "12x"], "--budget must be comma-separated integers, got '12x'"),
    (["--into", "{other}"], "artifact is for 2 layers, model has 3"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_model, tmp_path, no_model_loading, args, message):
    other = make_artifact(tmp_path / "other")  # TINY: 2 layers, 4/2 heads
    defaults = ["--budget", "256", "--kq-ratio", "0.25", "--block-size", "32", "--context", "300", "--decode-steps", "8"]
    args = [a.replace("{other}", str(other)) for a in args]
    out = tmp_path / "art"
    model = make_tiny_model(tmp_path / "m3", layers=3) if "--into" in args else tiny_model
    result = CliRunner().invoke(app, ["sweep-nosa", "--model", model, *defaults, *args, "--out" if "--into" not in args else "--seed", out if "--into" not in args else "0"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not out.exists() and not (tmp_path / ".art.nosa-partial").exists()
    assert sorted(p.name for p in other.iterdir()) == ["heads.parquet", "manifest.json"]


@pytest.mark.slow
def test_sweep_on_smollm2(tmp_path):
    from conftest import smollm2_gguf

    smollm2_gguf()
    out = tmp_path / "smollm2"
    result = run_cli(["--model", "smollm2-135m", "--budget", "256,512", "--kq-ratio", "0,0.25", "--context", "768", "--decode-steps", "32",
                      "--proxy", "snapkv,vnorm", "--out", out, "--json"])
    summary = json.loads(result.stdout)
    art = load_artifact(out)
    assert len(art.tables["nosa.parquet"]) == len(summary["configs"]) * 30 * 3 * 32
    assert all(c["violations"] == 0 for c in summary["configs"])
    assert art.manifest["methods"]["nosa"]["recommended"]["proxy"] in ("snapkv", "vnorm")


def test_sweep_selects_only_on_global_layers_of_a_hybrid_model(tmp_path):
    """Gemma 3 hybrid: sliding layers keep their window; nosa.parquet holds the global layers only."""
    from tiny_model import GEMMA_LAYER_TYPES, make_tiny_gemma

    model = make_tiny_gemma(tmp_path / "gemma")
    out = tmp_path / "art"
    run_cli(["--model", model, "--budget", "128,192", "--kq-ratio", "0.25", "--block-size", "32", "--context", "300",
             "--decode-steps", "24", "--out", out])
    art = load_artifact(out)
    global_layers = [i for i, t in enumerate(GEMMA_LAYER_TYPES) if t == "full_attention"]
    assert sorted(art.tables["nosa.parquet"]["layer"].unique()) == global_layers
    assert art.manifest["methods"]["nosa"]["layers"] == global_layers
