"""Exports that engines read (issue P14): qwen-1m, flashprefill, and check-export on real, own and broken files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from artifact_fixtures import TINY, make_artifact, manifest, mix_rows, row
from cli.app import app
from sparsesearch.artifacts import load_artifact, write_artifact
from sparsesearch.artifacts.tables import to_query_heads
from sparsesearch.export.check import check_file
from sparsesearch.export.flashprefill import FLAG, flag_line, parse_flag_line, start_layer
from sparsesearch.export.minference import import_minference
from sparsesearch.export.qwen1m import export_qwen1m, write_qwen1m
from sparsesearch.models import resolve_model_info

runner = CliRunner()
CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "data" / "minference-configs"
QWEN_FILE, LLAMA_FILE = "Qwen2.5_7B_Instruct_1M.json", "Llama_3.1_8B_Instruct_128k_kv_out_v32_fit_o_best_pattern.json"
VS_DENSE = [("vertical_slash", dict(vertical_size=1000, slash_size=2048)), ("dense", dict())]
COMPARED = ("layer", "head", "pattern", "vertical_size", "slash_size", "last_q", "force_vertical", "force_slash", "score")
TRI = {"trianglemix": {"start_layer": 1, "sink": 4, "window": 64, "last": 16}}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def load(tmp_path, rows, *, space="query", methods=None, name="art"):
    m = manifest(space=space)
    m["methods"].update(methods or {})
    return load_artifact(write_artifact(tmp_path / name, m, {"heads.parquet": rows}))


def fields(rows):
    return [{k: r[k] for k in COMPARED} for r in sorted(rows, key=lambda r: (r["layer"], r["head"]))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """Config-only Llama directory TINY artifacts fit."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=TINY.num_layers,
                num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.num_kv_heads,
                max_position_embeddings=TINY.max_position_embeddings).save_pretrained(path)
    return path


def real_model(tmp_path_factory, name: str) -> Path:
    """A directory holding one of the shared public model configs as config.json (no weights)."""
    if not CONFIGS.is_dir():
        pytest.skip(f"{CONFIGS} (shared fixtures) not present")
    path = tmp_path_factory.mktemp(name.split(".")[0])
    shutil.copy(CONFIGS / name, path / "config.json")
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return real_model(tmp_path_factory, "qwen2.5-7b.config.json")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return real_model(tmp_path_factory, "llama-3.1-8b.config.json")


# ------------------------------------------------------------------------------------------ qwen-1m export


def test_qwen1m_writes_every_query_head_and_dense_as_every_column(tmp_path):
    config = export_qwen1m(load(tmp_path, mix_rows(VS_DENSE)))
    assert len(config) == 2 and all(list(layer) == ["0", "1", "2", "3"] for layer in config)
    assert config[0]["0"] == ["vertical_and_slash", 1000, 2048, 0.5]
    assert config[0]["1"] == ["vertical_and_slash", TINY.max_position_embeddings, 100, 0.51]  # dense: all C columns
    assert {entry[0] for layer in config for entry in layer.values()} == {"vertical_and_slash"}


@pytest.mark.parametrize("space", ["query", "kv"])
def test_qwen1m_round_trip_equals_the_exported_patterns(tmp_path, space):
    heads = TINY.num_heads if space == "query" else TINY.num_kv_heads
    art = load(tmp_path, mix_rows(VS_DENSE, heads=heads), space=space)
    path = write_qwen1m(art, tmp_path / "sparse_attention_config.json")
    back = load_artifact(write_artifact(tmp_path / "back", *import_minference(path, TINY))).head_rows()
    assert fields(back) == fields(to_query_heads(art.head_rows(), art.manifest))  # KV rows repeated per group


@pytest.mark.parametrize("rows, methods, fragment", [
    (mix_rows(), None, "layer 0 head 1 (ashape) has no exact vertical_and_slash form"),
    ([row(0, 0, "block_topk", dict(k_blocks=4))], None, "layer 0 head 0 (block_topk)"),
    ([row(0, 0, "vertical_slash", dict(vertical_size=30, slash_size=512))], None, "vertical_size 30, which the engines read as 130"),
    ([row(0, 0, "vertical_slash", dict(vertical_size=500, slash_size=4))], None, "below 8"),
    ([row(0, 0, "vertical_slash", dict(vertical_size=500, slash_size=512, last_q=32))], None, "last_q 32"),
    ([row(0, 0, "vertical_slash", dict(vertical_size=500, slash_size=512))], TRI, "layer 1 head 0 (triangle)"),
])
def test_qwen1m_refuses_what_the_engines_would_run_differently(tmp_path, rows, methods, fragment):
    with pytest.raises(ValueError, match="qwen-1m: ") as info:
        export_qwen1m(load(tmp_path, rows, methods=methods))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_cli_qwen1m_refusal_and_existing_out_write_nothing(tmp_path):
    art = make_artifact(tmp_path / "A")  # the default mix holds A-shape heads
    out = tmp_path / "sparse_attention_config.json"
    result = run("export", art, "--format", "qwen-1m", "--out", out)
    assert result.exit_code == 2 and "ashape" in result.stderr and not out.exists()
    good = make_artifact(tmp_path / "B", mix_rows(VS_DENSE))
    out.write_text("old")
    result = run("export", good, "--format", "qwen-1m", "--out", out)
    assert result.exit_code == 2 and "--overwrite" in result.stderr and out.read_text() == "old"
    result = run("export", good, "--format", "qwen-1m", "--out", out, "--overwrite", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["dual_chunk_attention_config"] == {"sparse_attention_enabled": True, "sparse_attention_last_q": 64}
    assert "LlamaForCausalLM" in payload["note"]  # the dual-chunk backends serve Qwen2/Qwen3 only
    assert json.loads(out.read_text())[0]["0"][0] == "vertical_and_slash"


# ------------------------------------------------------------------------------------------ flashprefill


def test_flashprefill_flag_line_is_the_probed_start_layer(tmp_path):
    art = load(tmp_path, mix_rows(), methods=TRI)
    assert flag_line(art) == f"{FLAG} 1" and start_layer(art) == 1
    out = tmp_path / "flags.txt"
    result = run("export", art.path, "--format", "flashprefill", "--out", out)
    assert result.exit_code == 0, result.output
    assert parse_flag_line(out.read_text(), "flags.txt") == 1
    assert f"server flag: {FLAG} 1" in result.stderr


def test_flashprefill_refuses_an_artifact_without_a_start_layer(tmp_path):
    art = make_artifact(tmp_path / "A")
    out = tmp_path / "flags.txt"
    result = run("export", art, "--format", "flashprefill", "--out", out)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "no probed start layer" in lines[0] and not out.exists()


# ------------------------------------------------------------------------------------------ check-export


def levels(findings):
    return [f.level for f in findings].count("problem"), [f.level for f in findings].count("note")


def test_check_real_qwen_1m_file_passes_with_its_72_rereads(qwen_dir):
    info = resolve_model_info(str(qwen_dir))
    findings = check_file(CONFIGS / QWEN_FILE, "qwen-1m", info, tp=4)
    assert levels(findings) == (0, 72)
    assert all("vertical size 30 is read as 130" in f.text for f in findings)
    assert levels(check_file(CONFIGS / QWEN_FILE, "minference", info)) == (0, 0)
    bad_tp = check_file(CONFIGS / QWEN_FILE, "qwen-1m", info, tp=3)
    assert [f.text for f in bad_tp if f.level == "problem"] == [
        "--tp 3 does not divide the model's 28 query heads", "--tp 3 and the model's 4 KV heads: neither divides the other"]


def test_check_real_llama_file_passes_minference_but_not_the_qwen_engines(llama_dir):
    info = resolve_model_info(str(llama_dir))
    assert levels(check_file(CONFIGS / LLAMA_FILE, "minference", info)) == (0, 0)
    problems = [f.text for f in check_file(CONFIGS / LLAMA_FILE, "qwen-1m", info) if f.level == "problem"]
    assert problems == [f"model {info.id} is LlamaForCausalLM; the dual-chunk backends serve Qwen2/Qwen3 models only"]


def test_check_a_file_for_another_model_fails(qwen_dir):
    problems = [f.text for f in check_file(CONFIGS / LLAMA_FILE, "minference", resolve_model_info(str(qwen_dir)))]
    assert problems[0].startswith("the file has 32 layers, model") and any("out of range [0, 28)" in p for p in problems)


def test_check_our_exports(tmp_path, tiny_dir):
    info = resolve_model_info(str(tiny_dir))
    art = make_artifact(tmp_path / "A")
    assert run("export", art, "--format", "minference", "--out", tmp_path / "m.json").exit_code == 0
    assert levels(check_file(tmp_path / "m.json", "minference", info)) == (0, 0)
    # The MInference export itself is no qwen-1m file: A-shape and block top-k types, 2**30 slash sizes.
    texts = [f.text for f in check_file(tmp_path / "m.json", "qwen-1m", info) if f.level == "problem"]
    assert any("'stream_llm' fails the engines' assert" in t for t in texts)
    assert any("'block_sparse' fails" in t for t in texts)
    assert any("slash size 1073741824 exceeds the model's context (4096)" in t for t in texts)
    good = make_artifact(tmp_path / "B", mix_rows(VS_DENSE))
    assert run("export", good, "--format", "qwen-1m", "--out", tmp_path / "q.json").exit_code == 0
    assert [f.level for f in check_file(tmp_path / "q.json", "qwen-1m", info)] == ["problem"]  # Llama, not Qwen
    result = run("check-export", tmp_path / "q.json", "--format", "minference", "--model", tiny_dir)
    assert result.exit_code == 0 and "q.json as minference" in result.stderr and ": ok," in result.stderr


def test_check_broken_files_one_line_per_problem(tmp_path, qwen_dir):
    config = json.loads((CONFIGS / QWEN_FILE).read_text())
    del config[3]["5"]
    config[4]["0"] = ["stream_llm", 64, 1024, 0.9]
    config[5]["1"] = ["vertical_and_slash", 4, 100, 0.9]
    config[6]["x"] = ["vertical_and_slash", 100, 100, 0.9]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(config))
    result = run("check-export", path, "--format", "qwen-1m", "--model", qwen_dir)
    problems = [line for line in result.stderr.splitlines() if line.startswith("problem:")]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert problems == [
        "problem: layer 6: head key 'x' is not a query-head index like '0'",
        "problem: layer 3: query heads 5 are missing (a KeyError in the engines)",
        "problem: layer 4 head 0: type 'stream_llm' fails the engines' assert (only 'vertical_and_slash' is accepted)",
        "problem: layer 5 head 1: size below 8 (4, 100) can overflow the engines' fallback path",
    ]


@pytest.mark.parametrize("text, fmt, fragment", [
    ("{not json", "qwen-1m", "not valid JSON"),
    ('{"0": []}', "minference", "expected a JSON list"),
    ("--flashprefill-full-attention-layers x", "flashprefill", "expected '--flashprefill-full-attention-layers N'"),
])
def test_check_malformed_file_is_one_line_exit_2(tmp_path, tiny_dir, text, fmt, fragment):
    path = tmp_path / "f.json"
    path.write_text(text)
    result = run("check-export", path, "--format", fmt, "--model", tiny_dir)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.output


def test_check_flashprefill_against_the_layer_count(tmp_path, tiny_dir):
    info = resolve_model_info(str(tiny_dir))
    path = tmp_path / "flags.txt"
    for n, expected in ((1, (0, 0)), (2, (0, 1)), (3, (1, 0))):
        path.write_text(f"{FLAG} {n}\n")
        assert levels(check_file(path, "flashprefill", info)) == expected


# ------------------------------------------------------------------------------------------ import


def test_import_minference_accepts_the_qwen_1m_file(tmp_path, qwen_dir):
    out = tmp_path / "imported"
    result = run("import-minference", CONFIGS / QWEN_FILE, "--model", qwen_dir, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["rows"] == 28 * 28 and payload["fallback_heads"] == 0
    heads = load_artifact(out).heads
    assert set(heads["pattern"]) == {"vertical_slash"}
