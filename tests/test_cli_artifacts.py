"""CLI: inspect, validate, export, import-minference, diff through typer's CliRunner.

Bad input must end with exit code 2, one line on stderr, no traceback and nothing written. The model
resolver (sparsesearch.models.resolve_model_info) is replaced by a fake that knows the tiny model.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import sparsesearch.models as models
from artifact_fixtures import TINY, make_artifact, mix_rows, rehash, row
from sparsesearch.artifacts import load_artifact
from sparsesearch_cli.app import app

runner = CliRunner()
MODELS = {"tiny": TINY, "tiny-3-layers": replace(TINY, num_layers=3)}


@pytest.fixture(autouse=True)
def fake_models(monkeypatch):
    def resolve(spec, *, trust_remote_code=False):
        if spec not in MODELS:
            raise ValueError(f"unknown model {spec!r}")
        return MODELS[spec]

    monkeypatch.setattr(models, "resolve_model_info", resolve, raising=False)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_bad_input(result, expected: str):
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and expected in lines[0], lines[0]


def static_rows():
    mix = [("ashape", dict(sink=8, local=64)), ("dense", {}), ("triangle", dict(sink=4, window=32, last=16)), ("grid", dict(stride=8))]
    return [row(layer, head, *mix[head]) for layer in range(2) for head in range(4)]


# -------------------------------------------------------------------------------------------- inspect


def test_inspect_json_and_table(tmp_path):
    path = make_artifact(tmp_path / "art")
    result = run("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == 8 and summary["model"]["num_layers"] == 2
    assert summary["patterns"] == {"ashape": 2, "block_topk": 2, "dense": 2, "vertical_slash": 2}
    assert summary["layers"][0]["patterns"]["vertical_slash"] == 1
    assert summary["metrics"]["density"]["count"] == 8
    human = run("inspect", path)
    assert human.exit_code == 0 and "pattern mix per layer" in human.stdout


def test_inspect_shows_why_a_pick_is_not_the_best(tmp_path):
    rows = mix_rows()
    rows[2]["reason"] = "dense: the best admissible sparse candidate (ashape) has output error 0.8 > max_error 0.5"
    path = make_artifact(tmp_path / "art", rows)
    summary = json.loads(run("inspect", path, "--json").stdout)
    assert summary["reasons"] == [{"layer": rows[2]["layer"], "head": rows[2]["head"], "q_modality": "all", "k_modality": "all",
                                   "pattern": rows[2]["pattern"], "reason": rows[2]["reason"]}]
    human = run("inspect", path).stdout
    assert "not the head's best admissible sparse candidate (1)" in human
    assert "candidate (ashape) has output error" in human  # the reason cell (wrapped at 80 columns)
    assert "best admissible" not in run("inspect", make_artifact(tmp_path / "plain")).stdout


def test_inspect_shows_which_picks_tied_another_kind(tmp_path):
    """A pick that won on cost between equal objectives (heads.parquet ``tie``) is listed with the kind it
    tied, counted per layer, and absent where nothing tied."""
    rows = mix_rows()
    rows[0]["tie"], rows[0]["output_error"] = "ashape", 0.0004  # layer 0 head 0: vertical_slash
    path = make_artifact(tmp_path / "art", rows)
    summary = json.loads(run("inspect", path, "--json").stdout)
    assert summary["ties"] == [{"layer": 0, "head": 0, "q_modality": "all", "k_modality": "all", "pattern": "vertical_slash",
                                "tie": "ashape", "output_error": 0.0004}]
    assert [layer["ties"] for layer in summary["layers"]] == [1, 0]
    human = run("inspect", path).stdout
    assert "tied another kind and won on cost (1)" in human and "0.0004" in human
    plain = run("inspect", make_artifact(tmp_path / "plain")).stdout
    assert "tied" not in plain


# -------------------------------------------------------------------------------------------- validate


def test_validate_ok_and_with_model(tmp_path):
    path = make_artifact(tmp_path / "art")
    assert run("validate", path).exit_code == 0
    result = run("validate", path, "--model", "tiny", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
    assert_bad_input(run("validate", path, "--model", "tiny-3-layers"), "artifact is for 2 layers, model has 3")
    assert_bad_input(run("validate", path, "--model", "nope"), "unknown model 'nope'")


def corrupt(path, how):
    heads = path / "heads.parquet"
    if how == "truncated":
        heads.write_bytes(heads.read_bytes()[:64])
        rehash(path)
    elif how == "garbled":
        (path / "manifest.json").write_text("{not json")
    elif how == "version":
        data = json.loads((path / "manifest.json").read_text())
        data["schema_version"] = 7
        (path / "manifest.json").write_text(json.dumps(data))
    elif how == "missing":
        heads.unlink()
    elif how == "hash":
        data = json.loads((path / "manifest.json").read_text())
        data["files"]["heads.parquet"] = "f" * 64
        (path / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    "how, expected",
    [
        ("truncated", "is not a readable Parquet file"),
        ("garbled", "not valid JSON"),
        ("version", "artifact schema_version 7 is newer than this sparsesearch (1); upgrade sparsesearch"),
        ("missing", "heads.parquet is listed in manifest.json but missing"),
        ("hash", "does not match manifest.json"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "inspect", "export", "diff"])
def test_broken_artifacts_exit_2_with_one_line(tmp_path, how, expected, command):
    path = make_artifact(tmp_path / "art")
    corrupt(path, how)
    args = {
        "validate": ["validate", path],
        "inspect": ["inspect", path, "--json"],
        "export": ["export", path, "--format", "json", "--out", tmp_path / "out.json"],
        "diff": ["diff", path, path],
    }[command]
    result = run(*args)
    assert_bad_input(result, expected)
    assert result.stdout == ""
    assert not (tmp_path / "out.json").exists()


def test_head_out_of_range_and_missing_path(tmp_path):
    rows = mix_rows()
    rows[0]["head"] = 9
    from sparsesearch.artifacts import ArtifactError

    with pytest.raises(ArtifactError):
        make_artifact(tmp_path / "bad", rows)
    assert not (tmp_path / "bad").exists()
    assert_bad_input(run("validate", tmp_path / "nowhere"), "the path does not exist")


# ---------------------------------------------------------------------------------------------- export


def test_export_minference_duo_json(tmp_path):
    path = make_artifact(tmp_path / "art")
    result = run("export", path, "--format", "minference", "--out", tmp_path / "mi.json", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["format"] == "minference" and len(info["sha256"]) == 64
    assert len(json.loads((tmp_path / "mi.json").read_text())) == 2
    assert run("export", path, "--format", "duo", "--out", tmp_path / "duo.tsv").exit_code == 0
    assert (tmp_path / "duo.tsv").read_text().count("\n") == 2
    assert run("export", path, "--format", "json", "--out", tmp_path / "dump.json").exit_code == 0
    assert len(json.loads((tmp_path / "dump.json").read_text())["heads"]) == 8


def test_export_bad_input(tmp_path):
    path = make_artifact(tmp_path / "art")
    (tmp_path / "dir").mkdir()
    assert_bad_input(run("export", path, "--format", "duo", "--out", tmp_path / "dir"), "is a directory")
    assert_bad_input(run("export", path, "--format", "csv", "--out", tmp_path / "x"), "--format must be one of")
    tri = make_artifact(tmp_path / "tri", [row(0, 0, "triangle", dict(sink=4, window=64, last=16))])
    assert_bad_input(run("export", tri, "--format", "minference", "--out", tmp_path / "t.json"), "layer 0 head 0: pattern triangle")
    assert not (tmp_path / "t.json").exists()
    assert_bad_input(run("export", path, "--format", "flex", "--out", tmp_path / "f.safetensors"), "needs exactly one of --tokens")
    assert_bad_input(run("export", path, "--format", "flex", "--tokens", 256, "--out", tmp_path / "f.safetensors"),
                     "uses vertical_slash, which is estimated from Q and K")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "dir", "tri"]


def test_export_flex_static_and_with_qk(tmp_path):
    import torch
    from safetensors.torch import save_file

    from sparsesearch.export import block_mask_from_tensors, load_flex

    static = make_artifact(tmp_path / "static", static_rows())
    out = tmp_path / "static.safetensors"
    result = run("export", static, "--format", "flex", "--tokens", 200, "--block", 32, "--out", out)
    assert result.exit_code == 0, result.output
    layers = load_flex(out)
    assert set(layers) == {0, 1} and layers[0]["seq_lengths"].tolist() == [200, 200]
    assert block_mask_from_tensors(layers[1]).to_dense().shape[-2:] == (7, 7)

    dynamic = make_artifact(tmp_path / "dynamic")
    qk = {f"{name}.{layer}": torch.randn(1, heads, 96, 8) for layer in range(2) for name, heads in (("q", 4), ("k", 2))}
    save_file(qk, str(tmp_path / "qk.safetensors"))
    result = run("export", dynamic, "--format", "flex", "--qk", tmp_path / "qk.safetensors", "--block", 16, "--out", tmp_path / "dyn.safetensors")
    assert result.exit_code == 0, result.output
    assert load_flex(tmp_path / "dyn.safetensors")[0]["kv_num_blocks"].shape == (1, 4, 6)
    del qk["k.1"]
    save_file(qk, str(tmp_path / "qk2.safetensors"))
    assert_bad_input(run("export", dynamic, "--format", "flex", "--qk", tmp_path / "qk2.safetensors", "--out", tmp_path / "x.safetensors"),
                     "has no tensor 'k.1'")


# ------------------------------------------------------------------------------------- import-minference


def test_import_minference_then_validate(tmp_path):
    config = [{"0": ["vertical_and_slash", 3500, 100, 0.675], "1": ["stream_llm", 100, 800, 0.5]}, {}]
    file = tmp_path / "cfg.json"
    file.write_text(json.dumps(config))
    out = tmp_path / "imported"
    result = run("import-minference", file, "--model", "tiny", "--out", out, "--created", "2025-01-01T00:00:00Z", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["rows"] == 8 and info["fallback_heads"] == 6
    art = load_artifact(out, model_info=TINY)
    assert art.manifest["provenance"]["source"] == "cfg.json"
    before = (out / "heads.parquet").read_bytes()
    again = run("import-minference", file, "--model", "tiny", "--out", out, "--created", "2025-01-01T00:00:00Z")
    assert again.exit_code == 0 and (out / "heads.parquet").read_bytes() == before
    file.write_text(json.dumps([{"0": ["stream_llm", 1, 2, 0.5]}, {}]))
    assert_bad_input(run("import-minference", file, "--model", "tiny", "--out", out), "already holds a different artifact")
    assert run("import-minference", file, "--model", "tiny", "--out", out, "--overwrite").exit_code == 0


@pytest.mark.parametrize(
    "text, model, expected",
    [
        ("[{", "tiny", "not valid JSON"),
        ('[{}, {}]', "tiny-3-layers", "has 2 layers, model tiny-llama has 3"),
        ('[{"4": ["stream_llm", 1, 2, 0]}, {}]', "tiny", "layer 0 head 4 out of range [0, 4)"),
        ('[{"0": ["mystery", 1, 2, 0]}, {}]', "tiny", "unknown type 'mystery'"),
    ],
)
def test_import_minference_bad_input_writes_nothing(tmp_path, text, model, expected):
    file = tmp_path / "cfg.json"
    file.write_text(text)
    assert_bad_input(run("import-minference", file, "--model", model, "--out", tmp_path / "out"), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.json"]


def test_import_minference_missing_file(tmp_path):
    assert_bad_input(run("import-minference", tmp_path / "none.json", "--model", "tiny", "--out", tmp_path / "out"), "no such file")


# ------------------------------------------------------------------------------------------------ diff


def test_diff_reports_changes_and_exits_0(tmp_path):
    a = make_artifact(tmp_path / "a")
    same = run("diff", a, a, "--json")
    assert same.exit_code == 0
    payload = json.loads(same.stdout)
    assert payload["changed"] == [] and payload["same_rows"] == 8
    rows = mix_rows()
    rows[0].update(vertical_size=500)
    rows[1].update(density=0.9)
    rows = [r for r in rows if (r["layer"], r["head"]) != (1, 3)]
    b = make_artifact(tmp_path / "b", rows)
    result = run("diff", a, b, "--json")
    assert result.exit_code == 0
    payload = json.loads(result.stdout)
    assert payload["only_a"] == [{"layer": 1, "head": 3, "q_modality": "all", "k_modality": "all"}]
    changed = {(c["layer"], c["head"]): c for c in payload["changed"]}
    assert changed[(0, 0)]["fields"] == {"vertical_size": [1000, 500]}
    assert changed[(0, 1)]["density"] == [0.35, 0.9]
    human = run("diff", a, b)
    assert human.exit_code == 0 and "2 changed, 1 only in A" in human.stdout


def test_diff_across_head_spaces(tmp_path):
    q = make_artifact(tmp_path / "q", [row(l, h, "ashape") for l in range(2) for h in range(4)])
    kv = make_artifact(tmp_path / "kv", [row(l, h, "ashape" if h == 0 else "dense") for l in range(2) for h in range(2)], space="kv")
    payload = json.loads(run("diff", q, kv, "--json").stdout)
    assert payload["head_index_space"] == "query"
    assert sorted((c["layer"], c["head"]) for c in payload["changed"]) == [(0, 2), (0, 3), (1, 2), (1, 3)]


def test_every_artifact_command_has_an_example_in_its_help():
    for command in ("inspect", "validate", "export", "import-minference", "diff"):
        result = run(command, "--help")
        assert result.exit_code == 0 and "Example: sparsesearch " + command in result.stdout, command
