"""Plain JSON dump of an artifact for people and pipes: ``{"manifest": ..., "heads": [rows], "tables": {...}}``.

``heads`` holds heads.parquet rows as objects with every column (null where unset), ints as ints;
``tables`` holds every other table's rows. A hybrid model's dump also has ``sliding_layers``
({"layers", "window", "rows"}): the layers whose rows are the model's own window, not a searched choice
(the manifest's model.layer_types says the same per layer). Not an interchange format: load artifacts with
``load_artifact``, which checks what this dump does not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa

from ..artifacts.io import Artifact
from ..artifacts.tables import HEADS_FILE
from ._common import write_file_atomic


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def export_json(artifact: Artifact) -> dict:
    out = {"manifest": artifact.manifest, "heads": artifact.head_rows() if HEADS_FILE in artifact.tables else [], "tables": {}}
    model = artifact.manifest["model"]
    sliding = [i for i, t in enumerate(model.get("layer_types") or []) if t == "sliding_attention"]
    if sliding:
        out["sliding_layers"] = {"layers": sliding, "window": model["sliding_window"],
                                 "rows": "the model's own sliding window (ashape sink 0, local = window), not searched"}
    for name, frame in sorted(artifact.tables.items()):
        if name != HEADS_FILE:
            out["tables"][name] = pa.Table.from_pandas(frame, preserve_index=False).to_pylist()
    return _clean(out)


def json_text(payload: dict) -> str:
    return json.dumps(payload, indent=2, sort_keys=False, default=str, allow_nan=False) + "\n"


def write_json(artifact: Artifact, out) -> Path:
    return write_file_atomic(out, json_text(export_json(artifact)).encode())
