"""probe-layers end to end on a tiny random Llama (real tokenizer): probe, start-layer rule, artifact,
composition with per-head patterns, free correctness checks, and bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from sparsesearch.probe.probe import ProbeResult, ProbeSettings, StartRule
from sparsesearch.probe.run import ProbeConfig, run_probe, smallest_within
from sparsesearch_cli.app import app
from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=4)


def _cfg(model, out, **kw):
    settings = ProbeSettings(samples=2, tokens=320, sink=16, window=32, last=32)
    return ProbeConfig(model=model, settings=settings, out=out, created="2026-01-01T00:00:00Z", **kw)


def test_probe_writes_sections_and_start_layer(tiny, tmp_path):
    outcome = run_probe(_cfg(tiny, tmp_path / "tri"))
    r = outcome.result
    assert r.grad_mean.shape == (4, 2, 3) and r.samples == 2
    # Free check (docs/peers.md): the last layer's Middle gradient is exactly 0 — nothing after it reads the
    # middle rows' outputs, and only the last row feeds y_gt.
    assert float(r.abs_mean[-1, :, 1].abs().max()) == 0.0
    # Att sums to one per row: the three sections' mean probabilities weighted by their sizes give N rows.
    assert bool((r.att_mean >= 0).all()) and bool((r.abs_mean >= r.grad_mean.abs() - 1e-12).all())
    assert 0 <= outcome.start_layer <= 4
    manifest = json.loads((tmp_path / "tri" / "manifest.json").read_text())
    tri = manifest["methods"]["trianglemix"]
    assert tri["start_layer"] == outcome.start_layer and tri["sink"] == 8 and tri["window"] == 512 and tri["last"] == 128
    assert tri["threshold"] == 0.2 and "middle" in tri["rule"] and tri["probe"]["samples"] == 2
    layers = pd.read_parquet(tmp_path / "tri" / "layers.parquet")
    assert len(layers) == 4 * 2 and {"grad_middle", "grad_middle_se", "abs_grad_stream", "att_last"} <= set(layers.columns)
    assert outcome.plot is not None and outcome.plot.is_file()


def test_probe_composes_with_per_head_patterns_and_runs(tiny, tmp_path):
    from sparsesearch.calibrate import CalibrateConfig, calibrate
    from sparsesearch.runtime import load_sparse_model

    space = {"name": "s", "format": 1, "reference_tokens": 1024, "block_m": 32, "block_n": 32,
             "target": {"pattern": "ashape", "params": {"sink": 64, "local": 256}},
             "candidates": [{"pattern": "ashape", "params": {"sink": 32, "local": 128}}]}
    (tmp_path / "space.json").write_text(json.dumps(space))
    calibrate(CalibrateConfig(model=tiny, data="synthetic:passkey", search_space=str(tmp_path / "space.json"), max_tokens=320,
                              out=tmp_path / "art", eval_data=None, created="2026-01-01T00:00:00Z"))
    heads_before = (tmp_path / "art" / "heads.parquet").read_bytes()
    outcome = run_probe(_cfg(tiny, tmp_path / "art"))
    assert (tmp_path / "art" / "heads.parquet").read_bytes() == heads_before, "per-head patterns are kept"
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["methods"]["mminference"] is not None and manifest["methods"]["trianglemix"]["start_layer"] == outcome.start_layer
    model, tok, info, plan = load_sparse_model(tiny, artifact=tmp_path / "art", min_tokens=64)
    kinds = plan.summary()
    assert kinds.get("triangle", 0) == 4 - outcome.start_layer
    ids = torch.randint(0, 1000, (1, 300))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 303)


def test_start_rule_and_validation_choice():
    mean = torch.zeros(6, 1, 3)
    mean[:, 0, 1] = torch.tensor([1.0, 3.0, 2.0, 0.5, 0.2, 0.0])  # middle |grad| per layer
    result = ProbeResult(mean, mean, mean, mean, mean, mean, 1)
    assert StartRule(0.2).choose(result) == 3  # 0.2 x peak 3.0 = 0.6: layers 3, 4, 5 stay below
    assert StartRule(0.05).choose(result) == 5  # 0.15: only the last layer (0.0) stays below
    rows = [{"start_layer": None, "accuracy": 1.0, "kl": 0.0}, {"start_layer": 0, "accuracy": 0.5, "kl": 0.4},
            {"start_layer": 2, "accuracy": 1.0, "kl": 0.01}, {"start_layer": 4, "accuracy": 1.0, "kl": 0.002}]
    assert smallest_within(rows, 0.05) == 2
    assert smallest_within(rows, 0.005) == 4


@pytest.mark.parametrize("args, message", [
    (["--last", "320"], "--last must be smaller than --tokens"),
    (["--samples", "0"], "--samples must be >= 1"),
    (["--tokens", "99999"], "exceeds the model's context"),
    (["--threshold", "1.5"], "--threshold must be in (0, 1)"),
])
def test_cli_bad_input_exits_2(tiny, tmp_path, args, message):
    base = ["probe-layers", "--model", tiny, "--tokens", "320", "--samples", "1", "--out", str(tmp_path / "p")]
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p").exists()


def test_probe_under_gradient_checkpointing_matches(tiny):
    """Long probes run with gradient checkpointing (attention runs twice per layer): same sums."""
    from sparsesearch.models import load_model
    from sparsesearch.probe.probe import probe_sample
    from sparsesearch.probe.sections import SectionSpec

    model, tok, info = load_model(tiny, dtype="float32", device="cpu")
    ids = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(1))
    spec = SectionSpec(sink=8, window=16, last=16)
    plain = probe_sample(model, ids, 7, spec, device="cpu")
    model.gradient_checkpointing_enable()
    model.train()
    try:
        checkpointed = probe_sample(model, ids, 7, spec, device="cpu")
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    for name in ("grad", "abs", "att"):
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-12)
