"""The per-device launch table (kernels/launch_table.py) and the tuner that writes it (kernel_tuning.py), on CPU."""

import json
import warnings

import pytest
import torch

from conftest import DEVICE
from sparsesearch import kernel_tuning
from sparsesearch.kernels import block_sparse, launch_table
from sparsesearch.kernels.launch_table import (candidates, config_key, default_path, device_configs, fastest, read_table,
                                               write_configs)
from sparsesearch.kernels.version import cache_env

GPU = "Fake GPU 80GB"
ENV = {"torch": "2.0", "triton": "3.0", "kernels": "0" * 16, "device": GPU}
CONFIG = {"TILE_N": 32, "num_warps": 8, "num_stages": 3}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    block_sparse._device_config.cache_clear()
    yield tmp_path
    block_sparse._device_config.cache_clear()


def test_candidates_fit_the_block_and_head_dim():
    assert len(candidates(64, 128)) == 12 and {c["TILE_N"] for c in candidates(64, 128)} == {32, 64}
    assert {c["TILE_N"] for c in candidates(32, 128)} == {32}
    assert {c["TILE_N"] for c in candidates(128, 256)} == {32, 64}  # d 256 fits 64 wide in one or two stages
    assert {c["TILE_N"] for c in candidates(16, 64)} == {16}


def test_round_trip_and_merge(tmp_path):
    path = tmp_path / "t.json"
    write_configs(path, GPU, ENV, {"64x128": CONFIG})
    write_configs(path, GPU, ENV, {"128x64": {**CONFIG, "TILE_N": 64}})
    got = device_configs(read_table(path), GPU, ENV, path)
    assert got == {"64x128": CONFIG, "128x64": {**CONFIG, "TILE_N": 64}}
    assert json.loads(path.read_text())["schema_version"] == launch_table.SCHEMA_VERSION
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write leaves no temporary behind
    # New versions replace the device's entry instead of merging into timings of the old ones.
    newer = {**ENV, "kernels": "1" * 16}
    write_configs(path, GPU, newer, {"64x64": CONFIG})
    assert device_configs(read_table(path), GPU, newer, path) == {"64x64": CONFIG}


def test_failed_write_leaves_the_table_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    write_configs(path, GPU, ENV, {"64x128": CONFIG})
    before = path.read_text()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("sparsesearch.files.os.replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_configs(path, GPU, ENV, {"64x64": CONFIG})
    assert path.read_text() == before and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("stored_env", [
    {**ENV, "triton": "9.9"},                 # another Triton
    {**ENV, "kernels": "f" * 16},             # older kernels
    {**ENV, "device": "NVIDIA H200"},         # measured on another GPU
])
def test_stale_or_foreign_entry_is_ignored_with_a_warning(tmp_path, stored_env):
    path = tmp_path / "t.json"
    write_configs(path, GPU, stored_env, {"64x128": CONFIG})
    with pytest.warns(UserWarning, match="other versions"):
        assert device_configs(read_table(path), GPU, ENV, path) == {}


@pytest.mark.parametrize("text, match", [
    ("{not json", "unreadable"),
    (json.dumps({"schema_version": 99, "devices": {}}), "not schema"),
    (json.dumps(["a", "list"]), "not schema"),
])
def test_malformed_table_is_ignored_with_a_warning(tmp_path, text, match):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=match):
        assert read_table(path)["devices"] == {}


def test_invalid_config_values_are_dropped(tmp_path):
    path = tmp_path / "t.json"
    write_configs(path, GPU, ENV, {"64x128": {**CONFIG, "num_warps": 3}, "64x64": {"TILE_N": 64}, "128x128": CONFIG})
    assert device_configs(read_table(path), GPU, ENV, path) == {"128x128": CONFIG}
    # An entry whose configs are not a mapping reads as none, and a new tuning replaces it.
    path.write_text(json.dumps({"schema_version": 1, "devices": {GPU: {"env": ENV, "configs": ["x"]}}}))
    assert device_configs(read_table(path), GPU, ENV, path) == {}
    write_configs(path, GPU, ENV, {"64x128": CONFIG})
    assert device_configs(read_table(path), GPU, ENV, path) == {"64x128": CONFIG}


def test_fastest_keeps_failures_as_rows():
    times = {(64, 4, 2): 2.0, (32, 4, 2): 1.5, (64, 8, 3): 1.0}

    def time_ms(c):
        key = (c["TILE_N"], c["num_warps"], c["num_stages"])
        if key not in times:
            raise RuntimeError("out of resources: shared memory")
        return times[key]

    best, rows = fastest(candidates(64, 128), time_ms)
    assert best == {"TILE_N": 64, "num_warps": 8, "num_stages": 3}
    assert len(rows) == 12 and sum("error" in r for r in rows) == 9
    best, rows = fastest(candidates(64, 128), lambda c: 1 / 0)
    assert best is None and all("error" in r for r in rows)


def test_device_config_reads_the_table_for_this_gpu(cache_home, monkeypatch):
    """What a launch on a GPU gets: the device defaults, with a table entry for its (block_n, head_dim) over them, and
    the defaults alone where the entry was measured under other versions."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    cuda = torch.device("cuda", 0)
    write_configs(default_path(), GPU, cache_env(GPU), {config_key(64, 128): CONFIG})
    got = block_sparse._device_config(64, 128, cuda, False)
    assert got == {**CONFIG, "tma": False, "ws": False}
    assert block_sparse._device_config(64, 128, cuda, False, tuned=False)["TILE_N"] == 64
    assert block_sparse._device_config(64, 64, cuda, False)["num_warps"] == 4  # no entry for d 64
    block_sparse._device_config.cache_clear()
    write_configs(default_path(), GPU, {**cache_env(GPU), "triton": "0.0.1"}, {config_key(64, 128): CONFIG})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert block_sparse._device_config(64, 128, cuda, False)["num_warps"] == 4
    assert any("other versions" in str(w.message) for w in caught)


@pytest.mark.parametrize("kwargs, match", [
    ({"blocks": [48]}, "block must be one of"),
    ({"head_dims": [96]}, "head_dim must be one of"),
    ({"tokens": 100}, "tokens must be at least"),
    ({"heads": 6, "kv_heads": 4}, "multiple of kv_heads"),
    ({"density": 0.0}, "density must be in"),
])
def test_bad_tuning_input_names_the_value(kwargs, match):
    args = {"blocks": [64], "head_dims": [64], "tokens": 1024, "heads": 4, "kv_heads": 2, "density": 0.25, **kwargs}
    with pytest.raises(ValueError, match=match):
        kernel_tuning.check_args(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_tuning_needs_a_gpu(cache_home):
    with pytest.raises(ValueError, match="no CUDA device"):
        kernel_tuning.tune_launches(blocks=[64], head_dims=[64], tokens=1024)
    assert not default_path().exists()


def test_tune_one_times_every_candidate_against_the_default_output():
    """The whole tuning step on real launches (the interpreter on CPU): each candidate's output is checked against
    the default config's before it is timed, and the fastest is reported; a fake timer makes the choice known."""
    order = iter(range(100, 0, -1))  # each timed candidate faster than the one before: the last one wins
    result = kernel_tuning.tune_one(64, 64, 256, 2, 1, 0.5, torch.device(DEVICE), time_ms=lambda fn: (fn(), next(order))[1])
    rows = result["rows"]
    assert len(rows) == 12 and result["key"] == "64x64" and result["default_ms"] is not None
    if DEVICE == "cpu":  # the interpreter runs every config; a GPU may refuse some (out of shared memory)
        assert not any("error" in r for r in rows)
    last = [r for r in rows if "ms" in r][-1]
    assert result["best"] == {name: last[name] for name in launch_table.TUNED} and result["best_ms"] == last["ms"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts timed calls; a GPU may refuse some candidates")
def test_tune_one_keeps_the_default_within_noise():
    """Every candidate 1% faster than the default does not replace it (MIN_GAIN)."""
    default = {"TILE_N": 64, "num_warps": 4, "num_stages": 1}  # the interpreter's launch config
    at = candidates(64, 64).index(default)
    calls = []

    def time_ms(fn):
        calls.append(fn())
        return 1.0 if len(calls) - 1 == at else 0.99

    result = kernel_tuning.tune_one(64, 64, 256, 2, 1, 0.5, torch.device("cpu"), time_ms=time_ms)
    assert len(calls) == 12 and result["default_ms"] == 1.0
    assert result["best"] == result["default"] == default and result["best_ms"] == 1.0


@pytest.mark.parametrize("args, expected", [
    (["--block", "48"], "block must be one of"),
    (["--density", "1.5"], "density must be in"),
    (["--heads", "6", "--kv-heads", "4"], "multiple of kv_heads"),
])
def test_cli_bad_input_is_one_line_and_exit_2(cache_home, args, expected):
    from typer.testing import CliRunner

    from sparsesearch_cli.app import app

    result = CliRunner().invoke(app, ["tune-kernels", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr
    assert not default_path().exists()
