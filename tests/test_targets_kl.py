"""--target-kl measurement on the tiny random Llama (CPU): the dense run over the tuning prompts is made once
per target search and gives the same numbers as a fresh dense run per point; tuning prompts come from the
calibration part of the data, never the held-out part."""

from __future__ import annotations

import pytest

from sparsesearch import fidelity
from sparsesearch.calibrate import CalibrateConfig
from sparsesearch.tuning import fidelity_kl, tuning_kl, tuning_samples
from sparsesearch.fidelity import evaluate_fidelity
from test_fidelity import _ashape_artifact
from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sparsesearch.models import load_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2), dtype="float32", device="cpu")


@pytest.fixture()
def story(tmp_path):
    """A .txt source: its first half calibrates, its second half is held out (data/natural.py)."""
    path = tmp_path / "story.txt"
    path.write_text("".join(f"Line {i}: the river {i % 7} runs past mill {i % 5}; the miller counts {i % 11} sacks.\n" for i in range(400)))
    return str(path)


def _count_dense_runs(monkeypatch) -> list:
    """Spy on fidelity.attend (the real function still runs): one entry per dense (artifact None) run."""
    calls, original = [], fidelity.attend

    def counted(model, tok, samples, artifact=None, **kw):
        if artifact is None:
            calls.append(len(samples))
        return original(model, tok, samples, artifact, **kw)

    monkeypatch.setattr(fidelity, "attend", counted)
    return calls


def test_the_dense_model_runs_once_per_target_search_with_unchanged_results(tiny, story, monkeypatch, tmp_path):
    model, tok, info = tiny
    artifact, rows = _ashape_artifact(info)
    _, narrow = _ashape_artifact(info, sink=16, local=16)
    rows, narrow = ([{**r, "density": 0.5} for r in x] for x in (rows, narrow))  # search rows carry a density
    cfg = CalibrateConfig(data=story, max_tokens=300, samples=1, tune_samples=2, out=tmp_path / "a")
    dense_runs = _count_dense_runs(monkeypatch)
    kl_of = tuning_kl(cfg, model, tok, artifact.manifest, [])
    allocations = [rows, narrow, rows[:1]]  # three points of a search, one twice
    got = [kl_of(a) for a in allocations + [rows]]
    assert dense_runs == [2], "one dense run over both tuning prompts, shared by all four measurements"
    assert got[0] == got[3] and got[1] > got[0] > got[2] > 0  # narrower window: larger KL; one sparse head: smaller

    # Unchanged: each point's KL equals a from-scratch dense + sparse comparison on the same prompts.
    dense_runs.clear()
    prompts = tuning_samples(cfg, tok)
    for allocation, kl in zip(allocations, got):
        ref = fidelity.dense_reference(model, tok, prompts, data=story)
        fresh = fidelity.evaluate_against(model, tok, artifact.manifest, allocation, ref, min_tokens=1)
        assert fidelity_kl(fresh)[1] == kl
    assert dense_runs == [2, 2, 2]


def test_evaluate_fidelity_is_a_fresh_reference_plus_evaluate_against(tiny, story):
    model, tok, info = tiny
    artifact, rows = _ashape_artifact(info)
    ref = fidelity.held_out_reference(model, tok, data=story, samples=2, tokens=300, seed=0)
    reused = fidelity.evaluate_against(model, tok, artifact.manifest, rows, ref, min_tokens=128)
    assert reused == evaluate_fidelity(model, tok, artifact.manifest, rows, data=story, samples=2, tokens=300, min_tokens=128)
    assert reused["samples"] == 2 and reused["eval_data"] == story


def test_tuning_prompts_are_calibration_windows_after_the_searched_ones(tiny, story, tmp_path):
    from sparsesearch.data import held_out, load_calibration

    _, tok, _ = tiny
    cfg = CalibrateConfig(data=story, max_tokens=200, samples=2, tune_samples=3, out=tmp_path / "a")
    tuning = tuning_samples(cfg, tok)
    searched = load_calibration(story, tok, max_tokens=200, samples=2, seed=0)
    held = [held_out(story, tok, max_tokens=200, seed=i) for i in range(3)]
    assert len(tuning) == 3 and all(t.meta["part"] == "calibration" for t in tuning)
    assert [t.meta["seed"] for t in tuning] == [2, 3, 4]  # the stream after the searched seeds 0 and 1
    assert not {t.meta["seed"] for t in tuning} & {s.meta["seed"] for s in searched}
    held_text = {h.text for h in held}
    assert all(t.text not in held_text and t.meta["part"] != h.meta["part"] for t in tuning for h in held)


def test_tune_samples_below_one_is_refused(tmp_path):
    from sparsesearch.calibrate import check_config

    with pytest.raises(ValueError, match="--tune-samples must be >= 1, got 0"):
        check_config(CalibrateConfig(tune_samples=0, target_kl=1e-3, out=tmp_path / "a"))


@pytest.mark.slow  # a search + per-layer probes + a guided search on the tiny model: ~60 s on 2 busy cores
def test_cli_prints_and_records_the_kl_model(tmp_path):
    """calibrate --target-kl through the CLI on the tiny model: the record's KL model has one measured KL per
    searched layer, the sensitivities it implies, predicted KL on every curve point, and the table says so."""
    import json

    from typer.testing import CliRunner

    from sparsesearch.artifacts import load_artifact
    from sparsesearch_cli.app import app
    from test_calibrate import SPACE

    space = tmp_path / "space.json"
    space.write_text(json.dumps(SPACE))
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "a"
    result = CliRunner().invoke(app, ["calibrate", "--model", model, "--search-space", str(space), "--max-tokens", "256",
                                      "--data", "synthetic:passkey", "--out", str(out), "--min-tokens", "128", "--eval-data", "",
                                      "--target-kl", "0.05", "--tune-samples", "1", "--allow-miss"])
    assert result.exit_code == 0, result.output
    assert "KL model (one layer sparse at" in result.output
    rec = load_artifact(out).manifest["methods"]["mminference"]["target"]
    layers = rec["kl_model"]["layers"]
    assert [l["layer"] for l in layers] == [0, 1, 2] and all(l["kl"] is not None and l["kl"] >= 0 for l in layers)
    assert all(l["sensitivity"] == pytest.approx(l["kl"] / l["sum_sq_error"], rel=1e-3, abs=1e-9) for l in layers if l["sum_sq_error"] > 0)
    assert rec["kl_model"]["sum_of_layer_kl"] == pytest.approx(sum(l["kl"] for l in layers), abs=1e-8)
    predicted = [p["predicted_kl"] for p in rec["curve"]]
    assert predicted == sorted(predicted, reverse=True) and predicted[-1] == 0
    assert rec["calibration"]["kl_prompts"]["part"] == "calibration" and rec["calibration"]["kl_prompts"]["stream_indices"] == [1, 1]
