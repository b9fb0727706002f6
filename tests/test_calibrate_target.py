"""calibrate with a quality target on a tiny random Llama (CPU): the allocation meets the target it was
given on the tuning prompts with the runtime, records target/achieved/curve/dense heads in a manifest that
validates, and an unreachable target is one line + exit 2 unless --allow-miss. Plus the measured dense
cut-off and the runtime reading it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sparsesearch.artifacts import load_artifact
from sparsesearch.calibrate import CalibrateConfig, calibrate
from sparsesearch.tuning import fidelity_kl
from sparsesearch.runtime.plan import DEFAULT_MIN_TOKENS, artifact_min_tokens, build_plan, runtime_min_tokens
from sparsesearch.search.cutoff import cutoff_from, ladder, measure_cutoff
from sparsesearch_cli.app import app
from test_calibrate import SPACE
from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def space_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("space") / "space.json"
    path.write_text(json.dumps(SPACE))
    return path


def _args(model, space, out, *extra):
    return ["calibrate", "--model", model, "--search-space", str(space), "--max-tokens", "256", "--data", "synthetic:passkey",
            "--out", str(out), "--min-tokens", "128", *extra]


@pytest.mark.slow  # ~40 s on 2 busy cores: a search plus a bisection of ~4 runtime KL measurements
def test_target_kl_is_met_with_the_runtime_and_recorded(tiny_model, space_file, tmp_path):
    target = 5e-3
    res = calibrate(CalibrateConfig(model=tiny_model, data="synthetic:passkey", search_space=str(space_file), max_tokens=256,
                                    out=tmp_path / "a", eval_data="synthetic:passkey", eval_samples=1, target_kl=target))
    rec = res.manifest["methods"]["mminference"]["target"]
    assert rec["kind"] == "target_kl" and rec["value"] == target and rec["met"] and rec["missed"] is None
    chosen = rec["calibration"]
    assert chosen["achieved"] is not None and chosen["achieved"] <= target
    measured = [p for p in rec["curve"] if "kl" in p]
    assert measured and all(p["kl"] > target for p in measured if p["cost_fraction"] < chosen["cost_fraction"]), \
        "every cheaper allocation measured misses the target: the chosen one is the cheapest found"
    assert [p["cost_fraction"] for p in rec["curve"]] == sorted(p["cost_fraction"] for p in rec["curve"])
    held_kl = res.fidelity["teacher_forced"]["kl_mean"]  # over every position, not the one after the prompt
    assert rec["held_out"]["kl_metric"] == "teacher_forced.kl_mean"
    assert rec["held_out"]["kl"] == held_kl and rec["held_out"]["met"] == (held_kl <= target)
    loaded = load_artifact(res.path)  # validates the manifest against the schema
    heads = loaded.heads
    dense = {(d["layer"], d["head"]) for d in rec["dense_heads"]}
    assert dense == {(int(r.layer), int(r.head)) for r in heads.itertuples() if r.pattern == "dense"}
    assert all(d["reason"] for d in rec["dense_heads"])
    assert res.curve_png is not None and res.curve_png.stat().st_size > 0
    # The runtime threshold came from --min-tokens (not given: measured) and the plan reads it.
    cut = res.manifest["methods"]["mminference"]["dense_cutoff"]
    assert cut["source"] == "measured" and [p["tokens"] for p in cut["points"]] == [256]
    assert artifact_min_tokens(res.manifest) == runtime_min_tokens(cut)


def test_unreachable_target_exits_2_then_allow_miss_writes_it_marked(tiny_model, space_file, tmp_path):
    runner = CliRunner()
    out = tmp_path / "a"
    first = runner.invoke(app, _args(tiny_model, space_file, out, "--target-kl", "1e-12", "--eval-data", ""))
    assert first.exit_code == 2, first.output
    assert "only all-dense meets it" in first.output and "--allow-miss" in first.output and "Traceback" not in first.output
    assert not out.exists()
    second = runner.invoke(app, _args(tiny_model, space_file, out, "--target-kl", "1e-12", "--eval-data", "", "--allow-miss",
                                      "--resume", "--json"))  # the scores of the refused run are reused
    assert second.exit_code == 0, second.output
    rec = load_artifact(out).manifest["methods"]["mminference"]["target"]
    assert not rec["met"] and "cannot be met" in rec["missed"] and rec["allow_miss"]
    assert rec["calibration"]["sparse_heads"] >= 1  # the best reachable sparse allocation, not all-dense
    assert [l["layer"] for l in rec["kl_model"]["layers"]] == [0, 1, 2]  # one KL per searched layer, then the path on it


def test_max_output_error_caps_every_sparse_head(tiny_model, space_file, tmp_path):
    # 0.3: the tiny model's best sparse errors per layer are ~0.32 / 0.29 / 0.25, so one layer stays dense.
    result = CliRunner().invoke(app, _args(tiny_model, space_file, tmp_path / "a", "--max-output-error", "0.3", "--eval-data", "", "--json"))
    assert result.exit_code == 0, result.output
    heads = load_artifact(tmp_path / "a").heads
    sparse = heads[heads.pattern != "dense"]
    assert (sparse.output_error <= 0.3).all() and (heads[heads.pattern == "dense"].output_error == 0).all()
    summary = json.loads(result.stdout)
    # heads.parquet carries the target's reason for each head it left dense, the same as the manifest's list.
    why = {(d["layer"], d["head"]): d["reason"] for d in summary["target"]["dense_heads"]}
    assert why and why == {(int(r.layer), int(r.head)): r.reason for r in heads.itertuples() if r.pattern == "dense"}
    assert summary["target"]["kind"] == "max_output_error" and summary["target"]["calibration"]["achieved"] <= 0.3
    assert summary["dense_cutoff"] == {"min_tokens": 128, "source": "--min-tokens (not measured)"}


@pytest.mark.parametrize("extra, message", [
    (["--target-kl", "0"], "--target-kl must be a positive number, got 0.0"),
    (["--target-kl", "-0.01"], "--target-kl must be a positive number"),
    (["--max-output-error", "0"], "--max-output-error must be a positive number"),
    (["--latency-budget", "1.5"], "fraction of the dense cost in (0, 1), got 1.5"),
    (["--target-kl", "1e-3", "--max-output-error", "0.1"], "at most one quality target"),
    (["--allow-miss"], "--allow-miss needs a target"),
    (["--target-kl", "1e-3", "--retrieval-guard", "-1"], "--retrieval-guard must be >= 0, got -1"),
])
def test_bad_targets_exit_2_with_one_line(tiny_model, space_file, tmp_path, extra, message):
    result = CliRunner().invoke(app, _args(tiny_model, space_file, tmp_path / "a", "--eval-data", "", *extra))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------ dense cut-off
def test_cutoff_is_where_sparse_wins_from_then_on():
    pts = lambda *ms: [{"tokens": 256 << i, "dense_ms": d, "sparse_ms": s} for i, (d, s) in enumerate(ms)]
    assert cutoff_from(pts((1, 2), (2, 2.5), (4, 3), (8, 4))) == 1024
    assert cutoff_from(pts((1, 0.5), (2, 3), (4, 3), (8, 4))) == 1024  # an early win that does not last is not the cut-off
    assert cutoff_from(pts((1, 2), (2, 3))) is None
    assert runtime_min_tokens({"min_tokens": None, "measured_up_to": 4096}) == 4097
    assert ladder(4096) == [256, 512, 1024, 2048, 4096] and ladder(3000) == [256, 512, 1024, 2048, 3000] and ladder(100) == [100]


def test_measure_cutoff_times_the_artifacts_pattern_on_this_device():
    from types import SimpleNamespace

    info = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64)
    row = {"layer": 0, "head": 0, "q_modality": "all", "k_modality": "all", "pattern": "ashape", "sink": 32, "local": 64,
           "block_m": 64, "block_n": 64}
    cut = measure_cutoff([row, {**row, "head": 1}], info, head_space="kv", max_tokens=512, dtype=__import__("torch").float32,
                         device="cpu", reps=1)
    assert cut["pattern"] == {"name": "ashape", "sink": 32, "local": 64}
    assert [p["tokens"] for p in cut["points"]] == [256, 512] and all(p["dense_ms"] > 0 and p["sparse_ms"] > 0 for p in cut["points"])
    assert cut["min_tokens"] == cutoff_from(cut["points"]) and cut["backend"] == "torch"
    dense_only = measure_cutoff([{**row, "pattern": "dense"}], info, head_space="kv", max_tokens=512,
                                dtype=__import__("torch").float32, device="cpu")
    assert dense_only["min_tokens"] is None and dense_only["points"] == []


def test_plan_takes_the_artifacts_cutoff_unless_given():
    from artifact_fixtures import TINY

    manifest = _manifest({"min_tokens": 2048, "source": "measured"})
    assert build_plan(manifest, None, TINY).min_tokens == 2048
    assert build_plan(manifest, None, TINY, min_tokens=64).min_tokens == 64


def _manifest(cutoff):
    return {"head_index_space": "kv", "methods": {"mminference": {"dense_cutoff": cutoff} if cutoff else {}}}


@pytest.mark.parametrize("cutoff, expected", [
    (None, DEFAULT_MIN_TOKENS), ({"min_tokens": 2048, "source": "measured"}, 2048),
    ({"min_tokens": None, "source": "measured", "measured_up_to": 4096}, 4097),
])
def test_artifact_min_tokens(cutoff, expected):
    assert artifact_min_tokens(_manifest(cutoff)) == expected


def test_the_target_kl_is_the_teacher_forced_mean_when_there_is_one():
    report = {"eval_data": "text:shakespeare", "next_token_kl": 0.2, "teacher_forced": {"kl_mean": 0.004, "next_token_kl": 0.2}}
    assert fidelity_kl(report) == ("teacher_forced.kl_mean", 0.004)
    assert fidelity_kl({"eval_data": "synthetic:passkey", "next_token_kl": 0.2}) == ("next_token_kl", 0.2)  # an old report
    assert fidelity_kl({"next_token_kl": 0.2, "teacher_forced": {"kl_mean": None}}) == ("next_token_kl", 0.2)
    with pytest.raises(ValueError, match="no KL"):
        fidelity_kl({"eval_data": "x"})


@pytest.mark.slow  # ~60 s on 2 busy cores: one search, two allocations, and a separate run to compare with
def test_a_target_kl_sweep_searches_once_and_writes_an_artifact_per_value(tiny_model, space_file, tmp_path):
    from sparsesearch.calibrate import Progress, calibrate_sweep

    cfg = CalibrateConfig(model=tiny_model, data="synthetic:passkey", search_space=str(space_file), max_tokens=256, out=tmp_path / "sweep",
                          eval_data=None, min_tokens=128, tune_samples=1, retrieval_guard=0, allow_miss=True, created="2026-01-01T00:00:00Z")
    ticks, stages = [], []
    results = calibrate_sweep(cfg, [0.05, 0.01], Progress(stage=stages.append, layer=lambda *a: ticks.append(a)))
    assert [r.path for r in results] == [tmp_path / "sweep" / "kl0.05", tmp_path / "sweep" / "kl0.01"]
    assert len(ticks) == 3  # the tiny model's 3 layers, searched once for both targets
    runs = lambda v: sum(s.startswith(f"--target-kl {v}: target KL: runtime") for s in stages)
    assert runs(0.05) >= 3 and runs(0.01) < runs(0.05)  # the per-layer KL probes ran once, for the first target
    assert [r.manifest["methods"]["mminference"]["target"]["value"] for r in results] == [0.05, 0.01]
    assert not (tmp_path / "sweep.partial").exists()  # the search was the sweep's own: removed
    alone = calibrate(CalibrateConfig(**{**cfg.__dict__, "target_kl": 0.01, "out": tmp_path / "alone"}))
    assert (alone.path / "heads.parquet").read_bytes() == (results[1].path / "heads.parquet").read_bytes()


def test_a_sweeps_targets_share_the_dense_run_and_each_kl_measured(monkeypatch):
    import sparsesearch.fidelity as fidelity
    import sparsesearch.tuning as tuning

    calls = {"reference": 0, "sparse": 0}
    monkeypatch.setattr(tuning, "tuning_reference", lambda *a: calls.__setitem__("reference", calls["reference"] + 1) or "dense")
    monkeypatch.setattr(fidelity, "evaluate_against", lambda model, tok, manifest, rows, ref, **kw: (
        calls.__setitem__("sparse", calls["sparse"] + 1), {"teacher_forced": {"kl_mean": 0.001 * len(rows)}})[1])
    memo = tuning.TuningMemo()
    row = lambda layer, d: {"layer": layer, "head": 0, "pattern": "ashape", "density": d}
    first = tuning.tuning_kl(None, None, None, {}, [row(0, 1.0)], memo=memo)
    second = tuning.tuning_kl(None, None, None, {}, [row(0, 1.0)], memo=memo)  # the next target of the sweep
    assert first([row(1, 0.5)]) == second([row(1, 0.5)]) == pytest.approx(0.002)
    assert calls == {"reference": 1, "sparse": 1}
    assert second([row(1, 0.25)]) == pytest.approx(0.002) and calls == {"reference": 1, "sparse": 2}  # another allocation
    # what the sweep measured is read without a run (search_target's known); what it did not is None
    assert second.known([row(1, 0.5)]) == pytest.approx(0.002) and second.known([row(1, 0.125)]) is None
    assert calls == {"reference": 1, "sparse": 2}
    alone = tuning.tuning_kl(None, None, None, {}, [row(0, 1.0)])  # no memo: a run of its own
    alone([row(1, 0.5)])
    assert calls == {"reference": 2, "sparse": 3}


@pytest.mark.parametrize("extra, message", [
    (["--target-kl", "0.01", "--target-kl", "0.01"], "a sweep takes two or more different values"),
    (["--target-kl", "0.01", "--target-kl", "-1"], "--target-kl must be a positive number"),
    (["--target-kl", "0.01", "--target-kl", "0.02", "--space-budget"], "--space-budget is the search without a quality target"),
])
def test_a_bad_sweep_exits_2_before_the_model_loads(tiny_model, space_file, tmp_path, extra, message):
    result = CliRunner().invoke(app, _args(tiny_model, space_file, tmp_path / "s", *extra))
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "s").exists()


def test_a_sweep_into_a_file_exits_2(tiny_model, space_file, tmp_path):
    (tmp_path / "s").write_text("mine")
    result = CliRunner().invoke(app, _args(tiny_model, space_file, tmp_path / "s", "--target-kl", "0.01", "--target-kl", "0.02"))
    assert result.exit_code == 2 and "is a file" in result.output and (tmp_path / "s").read_text() == "mine"
