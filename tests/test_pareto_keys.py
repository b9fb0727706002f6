"""`sparsesearch pareto --keys`: every point's passkey keys read as calibrate's retrieval guard reads them, the
"loses keys" verdict, its line in the summary, the plot's hollow markers, bad input, and a whole run with resume."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from sparsesearch.pareto.dominance import summary, verdicts
from sparsesearch.workdir import partial_path
from tiny_model import make_tiny_model


def _row(family, label, cost, kl, lost=None, searched=False):
    return {"family": family, "label": label, "cost_fraction": cost, "kl": kl, "searched": searched, "keys_lost": lost}


# Two searched points that hold every key; baselines judged against them (curve (0.3, 0.01) - (0.5, 0.002) - (1, 0)).
SEARCHED = [_row("searched", "a", 0.3, 0.01, 0, True), _row("searched", "b", 0.5, 0.002, 0, True)]
BASELINES = [
    _row("streaming", "lossy", 0.5, 0.0025, lost=2),  # not beaten by KL (0.8x), but drops two needles
    _row("streaming", "beaten lossy", 0.3, 0.02, lost=1),  # beaten by KL too: the keys still decide it
    _row("topk", "holds", 0.5, 0.0025, lost=0),  # the same KL, every key kept: the KL verdict stands
    _row("streaming", "cheap lossy", 0.1, 0.2, lost=1),  # no searched point that cheap: no claim
    _row("minference", "dear lossy", 1.2, 0.001, lost=1),  # dense is cheaper and holds them: no claim
]


def test_a_baseline_that_loses_a_key_the_searched_curve_holds_loses_keys():
    got = {v["label"]: v for v in verdicts(SEARCHED + BASELINES)}
    assert got["lossy"]["verdict"] == "loses keys" and got["lossy"]["kl_verdict"] == "not beaten"
    assert got["lossy"]["kl_ratio"] == pytest.approx(0.8) and got["lossy"]["keys_lost"] == 2, "still reported with its KL ratio"
    assert got["beaten lossy"]["verdict"] == "loses keys" and got["beaten lossy"]["kl_verdict"] == "beaten"
    assert got["holds"]["verdict"] == got["holds"]["kl_verdict"] == "not beaten" and got["holds"]["keys_lost"] == 0
    assert got["cheap lossy"]["verdict"] == "out of range" and got["dear lossy"]["verdict"] == "dearer than dense"


def test_the_summary_counts_points_that_lose_keys_apart_on_one_line():
    rows = SEARCHED + BASELINES
    line = summary(verdicts(rows), rows)
    assert line == ("searched beats 0/1 judged baseline points; 2 more lose passkey keys dense holds; "
                    "1 cheaper than every searched point")
    assert "\n" not in line
    one = summary(verdicts(SEARCHED + BASELINES[1:]), SEARCHED + BASELINES[1:])
    assert "; 1 more loses passkey keys dense holds;" in one


@pytest.mark.parametrize("why, searched", [
    ("keys off: nothing read anywhere", [_row("searched", "a", 0.3, 0.01, None, True), _row("searched", "b", 0.5, 0.002, None, True)]),
    ("a searched point on the curve loses a key itself", [_row("searched", "a", 0.3, 0.01, 1, True), _row("searched", "b", 0.5, 0.002, 0, True)]),
])
def test_no_retrieval_claim_unless_the_searched_curve_holds_every_key(why, searched):
    baselines = BASELINES if searched[0]["keys_lost"] is not None else [{**r, "keys_lost": None} for r in BASELINES]
    got = verdicts(searched + baselines)
    assert all(v["verdict"] == v["kl_verdict"] for v in got), why
    plain = verdicts([{k: v for k, v in r.items() if k != "keys_lost"} for r in searched + baselines])
    assert [v["verdict"] for v in got] == [v["verdict"] for v in plain], "the KL rule is unchanged"


def test_the_summary_names_the_searched_curves_own_lost_keys():
    rows = [_row("searched", "a", 0.3, 0.01, 1, True), _row("searched", "b", 0.5, 0.002, 0, True), BASELINES[0]]
    assert summary(verdicts(rows), rows) == ("searched beats 0/1 judged baseline points; "
                                             "1 searched point on the curve loses passkey keys dense holds")


def test_a_searched_point_off_the_curve_does_not_withdraw_the_claim():
    """A searched point the curve does not pass through (dominated) is not what baselines are judged against."""
    dominated = _row("searched", "worse", 0.6, 0.05, 3, True)
    got = {v["label"]: v for v in verdicts(SEARCHED + [dominated] + BASELINES)}
    assert got["lossy"]["verdict"] == "loses keys"


# ---- the plot -----------------------------------------------------------------------------------------

def test_the_plot_draws_points_that_lose_keys_hollow(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgba

    import sparsesearch.report.pareto_plot as plot
    from sparsesearch.models.info import ModelInfo

    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, path: figures.append(fig) or path)
    info = ModelInfo(id="toy", revision="r0", architecture="LlamaForCausalLM", num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=16, dtype="float32", max_position_embeddings=4096)
    rows = SEARCHED + BASELINES[:3]
    report = {"rows": rows, "samples": 1, "tokens": 256, "data": "d", "device": "cpu", "cost_model": "analytic", "summary": ""}

    def hollow_points(report):
        figures.clear()
        plot.draw_pareto(report, info, tmp_path / "p.png")
        ax = figures[0].axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        white = [tuple(xy) for c in ax.collections for xy, f in zip(c.get_offsets(), _per_point(c.get_facecolors(), len(c.get_offsets())))
                 if tuple(f) == to_rgba("white")]
        return legend, sorted(white)

    legend, white = hollow_points(report)
    assert "loses a passkey key" in legend
    assert white == sorted([(0.3, 0.02), (0.5, 0.0025)]), "exactly the two baselines that lose keys"
    legend, white = hollow_points({**report, "rows": [{**r, "keys_lost": None} for r in rows]})
    assert "loses a passkey key" not in legend and white == []


def _per_point(colours, n: int) -> list:
    """A collection's face colours, one per point: one colour for all is stored once."""
    return [tuple(colours[0])] * n if len(colours) == 1 else [tuple(c) for c in colours]


# ---- bad input ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, heads=2, kv_heads=1)


def test_negative_keys_exit_2_before_loading(tiny_dir, tmp_path, monkeypatch):
    from cli.app import app
    import sparsesearch.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["pareto", "--model", tiny_dir, "--tokens", "256", "--keys", "-1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "--keys must be a whole number >= 0" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


# ---- the prompts, and a whole run ---------------------------------------------------------------------

def test_the_key_prompts_are_held_out_from_calibrations_guard(tiny_dir):
    """Calibrate's guard held the searched artifacts to the keys of seeds cfg.seed ..: the Pareto reads others,
    their needles spread over the context in the order they are read."""
    from transformers import AutoTokenizer

    from sparsesearch.calibrate import CalibrateConfig
    from sparsesearch.pareto import ParetoConfig
    from sparsesearch.pareto.run import key_depth, key_prompt
    from sparsesearch.tuning import guard_prompt

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    mine = [key_prompt(ParetoConfig(model=tiny_dir, tokens=256, keys=4), tok, j) for j in range(8)]
    guard = [guard_prompt(CalibrateConfig(model=tiny_dir, max_tokens=256, retrieval_guard=4), tok, j) for j in range(16)]
    assert all(s.meta["held_out"] for s in mine)
    assert not {s.answer for s in mine} & {s.answer for s in guard}
    assert [s.meta["depth"] for s in mine] == pytest.approx([0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875, 0.0625])
    assert sorted(key_depth(j) for j in range(7)) == pytest.approx([i / 8 for i in range(1, 8)])  # any 2^k - 1 read: even


def test_dense_is_read_until_it_holds_the_keys_wanted(monkeypatch):
    """Prompts are drawn one at a time until dense holds `want` keys, or `limit` were read."""
    import sparsesearch.keycheck as keycheck

    holds = {0: False, 1: True, 2: False, 3: True, 4: True}
    monkeypatch.setattr(keycheck, "dense_keys", lambda model, tok, samples: keycheck.DenseKeys(
        list(samples), [[0]], [torch.ones(1)], [0] if holds[samples[0]] else []))
    drawn = []
    draw = lambda j: drawn.append(j) or j
    keys = keycheck.dense_keys_until(None, None, draw, want=2, limit=8)
    assert drawn == [0, 1, 2, 3] and keys.held == [1, 3] and keys.samples == [0, 1, 2, 3]
    drawn.clear()
    few = keycheck.dense_keys_until(None, None, draw, want=4, limit=3)
    assert drawn == [0, 1, 2] and few.held == [1]  # the limit: dense held one of three


KEYS = ["keys_checked", "keys_held_dense", "keys_lost", "key_worst_ratio"]


def test_a_run_reads_every_points_keys_and_resume_reuses_them(tiny_dir, tmp_path, monkeypatch):
    """A random tiny model retrieves no key, so dense's side is stood in for: the real teacher-forced digit
    probabilities with every digit marked dense's most likely token. Every point is then read for real through
    the runtime; a run killed after its first point reads only the second one again on --resume."""
    import pandas as pd

    from keys_fake import dense_holds_every_key
    from sparsesearch.pareto import ParetoConfig, pareto
    from test_pareto import killed_after_one_point

    sparse_reads = dense_holds_every_key(monkeypatch)
    out = tmp_path / "r"
    cfg = ParetoConfig(model=tiny_dir, baselines=["streaming", "dense"], budgets=[0.3], tokens=256, keys=2, out=out,
                       device="cpu", dtype="float32")
    killed_after_one_point(monkeypatch, cfg)
    units = {p.name for p in partial_path(out, "pareto").glob("*.json")}
    assert len(units) == 3 and sum(n.endswith("-keys2.json") for n in units) == 1, units  # state, quality, keys
    assert sparse_reads == [1, 1], "the first point: one sparse read per held prompt, every length sparse"
    sparse_reads.clear()
    cfg.resume = True
    report = pareto(cfg)
    assert sparse_reads == [1, 1], "only the unfinished point is read again"
    rows = {r["family"]: r for r in report["rows"]}
    assert report["keys"]["dense_retrieves"] == 2 and report["keys"]["seeds"] == [10_000, 10_001]  # held at once: 2 read
    assert report["keys"]["held_depths"] == [0.5, 0.25] and report["keys"]["wanted"] == 2
    assert all((r["keys_checked"], r["keys_held_dense"]) == (2, 2) for r in rows.values())
    assert rows["dense"]["keys_lost"] == 0 and rows["dense"]["key_worst_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert rows["streaming"]["key_worst_ratio"] != pytest.approx(1.0, abs=1e-6), "the streaming point ran sparse"
    assert isinstance(rows["streaming"]["keys_lost"], int)
    table = pd.read_parquet(out / "pareto.parquet")
    assert set(KEYS) <= set(table.columns)
    assert table.set_index("family").loc["dense", "keys_lost"] == 0


def test_keys_off_leaves_the_columns_empty_and_reads_nothing(tiny_dir, monkeypatch):
    import sparsesearch.fidelity as fidelity
    from sparsesearch.pareto import ParetoConfig, pareto

    monkeypatch.setattr(fidelity, "answer_probs", lambda *a, **k: pytest.fail("a key was read with --keys 0"))
    report = pareto(ParetoConfig(model=tiny_dir, baselines=["streaming"], budgets=[0.3], tokens=256, keys=0, device="cpu", dtype="float32"))
    assert report["keys"] is None
    assert [{k: r[k] for k in KEYS} for r in report["rows"]] == [dict(zip(KEYS, (0, 0, None, None)))]
