"""Writing and loading artifact directories: ``manifest.json`` + Parquet tables, atomic, hashed, validated.

Layout::

    ART/
      manifest.json     sorted keys, 2-space indent; ``files`` maps every table to its sha256
      heads.parquet     HEADS_SCHEMA, rows sorted by (layer, head, q_modality, k_modality)
      *.parquet         other tables (layers, nosa, spava) as the methods define them

Determinism: the same manifest and tables give byte-identical files (no timestamps inside Parquet, fixed
row order, fixed writer options, key-value metadata limited to the schema version and the table name;
the manifest's ``created`` is whatever the caller passed). Nothing here uses pickle.

Atomicity: everything is written into a temporary directory next to the target, then renamed into place;
a failure leaves no target and no temporary directory behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..files import fsync_dir, naming, write_bytes_synced
from ..json_input import read_json
from ..models.info import ModelInfo
from .columns import ADDED_COLUMNS, HEADS_SCHEMA
from .migrations import manifest_version, migrate
from .schema import SCHEMA_VERSION, ArtifactError, validate
from .tables import HEADS_FILE, check_heads, heads_records, heads_table

MANIFEST = "manifest.json"
TABLE_NAME = re.compile(r"^[a-z0-9_]+\.parquet$")
META_VERSION = b"sparsesearch.schema_version"
META_TABLE = b"sparsesearch.table"
# Fixed writer options: changing any of them changes the bytes of every artifact.
PARQUET_OPTIONS = dict(
    compression="zstd", compression_level=3, use_dictionary=True, write_statistics=True,
    version="2.6", data_page_version="1.0",
)


@dataclass
class Artifact:
    """A loaded, validated artifact: its directory, manifest (plain dict) and tables (pandas DataFrames)."""

    path: Path
    manifest: dict
    tables: dict = field(default_factory=dict)

    @property
    def heads(self):
        """heads.parquet as a DataFrame (nullable int columns read back as float with NaN for null)."""
        if HEADS_FILE not in self.tables:
            raise ArtifactError(f"{self.path}: the artifact has no {HEADS_FILE}")
        return self.tables[HEADS_FILE]

    @property
    def head_index_space(self) -> str:
        return self.manifest["head_index_space"]

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo.from_dict(self.manifest["model"])

    def head_rows(self) -> list[dict]:
        """heads.parquet as typed row dicts (ints as int, null as None), in stored order."""
        return heads_records(self.heads)


# --------------------------------------------------------------------------------------------- helpers


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n").encode()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def check_manifest(manifest: dict) -> None:
    """Schema validation plus the rules JSON Schema cannot say: valid time, GQA shape, table names."""
    validate(manifest)
    created = manifest["created"]
    try:
        datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise ArtifactError(f"manifest.json: created {created!r} is not a valid ISO-8601 time") from None
    model = manifest["model"]
    if model["num_heads"] % model["num_kv_heads"]:
        raise ArtifactError(
            f"manifest.json: model.num_heads ({model['num_heads']}) is not a multiple of model.num_kv_heads ({model['num_kv_heads']})"
        )
    _check_layer_types(model)
    for name in manifest["files"]:
        if not TABLE_NAME.match(name):
            raise ArtifactError(f"manifest.json: file name {name!r} is not a plain '<name>.parquet' (no paths)")
    for method, entry in manifest["methods"].items():
        if entry is not None and "table" in entry and entry["table"] not in manifest["files"]:
            raise ArtifactError(f"manifest.json: methods.{method}.table {entry['table']!r} is not listed in files")
    tri = manifest["methods"]["trianglemix"]
    if tri is not None:
        start = tri["start_layer"]
        if start is not None and start > model["num_layers"]:
            raise ArtifactError(f"manifest.json: methods.trianglemix.start_layer {start} is past the model's {model['num_layers']} layers")
        from sparsesearch.patterns.triangle import TriangleParams

        try:
            TriangleParams(sink=tri["sink"], window=tri["window"], last=tri["last"])
        except ValueError as exc:
            raise ArtifactError(f"manifest.json: methods.trianglemix: {exc}") from None


def _check_layer_types(model: dict) -> None:
    """A hybrid model section: one type per layer, and a window when any layer slides."""
    types = model.get("layer_types")
    if types is None:
        return
    if len(types) != model["num_layers"]:
        raise ArtifactError(f"manifest.json: model.layer_types has {len(types)} entries for {model['num_layers']} layers")
    if "sliding_attention" in types and model.get("sliding_window") is None:
        raise ArtifactError("manifest.json: model.layer_types has sliding layers but model.sliding_window is null")


def check_fits(manifest: dict, model: ModelInfo) -> None:
    """Raise ArtifactError when the artifact's model facts disagree with ``model`` (first mismatch named)."""
    recorded = manifest["model"]
    if recorded["architecture"] != model.architecture:
        raise ArtifactError(f"artifact is for architecture {recorded['architecture']}, model is {model.architecture}")
    for key, noun in (("num_layers", "layers"), ("num_heads", "query heads"), ("num_kv_heads", "KV heads"), ("head_dim", "head_dim")):
        have, want = recorded[key], getattr(model, key)
        if have != want:
            if key == "head_dim":
                raise ArtifactError(f"artifact is for head_dim {have}, model has head_dim {want}")
            raise ArtifactError(f"artifact is for {have} {noun}, model has {want}")
    have_sliding = [i for i, t in enumerate(recorded.get("layer_types") or []) if t == "sliding_attention"]
    if have_sliding != list(model.sliding_layers) or (have_sliding and recorded.get("sliding_window") != model.sliding_window):
        raise ArtifactError(
            f"artifact is for sliding-window layers {have_sliding or 'none'} (window {recorded.get('sliding_window')}), "
            f"model has {list(model.sliding_layers) or 'none'} (window {model.sliding_window})"
        )


def _table_bytes(table: pa.Table, name: str, version: int = SCHEMA_VERSION) -> bytes:
    table = table.replace_schema_metadata({META_VERSION: str(version).encode(), META_TABLE: name.encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **PARQUET_OPTIONS)
    return sink.getvalue().to_pybytes()


def _other_table(frame, name: str) -> pa.Table:
    try:
        table = pa.Table.from_pandas(frame, preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise ArtifactError(f"{name}: cannot convert the table to Arrow: {_one_line(exc)}") from None
    return table.replace_schema_metadata(None)


def _same_artifact(target: Path, manifest: dict, blobs: dict[str, bytes]) -> bool:
    """True when ``target`` already holds these tables and this manifest (``created`` aside)."""
    try:
        existing = json.loads((target / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(existing, dict):
        return False
    strip = lambda m: {k: v for k, v in m.items() if k != "created"}  # noqa: E731
    if strip(existing) != strip(manifest):
        return False
    names = {p.name for p in target.iterdir()} - {MANIFEST}
    if names != set(blobs):
        return False
    return all((target / name).read_bytes() == data for name, data in blobs.items())


# ----------------------------------------------------------------------------------------------- write


def write_artifact(path, manifest: dict, tables: dict, *, overwrite: bool = False) -> Path:
    """Validate and write an artifact directory atomically; return its path.

    manifest: complete except ``files`` (see ``new_manifest``); tables: {"heads.parquet": DataFrame or list
    of row dicts, other "<name>.parquet": DataFrame}. ``files`` is (re)computed from the bytes written.
    An existing identical artifact (``created`` aside) is left as it is; a different one is refused with
    FileExistsError unless ``overwrite``. Every input problem raises ArtifactError before anything is written.
    """
    target = Path(path)
    manifest = dict(manifest)
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"write_artifact writes schema_version {SCHEMA_VERSION}, manifest says {manifest.get('schema_version')!r}")
    if not tables:
        raise ArtifactError("an artifact needs at least one table")
    blobs: dict[str, bytes] = {}
    head_rows = None
    for name in sorted(tables):
        if not isinstance(name, str) or not TABLE_NAME.match(name):
            raise ArtifactError(f"table name {name!r} must be a plain '<name>.parquet' (lowercase, digits, '_')")
        if name == HEADS_FILE:
            records = heads_records(tables[name])
            table = heads_table(records)
            head_rows = records
        else:
            table = _other_table(tables[name], name)
        blobs[name] = _table_bytes(table, name)
    manifest["files"] = {name: sha256_bytes(data) for name, data in sorted(blobs.items())}
    check_manifest(manifest)
    if head_rows is not None:
        check_heads(head_rows, manifest)
    payload = manifest_bytes(manifest)

    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; choose another path for the artifact")
    if target.is_dir() and any(target.iterdir()):
        if not (target / MANIFEST).is_file():
            raise FileExistsError(f"{target} is a non-empty directory without {MANIFEST}; refusing to replace it")
        if _same_artifact(target, manifest, blobs):
            return target
        if not overwrite:
            raise FileExistsError(f"{target} already holds a different artifact; pass overwrite=True (--overwrite) to replace it")

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as exc:
        raise naming(target, exc) from None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the artifact gets the usual permissions
        for name, data in blobs.items():
            write_bytes_synced(tmp / name, data)
        write_bytes_synced(tmp / MANIFEST, payload)
        fsync_dir(tmp)  # the files' names, as their bytes, are on disk before the directory is renamed in
        _swap_in(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):  # it names our temporary (or nothing, on a full disk): name the artifact
            raise naming(target, exc) from None
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _swap_in(tmp: Path, target: Path) -> None:
    """Move the finished directory into place; an existing target is moved aside first and removed after."""
    if target.is_dir() and any(target.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rmdir(old)
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        if target.is_dir():
            os.rmdir(target)  # empty directory: take its place
        os.rename(tmp, target)
    fsync_dir(target.parent)  # the rename survives a crash


# ------------------------------------------------------------------------------------------------ load


def read_manifest(path) -> dict:
    """manifest.json of an artifact directory, parsed and migrated but not yet validated."""
    root = Path(path)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}: the path does not exist")
    if not root.is_dir():
        raise ArtifactError(f"{root} is not an artifact directory (it is a file)")
    file = root / MANIFEST
    if not file.is_file():
        raise ArtifactError(f"{root} has no {MANIFEST}; not a sparsesearch artifact")
    try:  # strict JSON: bad UTF-8, NaN, repeated keys, deep nesting, a huge file are one line (json_input)
        return read_json(file)
    except ValueError as exc:
        raise ArtifactError(str(exc)) from None


def load_artifact(path, *, model_info: ModelInfo | None = None) -> Artifact:
    """Load and validate an artifact directory; raise ArtifactError (one line) on the first problem.

    Checks: manifest JSON and schema (after migrating older versions; newer ones are refused), every file's
    sha256, each Parquet file's schema version, heads.parquet's columns and types and every row's values
    (layer and head ranges, modality names, pattern, params, boundary, block sizes), and with
    ``model_info`` that the artifact fits the model (architecture, layers, heads, KV heads, head_dim).
    """
    root = Path(path)
    raw = read_manifest(root)
    stored_version = manifest_version(raw)
    manifest = migrate(raw)
    check_manifest(manifest)
    tables = {}
    for name, digest in sorted(manifest["files"].items()):
        file = root / name
        if not file.is_file():
            raise ArtifactError(f"{root}: {name} is listed in manifest.json but missing")
        actual = sha256_file(file)
        if actual != digest:
            raise ArtifactError(
                f"{root}: {name} sha256 {actual[:12]}... does not match manifest.json ({digest[:12]}...); the file was changed or damaged"
            )
        _check_table_size(file, root, name)
        try:
            table = pq.read_table(file)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ArtifactError(f"{root}: {name} is not a readable Parquet file ({_one_line(exc)})") from None
        meta = table.schema.metadata or {}
        version = meta.get(META_VERSION)
        if version != str(stored_version).encode():
            shown = version.decode(errors="replace") if version is not None else "none"
            raise ArtifactError(f"{root}: {name} has schema version {shown} in its Parquet metadata, manifest.json has {stored_version}")
        table = table.replace_schema_metadata(None)
        if name == HEADS_FILE:
            table = _with_added_columns(table)
            _check_heads_schema(table, root)
            _check_no_nan(table, root)
            records = heads_records(table.to_pylist(), where=f"{root}: {HEADS_FILE}")
            check_heads(records, manifest)
        tables[name] = table.to_pandas()
    if model_info is not None:
        check_fits(manifest, model_info)
    return Artifact(root, manifest, tables)


def _with_added_columns(table: pa.Table) -> pa.Table:
    """heads.parquet with each of ADDED_COLUMNS it predates appended as all-null (written before it existed),
    the columns in HEADS_SCHEMA's order (a file may lack one added column and hold a later one)."""
    for name in ADDED_COLUMNS:
        if name not in table.column_names:
            typ = HEADS_SCHEMA.field(name).type
            table = table.append_column(pa.field(name, typ, nullable=True), pa.nulls(table.num_rows, type=typ))
    known = [f.name for f in HEADS_SCHEMA if f.name in table.column_names]
    return table.select(known + [name for name in table.column_names if name not in known])


def _check_table_size(file: Path, root: Path, name: str) -> None:
    """Refuse, from its footer and before it is read, a table that would not fit in memory once decompressed: a
    few kilobytes of zstd can hold gigabytes of zeros. Reading takes about three copies (Arrow, rows, pandas)."""
    from ..memory import fits_memory, human

    try:
        meta = pq.read_metadata(file)
    except (pa.ArrowException, OSError, ValueError):
        return  # not a Parquet footer: read_table says so in its own line
    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    fits_memory(f"{root}: {name} ({meta.num_rows} rows, {human(size)} uncompressed)", 3 * size)


def _check_no_nan(table: pa.Table, root: Path) -> None:
    """Refuse a NaN in heads.parquet's float columns. Our writer stores a missing measurement as null (pandas'
    NaN becomes null on the way in), so a NaN was written by something else, and reading it as null would
    turn a broken measurement into an unmeasured one without a word."""
    import pyarrow.compute as pc

    for f in table.schema:
        if pa.types.is_floating(f.type) and pc.any(pc.is_nan(table.column(f.name))).as_py():
            raise ArtifactError(f"{root}: {HEADS_FILE} column {f.name} holds NaN; a missing value is null")


def _check_heads_schema(table: pa.Table, root: Path) -> None:
    have = {f.name: f.type for f in table.schema}
    for f in HEADS_SCHEMA:
        if f.name not in have:
            raise ArtifactError(f"{root}: {HEADS_FILE} lacks column {f.name}")
        if have[f.name] != f.type:
            raise ArtifactError(f"{root}: {HEADS_FILE} column {f.name} has type {have[f.name]}, expected {f.type}")
    extra = sorted(set(have) - {f.name for f in HEADS_SCHEMA})
    if extra:
        raise ArtifactError(f"{root}: {HEADS_FILE} has unknown column(s) {extra}")
    for f in HEADS_SCHEMA:
        if not f.nullable and table.column(f.name).null_count:
            raise ArtifactError(f"{root}: {HEADS_FILE} column {f.name} has nulls")
