"""heads.parquet rows: normalising (DataFrame or dicts -> typed Python values), checking, ordering, and
the query/KV head-space conversion the exporters share.

Rows are plain dicts keyed by ``HEADS_SCHEMA`` column names with Python values (None for null). Every
check raises ArtifactError with one line naming the row (layer, head, modalities) and the bad value.
"""

from __future__ import annotations

import math
from dataclasses import fields
from numbers import Integral, Real

import pyarrow as pa

from ..index import BLOCK_SIZES
from .columns import ALL_MODALITIES, BOUNDARIES, HEADS_KEY, HEADS_SCHEMA, PARAM_COLUMNS, check_window_rows, params_from_row
from .schema import ArtifactError

HEADS_FILE = "heads.parquet"
MEASURED = ("density", "recall", "output_error", "latency_ms")  # non-negative when present
INT32 = (-(2**31), 2**31 - 1)


def _is_null(value) -> bool:
    if value is None:
        return True
    try:
        import pandas as pd

        if value is pd.NA or value is pd.NaT:
            return True
    except ImportError:  # pragma: no cover - pandas is a dependency
        pass
    return isinstance(value, float) and math.isnan(value)


def _coerce(value, typ: pa.DataType, where: str, name: str):
    if _is_null(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy scalar -> Python
    if typ == pa.int32():
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ArtifactError(f"{where}: {name} must be an integer, got {value!r}")
        if not isinstance(value, Integral):
            if not float(value).is_integer():
                raise ArtifactError(f"{where}: {name} must be an integer, got {value!r}")
            value = int(value)
        if not INT32[0] <= value <= INT32[1]:
            raise ArtifactError(f"{where}: {name} {value} does not fit int32")
        return int(value)
    if typ == pa.bool_():
        if not isinstance(value, bool):
            raise ArtifactError(f"{where}: {name} must be true/false, got {value!r}")
        return value
    if typ == pa.float64():
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ArtifactError(f"{where}: {name} must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ArtifactError(f"{where}: {name} must be finite, got {value!r}")
        return float(value)
    if typ == pa.string():
        if not isinstance(value, str):
            raise ArtifactError(f"{where}: {name} must be a string, got {value!r}")
        return value
    raise ArtifactError(f"{where}: column {name} has unsupported type {typ}")  # pragma: no cover


def heads_records(data, *, where: str = HEADS_FILE) -> list[dict]:
    """Typed row dicts (every HEADS_SCHEMA column, None for null) from a DataFrame or an iterable of dicts.

    Missing nullable columns become null; unknown columns and nulls in required columns are errors.
    """
    try:
        import pandas as pd

        if isinstance(data, pd.DataFrame):
            data = data.to_dict("records")
    except ImportError:  # pragma: no cover
        pass
    known = [f.name for f in HEADS_SCHEMA]
    out = []
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ArtifactError(f"{where}: row {i} must be a mapping of column -> value, got {type(row).__name__}")
        unknown = sorted(set(row) - set(known))
        if unknown:
            raise ArtifactError(f"{where}: unknown column(s) {unknown} (known: {known})")
        clean = {}
        for field in HEADS_SCHEMA:
            value = _coerce(row.get(field.name), field.type, f"{where} row {i}", field.name)
            if value is None and not field.nullable:
                raise ArtifactError(f"{where} row {i}: required column {field.name} is missing or null")
            clean[field.name] = value
        out.append(clean)
    return out


def sort_key(row: dict) -> tuple:
    return tuple(row[name] for name in HEADS_KEY)


def row_name(row: dict) -> str:
    return f"layer {row['layer']}, head {row['head']}, {row['q_modality']}->{row['k_modality']}"


def heads_table(records: list[dict]) -> pa.Table:
    """Arrow table with exactly HEADS_SCHEMA (no metadata), rows sorted by (layer, head, q_modality, k_modality)."""
    ordered = sorted(records, key=sort_key)
    arrays = [pa.array([r[f.name] for r in ordered], type=f.type) for f in HEADS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=HEADS_SCHEMA)


def heads_frame(rows):
    """pandas DataFrame of rows (dicts, missing nullable columns allowed) in HEADS_SCHEMA column and row
    order; nullable int columns read back as float with NaN for null, as from a loaded artifact."""
    return heads_table(heads_records(rows)).to_pandas()


def heads_space_size(manifest: dict) -> int:
    model = manifest["model"]
    return model["num_heads"] if manifest["head_index_space"] == "query" else model["num_kv_heads"]


def check_heads(records: list[dict], manifest: dict, *, where: str = HEADS_FILE) -> None:
    """Check every row against the manifest: ranges, modality names, boundary, block sizes, pattern and
    params (via params_from_row), the tie's pattern, parameter columns the pattern does not have, measured values, repeats,
    and on a hybrid model's sliding layers that every row is the model's window (columns.check_window_rows)."""
    from sparsesearch.patterns import PARAMS

    model = manifest["model"]
    layers, space = model["num_layers"], manifest["head_index_space"]
    heads = heads_space_size(manifest)
    modalities = {ALL_MODALITIES, *manifest["modalities"]["names"]}
    param_names = {name: {f.name for f in fields(cls)} for name, cls in PARAMS.items()}
    checked: set[tuple] = set()
    seen: set[tuple] = set()
    for i, row in enumerate(records):
        at = f"{where} row {i} ({row_name(row)})"
        if not 0 <= row["layer"] < layers:
            raise ArtifactError(f"{at}: layer {row['layer']} out of range [0, {layers}) for a model with {layers} layers")
        if not 0 <= row["head"] < heads:
            kind = "query" if space == "query" else "KV"
            raise ArtifactError(f"{at}: head {row['head']} out of range [0, {heads}) ({kind} heads of the model)")
        for column in ("q_modality", "k_modality"):
            if row[column] not in modalities:
                raise ArtifactError(f"{at}: {column} {row[column]!r} is not 'all' or a modality of the manifest {sorted(modalities - {ALL_MODALITIES})}")
        if row["boundary"] not in BOUNDARIES:
            raise ArtifactError(f"{at}: boundary must be one of {list(BOUNDARIES)}, got {row['boundary']!r}")
        for column in ("block_m", "block_n"):
            if row[column] not in BLOCK_SIZES:
                raise ArtifactError(f"{at}: {column} must be one of {list(BLOCK_SIZES)}, got {row[column]}")
        pattern = row["pattern"]
        if pattern not in PARAMS:
            raise ArtifactError(f"{at}: unknown pattern {pattern!r} (known: {sorted(PARAMS)})")
        if row["tie"] is not None and (row["tie"] not in PARAMS or row["tie"] == pattern):
            raise ArtifactError(f"{at}: tie must name a known pattern other than the row's {pattern!r}, got {row['tie']!r}")
        stray = [c for c in PARAM_COLUMNS if row[c] is not None and c not in param_names[pattern]]
        if stray:
            raise ArtifactError(f"{at}: column(s) {stray} set, but pattern {pattern} has no such parameter")
        signature = (pattern, *(row[c] for c in PARAM_COLUMNS))
        if signature not in checked:
            try:
                params_from_row(row)
            except (ValueError, TypeError) as exc:
                raise ArtifactError(f"{at}: invalid {pattern} parameters: {exc}") from None
            checked.add(signature)
        for column in MEASURED:
            if row[column] is not None and row[column] < 0:
                raise ArtifactError(f"{at}: {column} must be >= 0, got {row[column]}")
        if row["density"] is not None and row["density"] > 1 + 1e-9:
            raise ArtifactError(f"{at}: density must be <= 1, got {row['density']}")
        key = sort_key(row)
        if key in seen:
            raise ArtifactError(f"{at}: repeated row (one row per layer, head and modality pair)")
        seen.add(key)
    try:
        check_window_rows(records, model.get("layer_types"), model.get("sliding_window"))
    except ArtifactError as exc:
        raise ArtifactError(f"{where}: {exc}") from None


def to_query_heads(records: list[dict], manifest: dict) -> list[dict]:
    """Rows in query-head space: a KV-space row is copied to every query head of its GQA group."""
    if manifest["head_index_space"] == "query":
        return [dict(r) for r in records]
    model = manifest["model"]
    group = model["num_heads"] // model["num_kv_heads"]
    out = []
    for row in records:
        for g in range(group):
            out.append(dict(row, head=row["head"] * group + g))
    return sorted(out, key=sort_key)
