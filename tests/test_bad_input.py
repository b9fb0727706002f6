"""Bad input and faults, by class, for every command: each class is closed by one guard, and each test here fails
when its guard is taken away.

1. An output that aliases an input (preflight.output_path): never written over, into or around what is read.
2. OS errors on user paths (cli.common.exits_cleanly, files.naming, preflight.writable): one line naming the path,
   exit 2, nothing half-written.
3. Sizes that imply huge allocations (preflight.sizes_fit, memory.fits_memory, export/check/tune-kernels' own):
   refused on the model's context or a memory estimate before anything is allocated.
4. Pathological files (json_input, load_artifact's NaN rule, the GGUF reader): one line however malformed.
5. Refusals after the expensive part: what the config tells (an eviction head) is checked before the weights load.
6. --help renders flags without a value type, for every command.

Every command that could load a model runs with a loader that fails the test when reached (``no_loading``). The
model is a config-only Hugging Face directory shaped like the test artifacts' (2 layers, 4/2 heads, d 64, 4096
positions): enough for everything checked before loading, and fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import sparsesearch.models
from artifact_fixtures import TINY, make_artifact, manifest as tiny_manifest, mix_rows, rehash, rewrite_heads
from sparsesearch.artifacts import load_artifact, write_artifact
from sparsesearch_cli.app import app
from sparsesearch_cli.common import exits_cleanly

runner = CliRunner()


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(sparsesearch.models, "load_model", refuse)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A config-only Llama directory that TINY artifacts fit (2 layers, 4/2 heads, head_dim 64, 4096 positions), with
    a tokenizer file in name only: nothing here loads it."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("model")
    LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=TINY.num_layers,
                num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.num_kv_heads,
                max_position_embeddings=TINY.max_position_embeddings).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")
    return path


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def refused(result, *fragments: str) -> str:
    """Exit 2, no traceback, exactly one line on stderr, starting 'error:' and holding every fragment."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


def tree(path: Path) -> dict:
    """Every file under ``path`` (or the file itself) with its sha256: what must be unchanged after a refusal."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def minference_config(tmp_path: Path) -> Path:
    """A MInference config for TINY (2 layers x 4 query heads): one entry, the rest MInference's fallback."""
    path = tmp_path / "config.json"
    path.write_text('[{"0": ["stream_llm", 64, 512, 0.5]}, {}]')
    return path


# ----------------------------------------------------------------------- 1. outputs that alias inputs


@pytest.mark.parametrize("fmt, name", [("json", "heads.parquet"), ("minference", "manifest.json"), ("duo", "new.tsv")])
def test_export_never_writes_into_the_artifact_it_reads(tmp_path, fmt, name):
    art = make_artifact(tmp_path / "A")
    before = tree(art)
    refused(run("export", art, "--format", fmt, "--out", art / name), "is inside artifact", str(art))
    assert tree(art) == before
    load_artifact(art)


def test_export_through_a_symlink_to_the_artifact_is_refused(tmp_path):
    art = make_artifact(tmp_path / "A")
    (tmp_path / "link").symlink_to(art)
    refused(run("export", art, "--format", "json", "--out", tmp_path / "link" / "heads.parquet"), "is inside artifact")
    load_artifact(art)


def test_export_never_writes_over_its_qk_input(tmp_path):
    art = make_artifact(tmp_path / "A")
    qk = tmp_path / "qk.safetensors"
    qk.write_bytes(b"q and k")
    refused(run("export", art, "--format", "flex", "--qk", qk, "--out", qk), "is --qk")
    assert qk.read_bytes() == b"q and k"


def test_export_beside_the_artifact_is_written(tmp_path):
    """The control: the guard refuses aliases only."""
    art = make_artifact(tmp_path / "A")
    result = run("export", art, "--format", "json", "--out", tmp_path / "new" / "dir" / "a.json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "new" / "dir" / "a.json").read_text())["manifest"]["model"]["id"] == TINY.id


def test_import_refuses_an_out_that_holds_its_input_even_with_overwrite(tmp_path, model_dir):
    out = make_artifact(tmp_path / "B")  # an artifact --overwrite would replace whole, and the config with it
    config = minference_config(out)
    before = tree(out)
    refused(run("import-minference", config, "--model", model_dir, "--out", out, "--overwrite"), "contains FILE", str(config))
    assert tree(out) == before


def test_import_refuses_an_out_inside_the_model(tmp_path, model_dir):
    before = tree(model_dir)
    refused(run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", model_dir / "art"),
            "is inside --model")
    assert tree(model_dir) == before


def test_the_named_target_with_overwrite_is_replaced_whole(tmp_path, model_dir):
    """The one way to write over an artifact: name it as the target and pass --overwrite."""
    out = make_artifact(tmp_path / "B")
    refused(run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", out), "--overwrite")
    result = run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert load_artifact(out).manifest["provenance"]["kind"] == "imported"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["B", "config.json"]  # no temporaries or old copies left


def test_calibrate_refuses_outputs_on_its_inputs(tmp_path, model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text('{"text": "hello"}\n')
    cases = [
        (["--out", model_dir], "is --model"),
        (["--out", data, "--data", data / "rows.jsonl"], "contains --data"),
        (["--out", tmp_path / "run", "--data", tmp_path / "run.partial"], "is --data"),  # OUT.partial/ is deleted on a fresh start
        (["--out", data, "--eval-data", f"synthetic:passkey,{data / 'rows.jsonl'}"], "contains --eval-data"),
    ]
    (tmp_path / "run.partial").mkdir()
    before = tree(tmp_path)
    for args, message in cases:
        refused(run("calibrate", "--model", model_dir, *args), message)
    assert tree(tmp_path) == before


def test_probe_sweeps_and_pareto_refuse_outputs_on_their_inputs(tmp_path, model_dir):
    art = make_artifact(tmp_path / "A")
    data = art / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    rehash(art)
    before = {**tree(art), **tree(model_dir)}
    refused(run("probe-layers", "--model", model_dir, "--out", model_dir / "sub"), "is inside --model")
    refused(run("sweep-nosa", "--model", model_dir, "--into", art, "--data", data), "contains --data")
    refused(run("sweep-spava", "--model", model_dir, "--out", model_dir), "is --model")
    refused(run("pareto", "--model", model_dir, "--artifact", art, "--out", art), "is --artifact")
    assert {**tree(art), **tree(model_dir)} == before


# --------------------------------------------------------------------------- 2. OS errors on user paths


def test_out_under_a_file_is_one_line(tmp_path, model_dir):
    """A parent that is a file: refused for root too (permissions cannot be relied on there)."""
    art = make_artifact(tmp_path / "A")
    blocker = tmp_path / "file"
    blocker.write_text("")
    under = blocker / "sub"
    refused(run("export", art, "--format", "json", "--out", under / "x.json"), str(blocker), "not a directory")
    refused(run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", under), str(blocker))
    refused(run("calibrate", "--model", model_dir, "--out", under), str(blocker))
    refused(run("pareto", "--model", model_dir, "--artifact", art, "--out", under), str(blocker))
    refused(run("sweep-nosa", "--model", model_dir, "--out", under), str(blocker))
    assert blocker.read_text() == ""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_out_where_nothing_can_be_created_is_one_line(tmp_path, model_dir):
    """/proc takes no new files, not even from root: the write check tries for real instead of reading modes."""
    art = make_artifact(tmp_path / "A")
    target = Path("/proc/sparsesearch-bad-input/x.json")
    refused(run("export", art, "--format", "json", "--out", target), str(target), "cannot write in /proc")
    refused(run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", "/proc/sparsesearch-bad-input"),
            "cannot write in /proc")


def test_a_full_disk_during_an_export_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    import sparsesearch.files as files

    art = make_artifact(tmp_path / "A")
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.json").write_text("old")

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # write() on a full disk names no file

    monkeypatch.setattr(files, "_fsync_file", full)
    refused(run("export", art, "--format", "json", "--out", out / "x.json"), str(out / "x.json"), "No space left on device")
    assert [p.name for p in out.iterdir()] == ["x.json"] and (out / "x.json").read_text() == "old"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_failed_artifact_write_names_it_and_keeps_the_old_one(tmp_path, model_dir, monkeypatch, code):
    import sparsesearch.artifacts.io as io

    out = make_artifact(tmp_path / "B")
    before = tree(out)

    def fail(path, data):
        raise OSError(code, os.strerror(code), str(path))  # names the temporary directory's file

    monkeypatch.setattr(io, "write_bytes_synced", fail)
    refused(run("import-minference", minference_config(tmp_path), "--model", model_dir, "--out", out, "--overwrite"),
            f"{out}: {os.strerror(code)}")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["B", "config.json"]


def test_a_name_too_long_is_one_line(tmp_path):
    art = make_artifact(tmp_path / "A")
    out = tmp_path / ("d" * 300) / "x.json"
    refused(run("export", art, "--format", "json", "--out", out), str(out), "File name too long")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A"]


def test_inputs_that_are_not_regular_files_are_one_line(tmp_path, model_dir):
    art = make_artifact(tmp_path / "A")
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    refused(run("import-minference", fifo, "--model", model_dir, "--out", tmp_path / "x"), "not a regular file")
    (tmp_path / "dir.json").mkdir()
    refused(run("import-minference", tmp_path / "dir.json", "--model", model_dir, "--out", tmp_path / "x"), "is a directory")
    refused(run("validate", art / "heads.parquet"), "is not an artifact directory")
    refused(run("export", art, "--format", "json", "--out", art.parent), "is a directory")
    refused(run("inspect", tmp_path / "missing" / "dir"), "does not exist")


def test_exits_cleanly_turns_path_errors_into_one_line_and_keeps_other_faults():
    """The class-level rule itself: an OS error about a path is bad input (exit 2, one line naming it); one
    about no path, such as a refused connection, is a fault of the run and keeps its traceback (exit 1)."""
    probe = typer.Typer()

    @probe.command()
    @exits_cleanly
    def fail(kind: str) -> None:
        if kind == "permission":
            raise PermissionError(errno.EACCES, "Permission denied", "/data/run")
        if kind == "full":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    refused(runner.invoke(probe, ["permission"]), "/data/run: Permission denied")
    refused(runner.invoke(probe, ["full"]), "No space left on device")
    other = runner.invoke(probe, ["connection"])
    assert other.exit_code == 1 and isinstance(other.exception, ConnectionRefusedError)


# --------------------------------------------------------------------------------------------- 3. sizes


def test_export_flex_sizes_are_checked_before_allocating(tmp_path):
    from dataclasses import replace

    art = make_artifact(tmp_path / "A")
    refused(run("export", art, "--format", "flex", "--tokens", 1_000_000_000, "--out", tmp_path / "f.safetensors"),
            "--tokens 1000000000 exceeds the context of model 'tiny-llama' (4096 tokens)")
    no_context = make_artifact(tmp_path / "B", model=replace(TINY, max_position_embeddings=None))
    refused(run("export", no_context, "--format", "flex", "--tokens", 1_000_000_000, "--out", tmp_path / "f.safetensors"),
            "--format flex at 1000000000 tokens needs about", "PB of memory")
    assert not (tmp_path / "f.safetensors").exists()


@pytest.mark.parametrize("args, message", [
    (["--tokens", 100_000_000], "TB of memory"),
    (["--heads", 10_000_000, "--kv-heads", 1, "--tokens", 64], "of memory"),
    (["--kv-heads", 0], "--kv-heads must be >= 1"),
    (["--heads", -4], "--heads must be >= 1"),
])
def test_check_sizes_are_checked_before_allocating(args, message):
    refused(run("check", "--device", "cpu", *args), message)


def test_tune_kernels_sizes_are_checked_against_the_gpu_before_allocating(monkeypatch):
    import torch

    import sparsesearch.kernel_tuning as tuning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * 10**9, 80 * 10**9))
    monkeypatch.setattr(tuning, "tune_launches", lambda *a, **k: pytest.fail("tuning started before the size was checked"))
    refused(run("tune-kernels", "--tokens", 10**9, "--dry-run"), "--tokens 1000000000 with 32/8 heads of dim 128 needs about",
            "the GPU has 80.0 GB available")


def test_calibrate_refuses_a_length_past_the_context_as_that(tmp_path, model_dir):
    """Not through a side reason (the held-out text too short for a million tokens), before the data is read."""
    refused(run("calibrate", "--model", model_dir, "--max-tokens", 1_000_000, "--out", tmp_path / "a"),
            "--max-tokens 1000000 exceeds the context of model")
    refused(run("calibrate", "--model", model_dir, "--samples", 10**12, "--max-tokens", 1024, "--out", tmp_path / "a"),
            "--samples 1000000000000 x --max-tokens 1024 token ids needs about", "of memory")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("args, message", [
    (["evaluate", "{art}", "--model", "{model}", "--tokens", 10**9], "exceeds the context"),
    (["probe-layers", "--model", "{model}", "--tokens", 10**9, "--out", "{tmp}/p"], "exceeds the model's context"),
    (["sweep-nosa", "--model", "{model}", "--context", 10**9, "--out", "{tmp}/n"], "exceeds the context"),
    (["sweep-nosa", "--model", "{model}", "--budget", 10**9, "--context", 1024, "--decode-steps", 8, "--out", "{tmp}/n"],
     "--budget 1000000000 exceeds the 1032 tokens"),
    (["pareto", "--model", "{model}", "--tokens", 10**9], "exceeds the context"),
    # gloo: on a host of fewer GPUs than --nproc, "auto" is nccl and refuses the rank count first
    (["sweep-spava", "--model", "{model}", "--tokens", 10**9, "--backend", "gloo", "--out", "{tmp}/s"], "exceeds the context"),
    (["spava", "run", "--model", "{model}", "--tokens", 10**9, "--backend", "gloo"], "exceeds the context"),
])
def test_lengths_past_the_context_are_refused_before_loading(tmp_path, model_dir, args, message):
    fill = {"{art}": str(make_artifact(tmp_path / "A")), "{model}": str(model_dir), "{tmp}": str(tmp_path)}
    for key, value in fill.items():
        args = [str(a).replace(key, value) for a in args]
    refused(run(*args), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A"]


def test_fits_memory_names_the_size():
    from sparsesearch.memory import fits_memory, human

    fits_memory("small", 10, available=10)
    with pytest.raises(ValueError, match=r"^--tokens 9 needs about 2\.2 PB of memory; this machine has 1\.0 GB available$"):
        fits_memory("--tokens 9", 2_200_000_000_000_000, available=1_000_000_000)
    assert human(999) == "999 B" and human(1500) == "1.5 KB"


# --------------------------------------------------------------------------------- 4. pathological files


@pytest.mark.parametrize("content, message", [
    (b"[" * 200_000, "nested deeper than 64 levels"),
    (b"[" * 100 + b"]" * 100, "nested deeper than 64 levels"),  # parses in Python, but nothing of ours is that deep
    (b'[{"0": ["stream_llm", 64, 512, NaN]}, {}]', "NaN is not a JSON number"),
    (b'[{"0": ["stream_llm", 64, Infinity, 1]}, {}]', "Infinity is not a JSON number"),
    (b'[{"0": ["stream_llm", 64, 512, 1], "0": ["stream_llm", 8, 64, 1]}, {}]', "repeated key(s) ['0']"),
    (b'[{"0": ["stream_llm", 64, 512, "caf\xe9"]}, {}]', "not UTF-8 text"),
    (b"", "not valid JSON"),
    (b"\x00\x01\x02", "not valid JSON"),
])
def test_import_minference_refuses_malformed_json_in_one_line(tmp_path, model_dir, content, message):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    refused(run("import-minference", bad, "--model", model_dir, "--out", tmp_path / "x"), "bad.json", message)
    assert not (tmp_path / "x").exists()


def test_a_config_file_too_big_to_be_one_is_refused_unread(tmp_path, model_dir):
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:  # sparse: 1 GiB of nothing on disk
        handle.truncate(1 << 30)
    refused(run("import-minference", huge, "--model", model_dir, "--out", tmp_path / "x"), "1024.0 MiB, more than the 16 MiB")


@pytest.mark.parametrize("content, message", [
    (b"[" * 200_000, "nested deeper than 64 levels"),
    (b'{"schema_version": NaN}', "NaN is not a JSON number"),
    (b'{"schema_version": 1, "schema_version": 1}', "repeated key(s)"),
    (b'{"caf\xe9": 1}', "not UTF-8 text"),
])
def test_a_malformed_manifest_is_one_line_for_every_reader(tmp_path, content, message):
    art = make_artifact(tmp_path / "A")
    (art / "manifest.json").write_bytes(content)
    for command in (["validate", art], ["inspect", art], ["export", art, "--format", "json", "--out", tmp_path / "x.json"],
                    ["diff", art, art]):
        refused(run(*command), "manifest.json", message)


def test_nan_in_heads_parquet_is_refused_not_read_as_missing(tmp_path):
    art = make_artifact(tmp_path / "A", mix_rows())
    rewrite_heads(art, lambda rows: [{**r, "score": float("nan")} if i == 1 else r for i, r in enumerate(rows)])
    refused(run("validate", art), "heads.parquet column score holds NaN; a missing value is null")
    rewrite_heads(art, lambda rows: [{**r, "score": None} for r in rows])
    assert run("validate", art).exit_code == 0  # null: not measured, which is fine


def test_a_table_too_big_to_decompress_is_refused_from_its_footer(tmp_path, monkeypatch):
    """A few KB of zstd can hold GBs of zeros: the footer's uncompressed size is checked before any row is read."""
    import sparsesearch.memory as memory

    art = make_artifact(tmp_path / "A")
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)  # a machine with 1 KB free stands in for a bomb
    refused(run("validate", art), "heads.parquet (8 rows,", "uncompressed) needs about", "this machine has 1.0 KB available")


@pytest.mark.parametrize("damage", ["random", "truncated", "empty"])
def test_a_damaged_parquet_with_a_matching_hash_is_one_line(tmp_path, damage):
    art = make_artifact(tmp_path / "A")
    file = art / "heads.parquet"
    data = file.read_bytes()
    file.write_bytes({"random": os.urandom(len(data)), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    rehash(art)
    refused(run("validate", art), "heads.parquet is not a readable Parquet file")


@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00", b"GGUF", b"not a gguf at all", b""])
def test_a_damaged_gguf_is_one_line(tmp_path, content):
    model = tmp_path / "model.gguf"
    model.write_bytes(content)
    refused(run("evaluate", make_artifact(tmp_path / "A"), "--model", model), "model.gguf")


def test_malformed_search_space_and_rank_times_are_one_line(tmp_path, model_dir):
    space = tmp_path / "space.json"
    space.write_bytes(b"[" * 200_000)
    refused(run("calibrate", "--model", model_dir, "--search-space", space, "--out", tmp_path / "a"), "--search-space", "nested deeper")
    space.write_bytes(b'{"candidates": NaN}')
    refused(run("calibrate", "--model", model_dir, "--search-space", space, "--out", tmp_path / "a"), "NaN is not a JSON number")
    rank = tmp_path / "ranks.jsonl"
    rank.write_bytes(b'{"rank": 0}\n' + b"[" * 200_000 + b"\n")
    refused(run("sweep-spava", "--rank-times", rank), "ranks.jsonl:2", "nested deeper")


@pytest.mark.parametrize("name, content, message", [
    ("deep.jsonl", b"[" * 200_000 + b"\n", "deep.jsonl"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', "not UTF-8 text"),
    ("latin1.txt", b"caf\xe9\n" * 100, "not UTF-8 text"),
    ("garbage.parquet", b"PAR1" + os.urandom(64) + b"PAR1", "garbage.parquet"),
])
def test_malformed_data_files_are_one_line(tmp_path, model_dir, name, content, message):
    data = tmp_path / name
    data.write_bytes(content)
    refused(run("calibrate", "--model", model_dir, "--data", data, "--max-tokens", 256, "--out", tmp_path / "a"), message)


def test_a_damaged_qk_file_is_one_line(tmp_path):
    art = make_artifact(tmp_path / "A")
    qk = tmp_path / "qk.safetensors"
    qk.write_bytes(b"\xff" * 16)
    refused(run("export", art, "--format", "flex", "--qk", qk, "--out", tmp_path / "f.safetensors"), "--qk qk.safetensors: cannot read")


# ------------------------------------------------------------------------ 5. refusals before the weights load


def nosa_artifact(path: Path, proxy: str) -> Path:
    recommended = {"proxy": proxy, "block": 64, "budget": 1024, "k": 16, "k_q": 4, "k_e": 10, "kq_ratio": 0.25,
                   "n_init": 1, "n_win": 1, "kernel": 32, "stride": 16}
    manifest = tiny_manifest()
    manifest["methods"] = {**manifest["methods"], "nosa": {"recommended": recommended}}
    return write_artifact(path, manifest, {"heads.parquet": mix_rows()})


def test_proxy_trained_is_refused_from_the_config(tmp_path, model_dir):
    """A stock model cannot carry NOSA's eviction head: known from its config, so refused before the 40-90 s load."""
    grid = ["--budget", 256, "--block-size", 32, "--kq-ratio", 0.25, "--context", 1024, "--decode-steps", 8]
    refused(run("sweep-nosa", "--model", model_dir, "--proxy", "trained", *grid, "--out", tmp_path / "n"),
            "--proxy trained needs a NOSA checkpoint with an eviction head")
    refused(run("evaluate", nosa_artifact(tmp_path / "A", "trained"), "--model", model_dir), "eviction head")
    own_code = tmp_path / "own-code"
    own_code.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (own_code / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_nosa.NosaForCausalLM"}}))
    (own_code / "tokenizer_config.json").write_text("{}")
    refused(run("sweep-nosa", "--model", own_code, "--proxy", "trained", *grid, "--out", tmp_path / "n"), "--trust-remote-code")
    allowed = run("sweep-nosa", "--model", own_code, "--proxy", "trained", "--trust-remote-code", *grid, "--out", tmp_path / "n")
    assert isinstance(allowed.exception, AssertionError)  # the guard let it through, to the (refused) load
    assert not (tmp_path / "n").exists()


def test_a_model_without_a_tokenizer_is_refused_from_its_directory(tmp_path, model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    for command in (["calibrate", "--out", tmp_path / "a"], ["probe-layers", "--out", tmp_path / "p"],
                    ["evaluate", make_artifact(tmp_path / "A")], ["pareto"], ["sweep-nosa", "--out", tmp_path / "n"]):
        refused(run(*command, "--model", bare), "has no tokenizer files")


# ------------------------------------------------------------------------------------------------- 6. help


def commands(group, path=()):
    """(path, click command) of every command and group under ``group``, the group itself first."""
    import click

    ctx = click.Context(group)
    yield path, group
    for name in getattr(group, "list_commands", lambda ctx: [])(ctx):
        yield from commands(group.get_command(ctx, name), (*path, name))


def test_no_flag_shows_a_value_type_in_help():
    from typer.main import get_command

    from sparsesearch_cli.app import app as cli

    seen = 0
    for path, command in commands(get_command(cli)):
        result = runner.invoke(cli, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, (path, result.output)
        for param in command.params:
            if getattr(param, "is_flag", False) and not param.hidden:
                line = next(line for line in result.output.splitlines() if param.opts[0] + " " in line)
                assert "<" not in line.split(param.opts[0], 1)[1].split("  ", 1)[0], line
                seen += 1
    assert seen >= 20  # --json, --overwrite, --resume, --validate, ... across the commands
    export = runner.invoke(cli, ["export", "--help"], terminal_width=200).output
    assert any("--tokens" in line and "<int>" in line for line in export.splitlines())  # options with values keep their type
