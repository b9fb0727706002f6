"""Artifact v1: schema, atomic deterministic writes, and one-line errors for every way a load can fail."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifact_fixtures import (
    CREATED, TINY, edit_manifest, make_artifact, manifest, mix_rows, rehash, rewrite_heads, row,
)
from sparsesearch.artifacts import (
    SCHEMA_VERSION, ArtifactError, heads_records, load_artifact, manifest_schema, migrate, new_manifest,
    validate, write_artifact,
)
from sparsesearch.artifacts import io as art_io
from sparsesearch.artifacts import migrations as migrate_mod
from sparsesearch.artifacts.schema import schema_bytes

REPO = Path(__file__).resolve().parents[1]


def one_line_error(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# ---------------------------------------------------------------------------------------------- schema


def test_top_level_schema_is_a_byte_identical_copy_of_the_package_schema():
    assert (REPO / "artifacts" / "schema" / "manifest.v1.json").read_bytes() == schema_bytes()
    schema = manifest_schema()
    assert schema["properties"]["schema_version"]["const"] == SCHEMA_VERSION


def test_validator_names_the_field_and_the_value():
    good = manifest()
    validate({**good, "files": {}})
    cases = [
        ({**good, "head_index_space": "both"}, "head_index_space must be one of"),
        ({**good, "extra": 1}, "unknown field 'extra'"),
        ({**good, "model": {**good["model"], "num_layers": "2"}}, "model.num_layers must be integer"),
        ({**good, "model": {**good["model"], "num_layers": True}}, "model.num_layers must be integer"),
        ({**good, "model": {**good["model"], "num_heads": 0}}, "model.num_heads must be >= 1"),
        ({**good, "created": "yesterday"}, "created does not match"),
        ({**good, "files": {"heads.parquet": "abc"}}, "files.heads.parquet does not match"),
        ({k: v for k, v in good.items() if k != "provenance"}, "provenance is missing"),
        ({**good, "provenance": {"kind": "stolen", "source": None, "sha256": None}}, "provenance.kind must be one of"),
        ({**good, "methods": {**good["methods"], "nosa": {"table": "../x.parquet"}}}, "methods.nosa.table does not match"),
        ({**good, "methods": {**good["methods"], "trianglemix": {"start_layer": 1, "sink": 8, "window": 0, "last": 1}}}, "methods.trianglemix.window must be >= 1"),
        ({**good, "methods": {**good["methods"], "trianglemix": {"start_layer": 1}}}, "methods.trianglemix.sink is missing"),
        ({**good, "calibration": {"source": "x", "sha256": None, "lengths": [0], "seed": 1}}, "calibration.lengths[0] must be >= 1"),
    ]
    for bad, expected in cases:
        with pytest.raises(ArtifactError) as info:
            validate(bad)
        assert expected in one_line_error(info), (expected, str(info.value))


def test_new_manifest_fills_every_v1_field():
    m = new_manifest(TINY, head_index_space="kv", provenance={"kind": "calibrated"})
    validate({**m, "files": {}})
    assert set(m["methods"]) == {"mminference", "trianglemix", "nosa", "spava"}
    assert m["modalities"]["names"] == {"text": 0}
    assert m["producer"]["name"] == "sparsesearch"
    assert m["created"].endswith("Z")
    vlm = replace(TINY, modality_token_ids={"video": [7], "image": [5, 6]})
    mods = new_manifest(vlm, head_index_space="query", provenance={"kind": "manual"})["modalities"]
    assert mods == {"names": {"text": 0, "image": 1, "video": 2}, "token_ids": {"image": [5, 6], "video": [7]}}
    with pytest.raises(ValueError, match="unknown method"):
        new_manifest(TINY, head_index_space="query", provenance={"kind": "manual"}, methods={"magic": None})


# ------------------------------------------------------------------------------------------ write/load


def test_write_load_round_trip(tmp_path):
    rows = mix_rows()
    path = make_artifact(tmp_path / "art", rows)
    art = load_artifact(path, model_info=TINY)
    assert sorted(p.name for p in path.iterdir()) == ["heads.parquet", "manifest.json"]
    assert art.manifest["files"]["heads.parquet"] == art_io.sha256_file(path / "heads.parquet")
    assert art.manifest["created"] == CREATED
    assert art.model_info == TINY
    assert art.head_index_space == "query"
    loaded = art.head_rows()
    assert loaded == sorted(heads_records(rows), key=lambda r: (r["layer"], r["head"]))
    assert list(art.heads.columns) == [f.name for f in art_io.HEADS_SCHEMA]
    meta = pq.read_table(path / "heads.parquet").schema.metadata
    assert meta[b"sparsesearch.schema_version"] == b"1"
    assert pq.read_table(path / "heads.parquet").schema.remove_metadata().equals(art_io.HEADS_SCHEMA)


def test_reason_round_trips_and_files_without_the_column_still_load(tmp_path):
    rows = mix_rows()
    rows[1]["reason"] = "no candidate within budget: the cheapest"
    path = make_artifact(tmp_path / "art", rows)
    loaded = {(r["layer"], r["head"]): r["reason"] for r in load_artifact(path).head_rows()}
    assert loaded[(rows[1]["layer"], rows[1]["head"])] == "no candidate within budget: the cheapest"
    assert sum(v is not None for v in loaded.values()) == 1
    # An artifact written before the column existed: heads.parquet without it loads with reason null.
    file = path / "heads.parquet"
    table = pq.read_table(file)
    old = table.drop_columns(["reason"]).replace_schema_metadata(table.schema.metadata)
    pq.write_table(old, file)
    rehash(path)
    assert "reason" not in pq.read_table(file).column_names
    art = load_artifact(path)
    assert list(art.heads.columns) == [f.name for f in art_io.HEADS_SCHEMA]
    assert all(r["reason"] is None for r in art.head_rows())


def test_tie_round_trips_is_checked_and_older_files_load_without_it(tmp_path):
    """heads.parquet ``tie`` (search/layer.py choose_head): written and read back; a file written before
    the column (the reference artifact predates it and ``reason``) loads with it null, in schema order;
    a tie must name a pattern other than the row's own."""
    rows = mix_rows()
    rows[0]["tie"] = "ashape"  # a vertical_slash pick that tied A-shape
    path = make_artifact(tmp_path / "art", rows)
    ties = {(r["layer"], r["head"]): r["tie"] for r in load_artifact(path).head_rows()}
    assert ties.pop((rows[0]["layer"], rows[0]["head"])) == "ashape" and set(ties.values()) == {None}
    file = path / "heads.parquet"
    table = pq.read_table(file)
    pq.write_table(table.drop_columns(["tie"]).replace_schema_metadata(table.schema.metadata), file)
    rehash(path)
    art = load_artifact(path)
    assert list(art.heads.columns) == [f.name for f in art_io.HEADS_SCHEMA]
    assert all(r["tie"] is None for r in art.head_rows())
    reference = load_artifact(Path(__file__).resolve().parents[1] / "artifacts" / "reference" / "smollm2-135m-4k")
    assert "tie" not in pq.read_table(reference.path / "heads.parquet").column_names
    assert list(reference.heads.columns) == [f.name for f in art_io.HEADS_SCHEMA]
    assert all(r["tie"] is None for r in reference.head_rows())
    for bad in ("vertical_slash", "magic"):  # its own pattern; no pattern
        rows[0]["tie"] = bad
        with pytest.raises(ArtifactError, match=f"tie must name a known pattern other than the row's 'vertical_slash', got '{bad}'"):
            make_artifact(tmp_path / bad, rows)


def test_loaded_frame_can_be_written_again_unchanged(tmp_path):
    first = make_artifact(tmp_path / "a")
    art = load_artifact(first)
    second = write_artifact(tmp_path / "b", art.manifest, art.tables)
    for name in ("manifest.json", "heads.parquet"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_same_inputs_give_byte_identical_files_whatever_the_row_order(tmp_path):
    rows = mix_rows()
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    a = make_artifact(tmp_path / "a", rows)
    b = make_artifact(tmp_path / "b", shuffled)
    for name in ("manifest.json", "heads.parquet"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_other_tables_are_hashed_and_versioned(tmp_path):
    import pandas as pd

    layers = pd.DataFrame({"layer": [0, 1], "grad_middle": [0.1, -0.2], "start": [False, True]})
    m = manifest()
    m["methods"]["trianglemix"] = {"table": "layers.parquet", "start_layer": 1, "sink": 8, "window": 512, "last": 128}
    path = write_artifact(tmp_path / "art", m, {"heads.parquet": mix_rows(), "layers.parquet": layers})
    art = load_artifact(path)
    assert set(art.manifest["files"]) == {"heads.parquet", "layers.parquet"}
    assert art.tables["layers.parquet"]["grad_middle"].tolist() == [0.1, -0.2]
    again = write_artifact(tmp_path / "again", m, {"heads.parquet": mix_rows(), "layers.parquet": layers})
    assert (again / "layers.parquet").read_bytes() == (path / "layers.parquet").read_bytes()


def test_existing_artifacts_are_kept_unless_overwrite(tmp_path):
    path = make_artifact(tmp_path / "art")
    before = (path / "heads.parquet").read_bytes()
    assert make_artifact(path) == path  # identical: nothing to do
    changed = mix_rows()
    changed[0]["score"] = 0.123
    with pytest.raises(FileExistsError, match="already holds a different artifact") as info:
        make_artifact(path, changed)
    assert "\n" not in str(info.value)
    assert (path / "heads.parquet").read_bytes() == before
    write_artifact(path, manifest(), {"heads.parquet": changed}, overwrite=True)
    assert load_artifact(path).head_rows()[0]["score"] == 0.123
    assert leftovers(tmp_path) == ["art"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="without manifest.json"):
        write_artifact(tmp_path / "plain", manifest(), {"heads.parquet": changed}, overwrite=True)
    (tmp_path / "empty").mkdir()
    make_artifact(tmp_path / "empty")
    assert (tmp_path / "empty" / "manifest.json").is_file()


@pytest.mark.parametrize("fail_at", ["write_bytes_synced", "_swap_in"])
def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch, fail_at):
    real = getattr(art_io, fail_at)
    calls = []

    def broken(*args):
        calls.append(args)
        if fail_at == "_swap_in" or len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(*args)

    monkeypatch.setattr(art_io, fail_at, broken)
    with pytest.raises(OSError, match="simulated"):
        make_artifact(tmp_path / "art")
    assert leftovers(tmp_path) == []


def test_failure_while_overwriting_keeps_the_old_artifact(tmp_path, monkeypatch):
    path = make_artifact(tmp_path / "art")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    real_rename = art_io.os.rename
    calls = []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old moved aside; moving the new one in fails
            raise OSError("rename failed (simulated)")
        return real_rename(src, dst)

    changed = mix_rows()
    changed[0]["score"] = 0.9
    monkeypatch.setattr(art_io.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        write_artifact(path, manifest(), {"heads.parquet": changed}, overwrite=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert leftovers(tmp_path) == ["art"]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda r: r[0].update(head=9), "head 9 out of range [0, 4)"),
        (lambda r: r[0].update(layer=2), "layer 2 out of range [0, 2)"),
        (lambda r: r[0].update(pattern="spiral"), "unknown pattern 'spiral'"),
        (lambda r: r[0].update(boundary="3d"), "boundary must be one of"),
        (lambda r: r[0].update(block_m=48), "block_m must be one of"),
        (lambda r: r[0].update(q_modality="audio"), "q_modality 'audio' is not 'all' or a modality"),
        (lambda r: r[0].update(vertical_size=0), "invalid vertical_slash parameters: vertical_size must be >= 1"),
        (lambda r: r[0].update(sink=5), "column(s) ['sink'] set, but pattern vertical_slash has no such parameter"),
        (lambda r: r[0].update(density=1.5), "density must be <= 1"),
        (lambda r: r[0].update(recall=-0.1), "recall must be >= 0"),
        (lambda r: r[0].update(layer=None), "required column layer is missing or null"),
        (lambda r: r[0].update(head="x"), "head must be an integer"),
        (lambda r: r[0].update(density=float("inf")), "density must be finite"),
        (lambda r: r[0].update(colour="red"), "unknown column(s) ['colour']"),
        (lambda r: r.append(dict(r[0])), "repeated row"),
    ],
)
def test_writer_refuses_bad_rows_before_writing(tmp_path, edit, expected):
    rows = mix_rows()
    edit(rows)
    with pytest.raises(ArtifactError) as info:
        make_artifact(tmp_path / "art", rows)
    assert expected in one_line_error(info)
    assert leftovers(tmp_path) == []


def test_writer_refuses_bad_manifests_and_table_names(tmp_path):
    with pytest.raises(ArtifactError, match="must be a plain"):
        write_artifact(tmp_path / "art", manifest(), {"../evil.parquet": mix_rows()})
    m = manifest()
    m["methods"]["nosa"] = {"table": "nosa.parquet"}
    with pytest.raises(ArtifactError, match="methods.nosa.table 'nosa.parquet' is not listed in files"):
        write_artifact(tmp_path / "art", m, {"heads.parquet": mix_rows()})
    with pytest.raises(ArtifactError, match="num_heads \\(4\\) is not a multiple of model.num_kv_heads \\(3\\)"):
        write_artifact(tmp_path / "art", {**manifest(), "model": {**manifest()["model"], "num_kv_heads": 3}}, {"heads.parquet": mix_rows()})
    m = manifest()
    m["methods"]["trianglemix"] = {"start_layer": 3, "sink": 8, "window": 512, "last": 128}
    with pytest.raises(ArtifactError, match="start_layer 3 is past the model's 2 layers"):
        write_artifact(tmp_path / "art", m, {"heads.parquet": mix_rows()})
    with pytest.raises(ArtifactError, match="writes schema_version 1"):
        write_artifact(tmp_path / "art", {**manifest(), "schema_version": 2}, {"heads.parquet": mix_rows()})
    assert leftovers(tmp_path) == []


def test_kv_space_rows_are_checked_against_kv_heads(tmp_path):
    rows = [r for r in mix_rows() if r["head"] < 2]
    path = make_artifact(tmp_path / "kv", rows, space="kv")
    assert load_artifact(path).head_index_space == "kv"
    with pytest.raises(ArtifactError, match=r"head 2 out of range \[0, 2\) \(KV heads"):
        make_artifact(tmp_path / "bad", mix_rows(), space="kv")


# ------------------------------------------------------------------------------------- load failures


def broken(tmp_path: Path, how: str) -> Path:
    path = make_artifact(tmp_path / "art")
    heads = path / "heads.parquet"
    if how == "truncated parquet":
        heads.write_bytes(heads.read_bytes()[:100])
        rehash(path)
    elif how == "truncated parquet, stale hash":
        heads.write_bytes(heads.read_bytes()[:100])
    elif how == "garbled json":
        (path / "manifest.json").write_text('{"schema_version": 1, "producer": ')
    elif how == "manifest is a list":
        (path / "manifest.json").write_text("[1, 2]")
    elif how == "newer schema":
        edit_manifest(path, schema_version=7)
    elif how == "schema version zero":
        edit_manifest(path, schema_version=0)
    elif how == "missing table":
        heads.unlink()
    elif how == "missing manifest":
        (path / "manifest.json").unlink()
    elif how == "hash mismatch":
        rewrite_heads(path, lambda rows: rows)
        data = json.loads((path / "manifest.json").read_text())
        data["files"]["heads.parquet"] = "0" * 64
        (path / "manifest.json").write_text(json.dumps(data))
    elif how == "head out of range":
        rewrite_heads(path, lambda rows: [dict(r, head=r["head"] + 4 * (i == 3)) for i, r in enumerate(rows)])
    elif how == "unknown pattern":
        rewrite_heads(path, lambda rows: [dict(r, pattern="spiral") for r in rows])
    elif how == "parquet version":
        rewrite_heads(path, lambda rows: rows, version=b"2")
    elif how == "wrong column type":
        table = pq.read_table(heads)
        table = table.set_column(table.schema.get_field_index("density"), "density", pa.array([str(x) for x in table.column("density").to_pylist()]))
        pq.write_table(table, heads)
        rehash(path)
    elif how == "missing field":
        data = json.loads((path / "manifest.json").read_text())
        del data["device"]
        (path / "manifest.json").write_text(json.dumps(data))
    elif how == "bad time":
        edit_manifest(path, created="2025-13-45T99:00:00Z")
    else:
        raise AssertionError(how)
    return path


LOAD_FAILURES = {
    "truncated parquet": "is not a readable Parquet file",
    "truncated parquet, stale hash": "does not match manifest.json",
    "garbled json": "manifest.json: not valid JSON",
    "manifest is a list": "manifest.json must hold a JSON object",
    "newer schema": "artifact schema_version 7 is newer than this sparsesearch (1); upgrade sparsesearch",
    "schema version zero": "schema_version must be a positive integer",
    "missing table": "heads.parquet is listed in manifest.json but missing",
    "missing manifest": "has no manifest.json",
    "hash mismatch": "heads.parquet sha256",
    "head out of range": "head 7 out of range [0, 4)",
    "unknown pattern": "unknown pattern 'spiral'",
    "parquet version": "has schema version 2 in its Parquet metadata, manifest.json has 1",
    "wrong column type": "column density has type string, expected double",
    "missing field": "manifest.json: device is missing",
    "bad time": "is not a valid ISO-8601 time",
}


@pytest.mark.parametrize("how", sorted(LOAD_FAILURES))
def test_load_failures_are_one_line_artifact_errors(tmp_path, how):
    path = broken(tmp_path, how)
    with pytest.raises(ArtifactError) as info:
        load_artifact(path)
    assert LOAD_FAILURES[how] in one_line_error(info)


def test_missing_path_and_file_path(tmp_path):
    with pytest.raises(ArtifactError, match="the path does not exist"):
        load_artifact(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="is not an artifact directory"):
        load_artifact(tmp_path / "file")


@pytest.mark.parametrize(
    "change, expected",
    [
        (dict(num_layers=3), "artifact is for 2 layers, model has 3"),
        (dict(num_heads=8), "artifact is for 4 query heads, model has 8"),
        (dict(num_kv_heads=4), "artifact is for 2 KV heads, model has 4"),
        (dict(head_dim=128), "artifact is for head_dim 64, model has head_dim 128"),
        (dict(architecture="Qwen2ForCausalLM"), "artifact is for architecture LlamaForCausalLM, model is Qwen2ForCausalLM"),
    ],
)
def test_artifact_for_another_model_is_refused_by_name(tmp_path, change, expected):
    path = make_artifact(tmp_path / "art")
    with pytest.raises(ArtifactError) as info:
        load_artifact(path, model_info=replace(TINY, **change))
    assert one_line_error(info) == expected
    load_artifact(path, model_info=replace(TINY, id="another-name", revision="x"))  # same shape: fits


# ------------------------------------------------------------------------------------------ migration


def test_migration_registry_steps_and_refusals(monkeypatch):
    assert migrate({"schema_version": 1, "x": 1}) == {"schema_version": 1, "x": 1}
    with pytest.raises(ArtifactError, match="schema_version 7 is newer than this sparsesearch \\(1\\); upgrade"):
        migrate({"schema_version": 7})
    with pytest.raises(ArtifactError, match="schema_version is missing"):
        migrate({})
    monkeypatch.setattr(migrate_mod, "SCHEMA_VERSION", 3)
    monkeypatch.setitem(migrate_mod.MIGRATIONS, 1, lambda m: {"renamed" if k == "old" else k: v for k, v in m.items()})
    with pytest.raises(ArtifactError, match="schema_version 2 is not supported \\(no migration to 3\\)"):
        migrate({"schema_version": 1, "old": 5})
    monkeypatch.setitem(migrate_mod.MIGRATIONS, 2, lambda m: {**m, "added": True})
    original = {"schema_version": 1, "old": 5}
    assert migrate(original) == {"schema_version": 3, "renamed": 5, "added": True}
    assert original == {"schema_version": 1, "old": 5}


def test_no_pickle_in_artifact_code():
    root = REPO / "sparsesearch"
    for folder in ("artifacts", "export"):
        for file in (root / folder).glob("*.py"):
            text = file.read_text()
            assert "import pickle" not in text and "allow_pickle=True" not in text, file


def test_row_helper_builds_valid_rows():
    assert row(0, 1, "ashape", dict(sink=4, local=8))["local"] == 8


def test_runtime_plan_reads_a_loaded_artifact(tmp_path):
    from sparsesearch.runtime.plan import build_plan

    m = manifest()
    m["methods"]["trianglemix"] = {"start_layer": 1, "sink": 8, "window": 512, "last": 128}
    art = load_artifact(write_artifact(tmp_path / "art", m, {"heads.parquet": mix_rows()}), model_info=TINY)
    plan = build_plan(art.manifest, art.heads, TINY)
    assert [layer.kind for layer in plan.layers] == ["sparse", "triangle"]
