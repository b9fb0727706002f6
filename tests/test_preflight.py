"""Bad input is refused before the model loads: one line, exit 2, nothing left on disk (calibrate,
probe-layers, evaluate). The model loader is replaced by one that fails the test if it is reached."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import sparsesearch.models
from artifact_fixtures import TINY, make_artifact
from sparsesearch_cli.app import app
from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))  # max_position_embeddings 4096


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(sparsesearch.models, "load_model", refuse)


def refused(args: list[str], message: str):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    return result


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text('{"model_type": "llama", ')
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "5000"], "--max-tokens 5000 exceeds the context of model"),
    (["--eval-tokens", "8192", "--eval-data", "synthetic:passkey"], "--eval-tokens 8192 exceeds the context"),
    (["--data", "{dir}/missing.jsonl"], "--data: calibration file not found"),
    (["--data", "{dir}/latin1.jsonl"], "latin1.jsonl: not UTF-8 text"),
    (["--data", "{dir}/broken.parquet"], "broken.parquet: cannot be read"),
    (["--eval-data", "synthetic:nope"], "--eval-data: unknown synthetic set 'synthetic:nope'"),
    (["--dtype", "float8"], "dtype 'float8' is not one of"),
    (["--min-tokens", "0"], "--min-tokens must be >= 1"),
])
def test_calibrate_refuses_before_loading(tiny_model, bad_files, args, message):
    out = bad_files / "art"
    args = [a.replace("{dir}", str(bad_files)) for a in args]
    refused(["calibrate", "--model", tiny_model, "--out", out, *args], message)
    assert not out.exists() and not out.with_name("art.partial").exists()


def test_garbled_config_is_one_line(bad_files):
    refused(["calibrate", "--model", bad_files / "garbled", "--out", bad_files / "art"], "config.json could not be read")
    assert not (bad_files / "art").exists()


def test_probe_layers_refuses_before_loading(tiny_model, tmp_path):
    refused(["probe-layers", "--model", tiny_model, "--tokens", "5000", "--out", tmp_path / "p"], "--tokens 5000 exceeds the model's context")
    refused(["probe-layers", "--model", tiny_model, "--validate", "--eval-data", "synthetic:nope", "--out", tmp_path / "p"], "--eval-data: unknown synthetic set")
    assert not (tmp_path / "p").exists()


def test_evaluate_refuses_before_loading(tiny_model, tmp_path):
    art = make_artifact(tmp_path / "tiny-art")  # made for TINY (2 layers, 4/2 heads), not for the 3-layer tiny model
    refused(["evaluate", art, "--model", tiny_model, "--tokens", "9000"], "--tokens 9000 exceeds the context")
    refused(["evaluate", art, "--model", tiny_model, "--tokens", "10"], "--tokens must be >= 64")
    refused(["evaluate", art, "--model", tiny_model, "--tokens", "512", "--min-tokens", "256"], "layers")
    assert TINY.num_layers == 2


def test_short_text_and_dead_min_tokens_are_refused_before_loading(tiny_model, tmp_path):
    art = make_artifact(tmp_path / "tiny-art")
    note = tmp_path / "note.txt"
    note.write_text("Too short.\n" * 40)
    refused(["evaluate", art, "--model", tiny_model, "--data", note, "--tokens", "2048"],
            f"--data: {note}: its held-out text has at most 228 tokens, fewer than the 2048 asked for")
    refused(["evaluate", art, "--model", tiny_model, "--data", "text:poems"], "--data: unknown text set 'text:poems'")
    refused(["evaluate", art, "--model", tiny_model, "--tokens", "1024", "--min-tokens", "2048"], "--min-tokens 2048 > --tokens 1024")
    refused(["calibrate", "--model", tiny_model, "--data", note, "--max-tokens", "1024", "--out", tmp_path / "a"],
            "its calibration text has at most 228 tokens, fewer than the 1024 asked for")
    assert not (tmp_path / "a").exists()
