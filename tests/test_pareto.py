"""`sparsesearch pareto`: baselines, costs, the verdict rule, a whole run on a tiny model, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from sparsesearch.models.info import ModelInfo
from sparsesearch.pareto import baselines as bl
from sparsesearch.pareto.cost import analytic_layer
from sparsesearch.pareto.dominance import COST_RATIO, KL_RATIO, cost_at, frontier, kl_at, summary, verdicts
from sparsesearch.patterns import ashape, block_topk
from sparsesearch.runtime.plan import build_plan
from sparsesearch.workdir import partial_path
from tiny_model import make_tiny_model


def _info(layers=4, heads=6, kv_heads=2, layer_types=None, window=None) -> ModelInfo:
    return ModelInfo(id="toy", revision="r0", architecture="LlamaForCausalLM", num_layers=layers, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=16, dtype="float32", max_position_embeddings=8192,
                     layer_types=layer_types, sliding_window=window)


# ---- baselines ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [0.2, 0.5, 0.8])
def test_ashape_and_block_topk_pick_the_density_nearest_the_budget(budget):
    info, n = _info(), 4096
    a = bl.ashape_point(info, n, budget)
    local = a.rows[0]["local"]
    got = ashape.density(ashape.AShapeParams(sink=bl.SINK, local=local), n)
    for other in (local - bl.BLOCK, local + bl.BLOCK):  # no neighbouring window is nearer
        assert abs(got - budget) <= abs(ashape.density(ashape.AShapeParams(sink=bl.SINK, local=other), n) - budget) + 1e-12
    t = bl.block_topk_point(info, n, budget)
    k = t.rows[0]["k_blocks"]
    dens = lambda k: block_topk.density(block_topk.BlockTopKParams(k_blocks=k, sink_blocks=1), n)  # noqa: E731
    assert abs(dens(k) - budget) <= min(abs(dens(k - 1) - budget), abs(dens(k + 1) - budget)) + 1e-12
    assert len(a.rows) == len(t.rows) == info.num_layers * info.num_kv_heads


def test_vertical_slash_keeps_minference_ratio_and_its_default():
    info = _info()
    default = bl.vertical_slash_point(info, 8192, None)
    assert (default.rows[0]["vertical_size"], default.rows[0]["slash_size"]) == bl.MINFERENCE_DEFAULT
    scaled = bl.vertical_slash_point(info, 8192, 0.5)
    v, s = scaled.rows[0]["vertical_size"], scaled.rows[0]["slash_size"]
    assert v + s == pytest.approx(0.5 * 8192, abs=2) and s / v == pytest.approx(6096 / 1000, rel=0.01)


def test_triangle_start_moves_down_as_the_budget_falls():
    info = _info(layers=12)
    starts = [bl.triangle_start(info, 8192, b) for b in (0.2, 0.5, 0.9)]
    assert starts == sorted(starts) and starts[0] < starts[-1]
    point = bl.triangle_point(info, 8192, starts[1], 0.5, "budget")
    assert point.manifest["methods"]["trianglemix"]["start_layer"] == starts[1] and point.rows == []


def test_duo_streams_the_most_streamable_heads_first():
    info = _info(layers=2, kv_heads=2)
    order = [(1, 0), (0, 1), (0, 0), (1, 1)]
    point = bl.duo_point(info, 8192, 0.6, order)
    streaming = [(r["layer"], r["head"]) for r in point.rows]
    assert streaming == sorted(order[: len(streaming)]) and 0 < len(streaming) < 4
    with pytest.raises(ValueError, match="stream_order"):
        bl.baseline_points(info, 1024, ["duo"], [0.5])


def test_hybrid_models_keep_their_windows_in_every_baseline():
    types = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    info = _info(layer_types=types, window=512)
    for point in bl.baseline_points(info, 2048, ["streaming", "dense", "trianglemix"], [0.5]):
        window_rows = [r for r in point.rows if r["layer"] in (0, 2)]
        assert len(window_rows) == 2 * info.num_kv_heads and all(r["local"] == 512 and r["sink"] == 0 for r in window_rows)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan, math.inf])
def test_budgets_outside_zero_one_are_refused(bad):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        bl.check_budgets([0.5, bad])


def test_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="'ashape'.*known: streaming"):
        bl.check_families(["streaming", "ashape"])


# ---- cost ---------------------------------------------------------------------------------------------

def test_analytic_cost_of_dense_is_one_and_of_ashape_its_density():
    info, n = _info(layers=1, heads=4, kv_heads=2), 1024
    q, k = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16)
    dense = build_plan(bl.dense_point(info, n).manifest, None, info, min_tokens=1).layer(0)
    sparse_ms, dense_ms, density = analytic_layer(dense, q, k, "kv")
    assert sparse_ms == pytest.approx(dense_ms) and density == 1.0
    point = bl.ashape_point(info, n, 0.3)
    import pandas as pd

    plan = build_plan(point.manifest, pd.DataFrame(point.rows), info, min_tokens=1)
    sparse_ms, dense_ms, density = analytic_layer(plan.layer(0), q, k, "kv")
    expected = ashape.density(ashape.AShapeParams(sink=bl.SINK, local=point.rows[0]["local"]), n)
    assert density == pytest.approx(expected) and sparse_ms / dense_ms == pytest.approx(expected)


# ---- the verdict rule ---------------------------------------------------------------------------------

def test_frontier_and_interpolation():
    curve = frontier([(0.3, 0.04), (0.5, 0.01), (0.4, 0.05), (1.0, 0.0)])
    assert curve == [(0.3, 0.04), (0.5, 0.01), (1.0, 0.0)]
    assert kl_at(curve, 0.4) == pytest.approx(0.025) and kl_at(curve, 0.2) is None
    assert cost_at(curve, 0.025) == pytest.approx(0.4) and cost_at(curve, 0.05) is None


def _row(family, label, cost, kl, searched=False):
    return {"family": family, "label": label, "cost_fraction": cost, "kl": kl, "searched": searched}


def test_verdicts_beaten_not_beaten_and_out_of_range():
    rows = [_row("searched", "a", 0.3, 0.01, True), _row("searched", "b", 0.5, 0.002, True),
            _row("ashape", "cheap", 0.1, 0.2), _row("ashape", "win", 0.3, 0.02), _row("ashape", "close", 0.5, 0.0025),
            _row("block_topk", "by cost", 0.7, 0.0021), _row("dense", "dense", 1.0, 0.0)]
    got = {v["label"]: v for v in verdicts(rows)}
    assert "dense" not in got
    assert got["cheap"]["verdict"] == "out of range"
    assert got["win"]["verdict"] == "beaten" and got["win"]["kl_ratio"] == pytest.approx(0.5)
    assert got["close"]["verdict"] == "not beaten" and got["close"]["kl_ratio"] > KL_RATIO
    # at equal KL the searched curve costs ~0.5, under 0.8 x 0.7
    assert got["by cost"]["verdict"] == "beaten" and got["by cost"]["cost_ratio"] <= COST_RATIO
    assert verdicts([_row("ashape", "x", 0.3, 0.1)])[0]["verdict"] == "no searched points"


def test_a_baseline_dearer_than_dense_is_no_win_for_the_search():
    """A baseline costing at least dense is beaten by the model's own attention: "dearer than dense", no
    claim for the search, however lossy it is; one below dense is judged against the curve to (1, 0)."""
    rows = [_row("searched", "a", 0.5, 0.02, True), _row("searched", "b", 1.15, 0.005, True),
            _row("minference", "dear", 1.4, 0.004), _row("topk", "dear and lossy", 1.1, 0.03), _row("topk", "at dense", 1.0, 0.001),
            _row("ashape", "below dense", 0.8, 0.03), _row("dense", "dense", 1.06, 0.002)]
    got = {v["label"]: v for v in verdicts(rows)}
    assert {got[k]["verdict"] for k in ("dear", "dear and lossy", "at dense")} == {"dearer than dense"}
    # between (0.5, 0.02) and (1, 0): at 0.8 the curve's KL is 0.008, 0.27x the baseline's
    assert got["below dense"]["verdict"] == "beaten" and got["below dense"]["kl_ratio"] == pytest.approx(0.008 / 0.03, abs=1e-6)


def test_the_summary_counts_judged_points_and_names_the_gap_below_the_searched_range():
    rows = [_row("searched", "a", 0.5, 0.02, True), _row("ashape", "beaten", 0.8, 0.03), _row("ashape", "close", 0.7, 0.012),
            _row("ashape", "cheap", 0.3, 0.1), _row("topk", "dear", 1.2, 0.01)]
    assert summary(verdicts(rows)) == "searched beats 1/2 judged baseline points; 1 cheaper than every searched point"
    assert summary(verdicts(rows[:3])) == "searched beats 1/2 judged baseline points"


# ---- a whole run --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, heads=2, kv_heads=1)


def test_a_run_on_a_tiny_model_writes_rows_report_and_plot(tiny_dir, tmp_path):
    from sparsesearch.pareto import ParetoConfig, pareto

    out = tmp_path / "report"
    cfg = ParetoConfig(model=tiny_dir, baselines=["streaming", "topk", "duo", "dense"], budgets=[0.3, 0.6], tokens=256,
                       out=out, device="cpu", dtype="float32")
    report = pareto(cfg)
    rows = {r["label"]: r for r in report["rows"]}
    assert rows["dense"]["kl"] == pytest.approx(0.0, abs=1e-9) and rows["dense"]["cost_fraction"] == pytest.approx(1.0)
    cheap = [r for r in report["rows"] if r["family"] != "dense"]
    assert all(0 < r["cost_fraction"] < 1 for r in cheap if r["family"] in ("streaming", "topk"))
    assert all(r["kl"] > 0 for r in cheap if r["cost_fraction"] < 0.9)  # a random model notices lost keys
    assert {p.name for p in out.iterdir()} == {"pareto.parquet", "pareto_layers.parquet", "pareto.json", "pareto.png"}
    assert not partial_path(out, "pareto").exists()
    assert json.loads((out / "pareto.json").read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    assert report["summary"] == "no searched artifact given: baselines only, nothing judged"
    # no sliding layers: every layer is searchable; no baseline carries a search's predicted cost
    assert all(r["searchable_cost_fraction"] == r["cost_fraction"] and r["predicted_cost_fraction"] is None for r in report["rows"])
    _layers_add_up(out, report["rows"], layers=2)


def _layers_add_up(out, rows, layers: int):
    """pareto_layers.parquet: one row per point and layer, whose times sum to the point's own."""
    import pandas as pd

    table = pd.read_parquet(out / "pareto_layers.parquet")
    assert len(table) == layers * len(rows)
    for r in rows:
        mine = table[table["label"] == r["label"]]
        assert mine["attention_ms"].sum() == pytest.approx(r["attention_ms"], rel=1e-3, abs=1e-3)
        assert mine["dense_attention_ms"].sum() == pytest.approx(r["dense_attention_ms"], rel=1e-3, abs=1e-3)
    return table


def test_a_hybrid_model_reports_its_searchable_layers_cost(tmp_path):
    """Tiny Gemma 3 (sliding layers 0, 1, 3): those layers run the model's own window on both sides, so
    they dilute cost_fraction; searchable_cost_fraction is the global layers' own, and is the smaller one
    for a point that saves time there."""
    from sparsesearch.pareto import ParetoConfig, pareto
    from tiny_model import make_tiny_gemma

    out = tmp_path / "report"
    cfg = ParetoConfig(model=make_tiny_gemma(tmp_path / "gemma"), baselines=["streaming", "dense"], budgets=[0.3], tokens=256,
                       out=out, device="cpu", dtype="float32")
    report = pareto(cfg)
    table = _layers_add_up(out, report["rows"], layers=5)
    assert set(table[table["layer"].isin([0, 1, 3])]["kind"]) == {"window"}
    window = table[table["kind"] == "window"]
    assert (window["attention_ms"] == window["dense_attention_ms"]).all()
    cheap = next(r for r in report["rows"] if r["family"] == "streaming")
    assert cheap["searchable_cost_fraction"] < cheap["cost_fraction"] < 1


def killed_after_one_point(monkeypatch, cfg) -> None:
    """Run ``pareto(cfg)`` stopped like a kill (KeyboardInterrupt) as its second point starts, then put the
    real per-point quality back, so the caller can resume."""
    from sparsesearch.pareto import pareto, run

    real, calls = run.quality, []

    def killed(model, tok, point, reference, work, key):
        if calls:
            raise KeyboardInterrupt
        calls.append(point.label)
        return real(model, tok, point, reference, work, key)

    monkeypatch.setattr(run, "quality", killed)
    with pytest.raises(KeyboardInterrupt):
        pareto(cfg)
    monkeypatch.setattr(run, "quality", real)


def test_resume_reuses_finished_points(tiny_dir, tmp_path, monkeypatch):
    from sparsesearch.pareto import ParetoConfig, pareto

    out = tmp_path / "r"
    cfg = ParetoConfig(model=tiny_dir, baselines=["streaming", "dense"], budgets=[0.3], tokens=256, out=out, device="cpu", dtype="float32")
    killed_after_one_point(monkeypatch, cfg)
    assert len(list(partial_path(out, "pareto").glob("*.json"))) == 2  # state + the finished point
    evaluated = []
    import sparsesearch.fidelity as fidelity

    orig = fidelity.evaluate_against
    monkeypatch.setattr(fidelity, "evaluate_against", lambda *a, **k: evaluated.append(1) or orig(*a, **k))
    cfg.resume = True
    report = pareto(cfg)
    assert len(evaluated) == 1 and len(report["rows"]) == 2  # only the unfinished point ran again


# ---- bad input: exit 2, one line, before any weights load, nothing written ---------------------------

@pytest.mark.parametrize("args, message", [
    (["--baselines", "streaming,ashape"], "unknown baseline 'ashape'"),
    (["--budgets", "0.5,0"], "(0, 1]"),
    (["--budgets", "0.5,2"], "(0, 1]"),
    (["--budgets", "half"], "comma-separated numbers"),
    (["--tokens", "9000"], "exceeds the context"),
    (["--triangle-start", "99"], "not a global layer"),
    (["--baselines", ""], "nothing to compare"),
])
def test_bad_input_exits_2_before_loading(tiny_dir, tmp_path, monkeypatch, args, message):
    from cli.app import app
    import sparsesearch.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    out = tmp_path / "out"
    tokens = [] if "--tokens" in args else ["--tokens", "256"]
    result = CliRunner().invoke(app, ["pareto", "--model", tiny_dir, *tokens, *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_an_artifact_of_another_model_is_refused(tiny_dir, tmp_path):
    from cli.app import app

    from artifact_fixtures import make_artifact, mix_rows

    art = make_artifact(tmp_path / "other", mix_rows())  # the fixtures' own tiny model, not this one
    result = CliRunner().invoke(app, ["pareto", "--model", tiny_dir, "--tokens", "256", "--artifact", str(art)])
    assert result.exit_code == 2 and "Traceback" not in result.output
