"""qwen-1m --convert (issue P14 §1): each kind's closest vertical-slash form, the converted file read back, the
measurement on a tiny random model end to end, and bad input refused before any weights load."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sparsesearch.models
from artifact_fixtures import TINY, make_artifact, manifest, mix_rows, row
from cli.app import app
from sparsesearch.artifacts import load_artifact, write_artifact
from sparsesearch.artifacts.manifest import new_manifest
from sparsesearch.export.convert import closest_params, convert_qwen1m, reimport
from sparsesearch.export.minference import VS_FIXED
from sparsesearch.export.qwen1m import export_qwen1m

runner = CliRunner()
MODEL = TINY.to_dict()  # the manifest's model block of the TINY artifacts: context 4096, no sliding layers
TRI = {"trianglemix": {"start_layer": 1, "sink": 4, "window": 64, "last": 16}}
TOKENS = 256  # held-out prompt length of the measured tests: every pattern below is sparse there


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def sizes(params) -> tuple[int, int]:
    assert {k: getattr(params, k) for k in VS_FIXED} == VS_FIXED  # always the engines' estimate
    return params.vertical_size, params.slash_size


def lines_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ the mapping


@pytest.mark.parametrize("head, expected", [
    (row(0, 0, "ashape", dict(sink=128, local=1024)), (128, 1024)),  # sink columns, window diagonals
    (row(0, 0, "ashape", dict(sink=0, local=512)), (8, 512)),  # below 8 can overflow the engines
    (row(0, 0, "ashape", dict(sink=30, local=64)), (31, 64)),  # 30 would be read as 130
    (row(0, 0, "ashape", dict(sink=64, local=8192)), (64, 4096)),  # past the context nothing is left to cover
    (row(0, 0, "triangle", dict(sink=8, window=512, last=128)), (8, 512)),  # the dense last rows are lost
    (row(0, 0, "block_topk", dict(k_blocks=4, sink_blocks=1)), (320, 64)),  # (1 + 4) blocks of 64 keys per row
    (row(0, 0, "block_topk", dict(k_blocks=2, sink_blocks=0), block_m=128, block_n=64), (128, 128)),
    (row(0, 0, "vertical_slash", dict(vertical_size=30, slash_size=4, last_q=32, force_slash=8)), (31, 8)),
])
def test_each_kind_maps_to_its_closest_vertical_slash_sizes(head, expected):
    assert sizes(closest_params(head, MODEL)) == expected


@pytest.mark.parametrize("head, model, fragment", [
    (row(0, 1, "grid", dict(stride=64, local=128)), MODEL, "layer 0 head 1 (grid) has no vertical_and_slash form: its lines repeat every 64 tokens"),
    (row(1, 0, "ashape", dict(sink=0, local=48)), dict(MODEL, layer_types=["full_attention", "sliding_attention"]), "layer 1 head 0 (ashape) is on a sliding-window layer"),
])
def test_kinds_without_a_measurable_form_are_refused_with_the_head_and_reason(head, model, fragment):
    with pytest.raises(ValueError) as info:
        closest_params(head, model)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_without_convert_the_refusal_points_to_it_and_boundaries_stay_refused(tmp_path):
    art = load_artifact(make_artifact(tmp_path / "A"))  # the default mix holds A-shape and block top-k heads
    with pytest.raises(ValueError, match="--convert writes its closest form"):
        export_qwen1m(art)
    edge = load_artifact(make_artifact(tmp_path / "B", [row(0, 0, "ashape", dict(sink=4, local=64), boundary="k")]))
    with pytest.raises(ValueError, match="boundary 'k'; the format has no boundaries"):
        convert_qwen1m(edge)


# ------------------------------------------------------------------------------------------ the round trip


@pytest.mark.parametrize("space", ["query", "kv"])
def test_converted_file_reads_back_as_vertical_slash_heads_with_the_mapped_sizes(tmp_path, space):
    heads = TINY.num_heads if space == "query" else TINY.num_kv_heads
    m = manifest(space=space)
    m["methods"].update(TRI)  # layer 1 is a TriangleMix layer: triangle(4, 64, 16) in every head
    art = load_artifact(write_artifact(tmp_path / "art", m, {"heads.parquet": mix_rows(layers=1, heads=heads)}))
    converted = convert_qwen1m(art)
    group = TINY.num_heads // heads
    # Layer 0 of the mix: vertical-slash, A-shape, block top-k, dense by head (per KV head, repeated per group).
    per_layer0 = {"ashape": 1, "block_topk": 1} if space == "query" else {"ashape": group}
    assert converted.kinds == {**per_layer0, "triangle": TINY.num_heads}
    back = {(r["layer"], r["head"]): r for r in reimport(converted.text, TINY).head_rows()}
    assert len(back) == TINY.num_layers * TINY.num_heads
    want = {(1, h): (4 * 2, 64) for h in range(TINY.num_heads)}  # triangle: sink 4 -> 8, the window's 64 diagonals
    if space == "query":
        want |= {(0, 0): (1000, 6096), (0, 1): (128, 1024), (0, 2): (17 * 64, 64)}
    else:
        want |= {(0, h): (1000, 6096) for h in range(group)} | {(0, group + h): (128, 1024) for h in range(group)}
    for key, (vertical, slash) in want.items():
        assert back[key]["pattern"] == "vertical_slash", key
        assert (back[key]["vertical_size"], back[key]["slash_size"]) == (vertical, slash), key
        assert all(back[key][k] == v for k, v in VS_FIXED.items()), key
    assert {r["pattern"] for k, r in back.items() if k not in want} <= {"dense"}  # dense stays dense (every column)
    assert json.loads(converted.text)[1]["0"] == ["vertical_and_slash", 8, 64, None]


# ------------------------------------------------------------------------------------------ measured end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random Llama (2 query heads, 1 KV head) and its facts."""
    from sparsesearch.models import resolve_model_info
    from tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2, heads=2, kv_heads=1)
    return path, resolve_model_info(path)


def tiny_artifact(path: Path, info, rows: list[dict], methods: dict | None = None) -> Path:
    m = new_manifest(info, head_index_space="query", provenance={"kind": "manual", "source": "tests"},
                     methods=methods or {}, created="2025-01-01T00:00:00Z")
    return write_artifact(path, m, {"heads.parquet": rows})


def test_measured_conversion_writes_the_file_with_finite_kl_numbers(tmp_path, tiny):
    model_dir, info = tiny
    art = tiny_artifact(tmp_path / "art", info, [
        row(0, 0, "ashape", dict(sink=16, local=32)), row(0, 1, "block_topk", dict(k_blocks=1, sink_blocks=0)),
        row(1, 0, "vertical_slash", dict(vertical_size=64, slash_size=64)), row(1, 1, "dense"),
    ])
    out = tmp_path / "sparse_attention_config.json"
    result = run("export", art, "--format", "qwen-1m", "--convert", "--model", model_dir, "--tokens", TOKENS,
                 "--samples", 1, "--device", "cpu", "--max-kl-increase", 1, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    conv = json.loads(result.stdout)["conversion"]
    assert conv["converted_heads"] == {"ashape": 1, "block_topk": 1} and conv["query_heads"] == 4
    assert conv["samples"] == 1 and conv["tokens"] == TOKENS and conv["eval_data"] == "text:shakespeare"
    assert all(math.isfinite(conv[k]) for k in ("kl_artifact", "kl_converted", "kl_increase"))
    assert conv["kl_artifact"] > 0 and conv["kl_converted"] > 0  # the sparse runtime ran on both
    assert conv["kl_increase"] == pytest.approx(conv["kl_converted"] - conv["kl_artifact"], abs=2e-6)
    config = json.loads(out.read_text())
    assert config[0] == {"0": ["vertical_and_slash", 16, 32, None], "1": ["vertical_and_slash", 64, 64, None]}
    assert config[1]["0"] == ["vertical_and_slash", 64, 64, None]
    human = run("export", art, "--format", "qwen-1m", "--convert", "--model", model_dir, "--tokens", TOKENS,
                "--samples", 1, "--device", "cpu", "--max-kl-increase", 1, "--out", out, "--overwrite")
    assert human.exit_code == 0, human.output
    assert "converted 2 of 4 query heads to vertical_and_slash: ashape 1, block_topk 1" in human.stderr
    assert f"KL(dense||artifact) {conv['kl_artifact']:.6f}" in human.stderr  # the same prompts, the same numbers


def test_a_conversion_past_the_kl_limit_is_refused_and_writes_nothing(tmp_path, tiny):
    """TriangleMix from layer 0 with last >= the prompt: the artifact runs every layer dense (its KL is 0), while
    the closest vertical-slash form keeps 8 columns and 16 diagonals of 256 keys: the KL can only grow."""
    model_dir, info = tiny
    tri = {"trianglemix": {"start_layer": 0, "sink": 4, "window": 16, "last": 4096}}
    art = tiny_artifact(tmp_path / "art", info, [], methods=tri)
    out = tmp_path / "sparse_attention_config.json"
    result = run("export", art, "--format", "qwen-1m", "--convert", "--model", model_dir, "--tokens", TOKENS,
                 "--samples", 1, "--device", "cpu", "--max-kl-increase", 0, "--out", out)
    assert result.exit_code == 2, result.output
    last = lines_of(result.stderr)[-1]
    assert last.startswith("error: qwen-1m --convert: KL(dense||converted) ") and "KL(dense||artifact) " in last
    assert "> --max-kl-increase 0; nothing written" in last and not out.exists()
    numbers = [float(word.rstrip(",")) for word in last.split() if word.rstrip(",").replace(".", "").isdigit()]
    assert numbers[0] > numbers[1]  # converted above the artifact


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(sparsesearch.models, "load_model", refuse)


def config_model(path: Path, heads: int) -> Path:
    """A config-only Llama directory shaped like TINY but for its query heads (tokenizer in name only)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=128, hidden_size=heads * TINY.head_dim, intermediate_size=256, num_hidden_layers=TINY.num_layers,
                num_attention_heads=heads, num_key_value_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
                max_position_embeddings=TINY.max_position_embeddings).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.parametrize("extra, heads, fragment", [
    ([], None, "--format qwen-1m --convert needs --model"),
    (["--format", "minference"], TINY.num_heads, "--convert is for --format qwen-1m"),
    ([], 8, "artifact is for 4 query heads, model has 8"),  # a model of another shape: 8 query heads where the artifact's has 4
    (["--max-kl-increase", "-1"], TINY.num_heads, "--max-kl-increase must be a finite number >= 0"),
    (["--samples", "0"], TINY.num_heads, "--samples must be >= 1"),
])
def test_bad_convert_input_is_one_line_before_any_weights_load(tmp_path, no_loading, extra, heads, fragment):
    art = make_artifact(tmp_path / "A")
    out = tmp_path / "sparse_attention_config.json"
    args = ["export", art, "--convert", "--out", out, *extra]
    if "--format" not in extra:
        args += ["--format", "qwen-1m"]
    if heads is not None:
        args += ["--model", config_model(tmp_path / "model", heads)]
    result = run(*args)
    lines = lines_of(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert fragment in lines[0] and not out.exists()


def test_a_head_without_a_form_is_refused_before_any_weights_load(tmp_path, no_loading):
    art = make_artifact(tmp_path / "A", [row(0, 2, "grid", dict(stride=32, local=64))])
    out = tmp_path / "sparse_attention_config.json"
    result = run("export", art, "--format", "qwen-1m", "--convert", "--model", config_model(tmp_path / "m", TINY.num_heads), "--out", out)
    lines = lines_of(result.stderr)
    assert result.exit_code == 2 and len(lines) == 1 and "layer 0 head 2 (grid)" in lines[0] and not out.exists()
