"""calibrate past one process (issue P15 §3): the per-layer searches spread over worker processes give the
byte-identical heads table of the in-process search (text and multi-modal data), a failing worker ends the run
with one line and leaves no process behind, and bad --gpus / --device-map / --max-memory exit 2 before loading.
CPU: the workers are CPU processes (search_devices); the GPU form of the same path is `--gpus N`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

import sparsesearch.calibrate as cal
from sparsesearch.calibrate import CalibrateConfig, calibrate
from sparsesearch.models.split import check_device_map, meta_model, parse_max_memory, read_device_map
from sparsesearch.search.spread import Spread
from sparsesearch_cli.app import app
from test_calibrate import SPACE
from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def space_file(tmp_path):
    path = tmp_path / "space.json"
    path.write_text(json.dumps({**SPACE, "budget_slack": 3.0, "boundaries": ["none", "k", "q", "2d"]}))
    return path


def _cfg(model, out, space_file, **kw):
    base = dict(model=model, data="synthetic:passkey", search_space=str(space_file), max_tokens=512, out=out,
                eval_data="", min_tokens=128, created="2026-01-01T00:00:00Z")
    return CalibrateConfig(**{**base, **kw})


@pytest.mark.parametrize("data", ["synthetic:passkey", "synthetic:mixed"])
def test_spread_search_writes_the_same_heads_table(tiny_model, space_file, tmp_path, data):
    one = calibrate(_cfg(tiny_model, tmp_path / "one", space_file, data=data))
    ticks = []
    two = calibrate(_cfg(tiny_model, tmp_path / "two", space_file, data=data, search_devices=("cpu", "cpu")),
                    cal.Progress(layer=lambda s, layer, total: ticks.append(layer)))
    assert (one.path / "heads.parquet").read_bytes() == (two.path / "heads.parquet").read_bytes()
    workers = two.manifest["methods"]["mminference"]["search_workers"]
    assert [w["device"] for w in workers] == ["cpu", "cpu"]
    assert sum(w["layers"] for w in workers) == len(ticks) == two.manifest["model"]["num_layers"]
    assert "search_workers" not in one.manifest["methods"]["mminference"]


def _boom_setup(device):
    return device


def _boom_work(state, layer):
    if layer == 1:
        raise ValueError("layer 1 exploded")


def _sleep_work(state, seconds):
    import time

    time.sleep(seconds)


def _children() -> set[int]:
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


def test_a_failing_worker_ends_the_run_with_its_line_and_no_process_left():
    before = _children()
    with pytest.raises(RuntimeError, match="search worker on cpu failed: ValueError: layer 1 exploded"):
        with Spread(["cpu", "cpu"], _boom_setup, (), _boom_work) as spread:
            for layer in range(3):
                spread.submit(layer, layer)
            spread.finish()
    assert _children() <= before


def test_a_killed_worker_is_reported_not_waited_for():
    with pytest.raises(RuntimeError, match=r"died \(exit code -9\)"):
        with Spread(["cpu"], _boom_setup, (), _sleep_work) as spread:
            spread.submit(0, 30.0)
            import time

            time.sleep(3.0)  # the worker is inside its task (spawned, imported, sleeping)
            os.kill(spread.procs[0].pid, 9)
            spread.finish()


def test_max_memory_and_device_map_parsing(tmp_path):
    assert parse_max_memory("0=20GiB, 1=1.5GB,cpu=64GiB") == {0: "20GiB", 1: "1.5GB", "cpu": "64GiB"}
    assert parse_max_memory(None) is None
    for bad in ("0:20GiB", "gpu0=20GiB", "0=twenty"):
        with pytest.raises(ValueError, match="--max-memory takes GPU=SIZE"):
            parse_max_memory(bad)
    assert read_device_map("balanced") == "balanced"
    with pytest.raises(ValueError, match="--device-map must be one of auto, balanced"):
        read_device_map("everywhere")
    (tmp_path / "m.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="non-empty JSON object"):
        read_device_map(str(tmp_path / "m.json"))


def test_device_map_names_are_checked_against_the_model(tiny_model):
    from sparsesearch.models.resolve import resolve

    model = meta_model(resolve(tiny_model))
    assert all(p.is_meta for p in model.parameters())
    check_device_map({"model": 0, "lm_head": 1}, model, gpus=2)
    with pytest.raises(ValueError, match="names modules the model does not have: model.decoder"):
        check_device_map({"model.decoder": 0, "lm_head": 0}, model, gpus=2)
    with pytest.raises(ValueError, match="places lm_head on 5"):
        check_device_map({"model": 0, "lm_head": 5}, model, gpus=2)
    with pytest.raises(ValueError, match="parameters unplaced, e.g. lm_head"):
        check_device_map({"model": 0}, model, gpus=2)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gpus", "64"], "--gpus 64: this host has"),
    (["--max-memory", "0=1GiB"], "--max-memory needs --device-map"),
    (["--max-memory", "zero=1GiB", "--device-map", "auto"], "--max-memory takes GPU=SIZE"),
    (["--device-map", "everywhere"], "--device-map must be one of"),
])
def test_cli_refuses_bad_gpu_options_before_loading(tiny_model, space_file, tmp_path, args, message):
    result = CliRunner().invoke(app, ["calibrate", "--model", tiny_model, "--search-space", str(space_file),
                                      "--out", str(tmp_path / "a"), "--eval-data", "", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a split without GPUs")
def test_device_map_without_gpus_is_refused(tiny_model, space_file, tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--model", tiny_model, "--search-space", str(space_file),
                                      "--out", str(tmp_path / "a"), "--eval-data", "", "--device-map", "balanced"])
    assert result.exit_code == 2 and "torch sees none here" in result.stderr, result.output


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU: the split's size checks run where a split can")
def test_max_memory_too_small_for_the_weights_is_refused(tiny_model, space_file, tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--model", tiny_model, "--search-space", str(space_file), "--out", str(tmp_path / "a"),
                                      "--eval-data", "", "--device-map", "balanced", "--max-memory", "0=1KB"])
    assert result.exit_code == 2 and "the weights need" in result.stderr, result.output


def test_the_command_line_default_is_the_lossless_cap_and_space_budget_restores_the_budget(tiny_model, tmp_path):
    import json as _json

    from sparsesearch.calibrate import DEFAULT_MAX_OUTPUT_ERROR
    from test_calibrate import SPACE as PLAIN

    space = tmp_path / "plain.json"
    space.write_text(_json.dumps(PLAIN))
    base = ["calibrate", "--model", tiny_model, "--search-space", str(space), "--max-tokens", "512", "--eval-data", "",
            "--min-tokens", "128", "--json"]
    default = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "d")])
    assert default.exit_code == 0, default.output
    target = json.loads(default.stdout)["target"]
    assert target["kind"] == "max_output_error" and target["value"] == DEFAULT_MAX_OUTPUT_ERROR and target["source"] == "default"
    budget = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--space-budget"])
    assert budget.exit_code == 0, budget.output
    assert json.loads(budget.stdout)["target"] is None
    given = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "g"), "--max-output-error", str(DEFAULT_MAX_OUTPUT_ERROR), "--allow-miss"])
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["target"]["source"] == "given"
    both = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "x"), "--space-budget", "--target-kl", "0.01"])
    assert both.exit_code == 2 and "--space-budget is the search without a quality target" in both.stderr


def test_multimodal_data_keeps_the_budget_search_under_the_default(tiny_model, space_file, tmp_path):
    res = calibrate(_cfg(tiny_model, tmp_path / "m", space_file, data="synthetic:mixed", default_max_output_error=0.02))
    assert "target" not in res.manifest["methods"]["mminference"]
