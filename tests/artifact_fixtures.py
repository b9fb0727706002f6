"""Tiny artifacts for the artifact, export and CLI tests: a 2-layer model with 4 query and 2 KV heads."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sparsesearch.artifacts import new_manifest, row_from_params, sha256_file, write_artifact
from sparsesearch.artifacts.io import META_TABLE, META_VERSION, PARQUET_OPTIONS
from sparsesearch.models.info import ModelInfo
from sparsesearch.patterns import PARAMS

TINY = ModelInfo(
    id="tiny-llama", revision="0" * 40, architecture="LlamaForCausalLM", num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=64, dtype="bfloat16", rope="default", max_position_embeddings=4096,
)
CREATED = "2025-01-01T00:00:00Z"
PRODUCER = {"name": "sparsesearch", "version": "0.1.0", "git": None}

# (pattern, params) per head; the default mix covers every MInference-representable pattern.
MINFERENCE_MIX = [
    ("vertical_slash", dict(vertical_size=1000, slash_size=6096)),
    ("ashape", dict(sink=128, local=1024)),
    ("block_topk", dict(k_blocks=16, sink_blocks=1)),
    ("dense", dict()),
]


def row(layer: int, head: int, pattern: str, params: dict | None = None, **extra) -> dict:
    base = {
        "layer": layer, "head": head, "q_modality": "all", "k_modality": "all", "boundary": "none",
        "pattern": pattern, "block_m": 64, "block_n": 64,
        **row_from_params(PARAMS[pattern](**(params or {}))),
    }
    base.update(extra)
    return base


def mix_rows(mix=MINFERENCE_MIX, *, layers: int = 2, heads: int = 4, **extra) -> list[dict]:
    rows = []
    for layer in range(layers):
        for head in range(heads):
            pattern, params = mix[(head + layer) % len(mix)]
            rows.append(row(layer, head, pattern, params, density=0.25 + 0.1 * head, score=0.5 + 0.01 * head, **extra))
    return rows


def manifest(model: ModelInfo = TINY, *, space: str = "query", **kwargs) -> dict:
    return new_manifest(
        model, head_index_space=space, provenance={"kind": "manual", "source": "tests"},
        methods={"mminference": {"table": "heads.parquet", "search": "test"}},
        created=CREATED, producer=PRODUCER, device={"gpu": None, "torch": "2.13.0", "triton": None, "transformers": None},
        **kwargs,
    )


def make_artifact(path: Path, rows: list[dict] | None = None, *, space: str = "query", model: ModelInfo = TINY) -> Path:
    return write_artifact(path, manifest(model, space=space), {"heads.parquet": rows if rows is not None else mix_rows()})


def rehash(path: Path) -> None:
    """Recompute manifest.files after a test edited a table on purpose (so the next check is reached)."""
    file = path / "manifest.json"
    data = json.loads(file.read_text())
    data["files"] = {name: sha256_file(path / name) for name in data["files"]}
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def edit_manifest(path: Path, **changes) -> None:
    file = path / "manifest.json"
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def rewrite_heads(path: Path, edit, *, version: bytes = b"1") -> None:
    """Apply ``edit`` to heads.parquet's rows (list of dicts) and write it back without the writer's checks."""
    file = path / "heads.parquet"
    table = pq.read_table(file)
    rows = edit(table.to_pylist())
    out = pa.Table.from_pylist(rows, schema=table.schema.remove_metadata())
    out = out.replace_schema_metadata({META_VERSION: version, META_TABLE: b"heads.parquet"})
    pq.write_table(out, file, **PARQUET_OPTIONS)
    rehash(path)
