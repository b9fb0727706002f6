"""P12 §2, a CLI that reads well: progress as plain lines in a log, tables whole at 80 columns, numbers with
their meaning, one command shape per method, defaults that finish and inform, and no deprecated call."""

from __future__ import annotations

import inspect
import io
import json
import warnings

import pytest
from rich.console import Console
from typer.testing import CliRunner

from artifact_fixtures import make_artifact, mix_rows, rehash
from sparsesearch_cli.app import app
from sparsesearch_cli.common import RunProgress, fold_cells

LONG_CONFIG = "snapkv/b64/k1024/kq256/ke768"


def plain_progress(every: float = 0.0) -> tuple[RunProgress, io.StringIO]:
    stream = io.StringIO()
    return RunProgress(Console(file=stream, force_terminal=False, width=80), every=every), stream


def test_piped_progress_prints_counted_lines_as_they_happen():
    progress, stream = plain_progress()
    with progress:
        progress.stage("searching sample 1/1")
        progress.tick(1, 4)
        assert "searching sample 1/1: 1/4, elapsed" in stream.getvalue()  # written now, not when the display stops
        progress.tick(2, 4)
        assert "~ETA" in stream.getvalue().splitlines()[-1]
        progress.stage("writing artifact")
    lines = stream.getvalue().splitlines()
    assert lines[-1].endswith(" writing artifact") and "0/?" not in stream.getvalue()


def test_piped_progress_is_throttled_but_keeps_the_last_count():
    progress, stream = plain_progress(every=3600.0)
    with progress:
        progress.stage("layers")
        for done in range(1, 31):
            progress.tick(done, 30)
    counts = [line for line in stream.getvalue().splitlines() if ": " in line.split(" ", 1)[1]]
    assert [c.split(": ")[1].split(",")[0] for c in counts] == ["1/30", "30/30"]


def test_calibrate_progress_goes_through_the_shared_helper_when_piped(tmp_path, monkeypatch):
    """The CLI's calibrate hooks print plain counted lines on a non-terminal stderr (CliRunner's)."""
    import sparsesearch.calibrate as lib

    monkeypatch.setattr("sparsesearch_cli.common.PLAIN_EVERY_S", 0.0)
    seen = {}

    def fake_run(cfg, hooks, space=None):
        hooks.stage("searching sample 1/1")
        for layer in range(3):
            hooks.layer(0, layer, 3)
        seen["ok"] = True
        raise ValueError("stop here")  # one line, exit 2: enough to see what the progress printed

    monkeypatch.setattr(lib, "calibrate", fake_run)
    monkeypatch.setattr(lib, "preflight", lambda cfg: None)
    monkeypatch.setattr("sparsesearch.preflight.output_path", lambda *a, **k: None)
    monkeypatch.setattr("sparsesearch.preflight.json_file", lambda *a, **k: None)
    monkeypatch.setattr("sparsesearch.preflight.sizes_fit", lambda *a, **k: None)
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "a")])
    assert seen and result.exit_code == 2
    assert "searching sample 1/1: 3/3" in result.stderr


def long_rows():
    rows = mix_rows()
    for r in rows:
        r.update(recall=0.9, output_error=0.01, latency_ms=0.001)
    return rows


def test_inspect_table_is_whole_at_80_columns(tmp_path):
    art = make_artifact(tmp_path / "a", long_rows())
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["inspect", str(art)])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert "v-slash = vertical_slash" in result.stdout  # the short header says what it stands for


def test_a_folded_table_cuts_no_cell_at_80_columns():
    from rich.table import Table

    table = Table(title="sweep-nosa")
    for col in ("config", "KL", "recall", "γ mean", "γ≥bound", "viol.", "unstable", "hit", "H2D KiB/tok", "tok/s*"):
        table.add_column(col, justify="right")
    table.add_row(LONG_CONFIG, "0.0012", "0.981", "0.950", "0.91≥0.75", "0", "12", "0.871", "123.4", "4567")
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(fold_cells(table))
    text = console.export_text()
    assert "…" not in text


def test_inspect_shows_fidelity_and_units(tmp_path):
    art = make_artifact(tmp_path / "a", long_rows())
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["methods"]["mminference"].update(cost_model="analytic", max_tokens=4096, fidelity={
        "eval_data": "text:shakespeare", "samples": 1, "tokens": 4096, "next_token_kl": 0.002, "mean_density": 0.3,
        "teacher_forced": {"positions": "every position", "tokens": 4095, "kl_mean": 0.0123, "ppl_dense": 21.5, "ppl_sparse": 22.25,
                           "tail_tokens": 0, "tail_from": 1024, "kl_tail_mean": None, "ppl_dense_tail": None, "ppl_sparse_tail": None,
                           "sparse_ran": True, "next_token_kl": 0.002}})
    (art / "manifest.json").write_text(json.dumps(manifest))
    rehash(art)
    out = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["inspect", str(art)]).stdout
    assert "fidelity on text:shakespeare" in out and "KL(dense||sparse) 0.0123" in out and "22.250" in out
    assert "latency_ms = milliseconds per head of its kernel at 4096 tokens, modelled from FLOPs" in out


def test_inspect_says_when_no_fidelity_is_recorded(tmp_path):
    out = CliRunner().invoke(app, ["inspect", str(make_artifact(tmp_path / "a", long_rows()))]).stdout
    assert "fidelity: none recorded" in out


def default_of(command: str, option: str):
    import typer.main

    group = typer.main.get_command(app)
    return next(p.default for p in group.commands[command].params if p.name == option)


def test_evaluate_defaults_to_held_out_text():
    assert default_of("evaluate", "data") == "text:shakespeare"


def test_probe_layers_default_sample_count_is_short():
    assert default_of("probe-layers", "samples") == 8


def test_aliases_resolve_to_the_same_command():
    import typer.main

    group = typer.main.get_command(app)
    same = lambda a, b: inspect.unwrap(a.callback) is inspect.unwrap(b.callback)  # typer wraps each registration
    assert same(group.commands["sweep-nosa"], group.commands["nosa"].commands["sweep"])
    assert same(group.commands["sweep-spava"], group.commands["spava"].commands["sweep"])
    assert not same(group.commands["sweep-nosa"], group.commands["spava"].commands["sweep"])
    assert group.commands["sweep-nosa"].help.startswith("Alias of `nosa sweep`.")


def test_resumed_calibrate_says_so(tmp_path):
    from sparsesearch.calibrate import resumed_note

    work = tmp_path / "art.partial"
    work.mkdir()
    for name in ("s0_l0_all-all.json", "s0_l0_text-image.json", "s0_l1_all-all.json", "s0_l1.boundary.json", "state.json"):
        (work / name).write_text("{}")
    note = resumed_note(work)
    assert note.startswith(f"resumed from {work}") and ": 2 (sample, layer) score(s) kept" in note


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, heads=4, kv_heads=2)


def test_sweep_nosa_says_the_context_was_shortened_and_warns_nothing(tiny_model, tmp_path):
    """A context of the whole held-out text asked for more than synthetic:passkey builds: said, with the numbers;
    and the forwards use the current cache keyword (no FutureWarning per configuration)."""
    import sparsesearch.nosa.sweep as sweep

    settings = sweep.SweepSettings(model=tiny_model, budgets=(128,), kq_ratios=(0.0, 0.5), blocks=(32,), proxies=("vnorm",),
                                   context=300, decode_steps=20, out=tmp_path / "art")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = sweep.run_sweep(settings)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    if outcome.context < settings.context:
        assert outcome.notes and f"--context 300 asked, {outcome.context} used" in outcome.notes[0]
    else:
        assert outcome.notes == []


def test_shortened_note_names_both_lengths():
    import sparsesearch.nosa.sweep as sweep

    s = sweep.SweepSettings(model="m", budgets=(512,), kq_ratios=(0.0,), blocks=(64,), proxies=("snapkv",), context=1024,
                            decode_steps=64, data="synthetic:passkey")
    assert sweep.shortened_note(s, 1022, 1087).startswith("context shortened: --context 1024 asked, 1022 used")
