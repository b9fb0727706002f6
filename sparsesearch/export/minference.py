"""MInference per-head config (also Qwen2.5-1M's ``sparse_attention_config.json``): export and import.

Format: a JSON list indexed by layer; each element maps the QUERY-head index as a string to
``[type, vertical_size, slash_size, score]``. A head missing from a layer gets MInference's fallback
``["vertical_and_slash", 1000, 6096]``.

Mapping (artifact row <-> entry):

==============  =====================================================  ===========================================
pattern         entry                                                  notes
==============  =====================================================  ===========================================
vertical_slash  ["vertical_and_slash", vertical_size, slash_size, s]   only with last_q 64, force_vertical 30 and
                                                                       force_slash 100 (what MInference's kernel
                                                                       fixes); other values are refused.
ashape          ["stream_llm", sink, local, s]                         MInference's n_init, n_local.
block_topk      ["block_sparse", k_blocks, sink_blocks, s]             MInference's runtime ignores both numbers
                                                                       (it keeps its top-100 64-token blocks); we
                                                                       write ours so the round trip is lossless.
dense           ["vertical_and_slash", 2**30, 2**30, s]                every column and every diagonal: MInference
                                                                       clamps both sizes to the context length, so
                                                                       this is dense causal attention there; import
                                                                       reads this pair back as dense, and any
                                                                       vertical size reaching the model's context
                                                                       (every column there; export.qwen1m).
triangle, grid  refused                                                the format has no such type.
==============  =====================================================  ===========================================

Hybrid models (Gemma 3): a sliding-window layer is written as ``["stream_llm", 0, window, score]`` in every
head — MInference's streaming type with no initial tokens and n_local = the model's window is exactly what
that layer computes. On import a sliding layer takes only that entry (any other is refused with one line
naming the layer and the constraint), and heads it leaves out get the window, not the VS fallback.

Only text-only rows (q_modality == k_modality == "all") with boundary "none" can be exported. A KV-space
artifact is written in query-head space: each KV head's row goes to every query head of its group. Every
(layer, query head) gets an entry, read as the runtime reads the artifact: a head without a row runs dense
(written as the dense pair above, never left out, which MInference would turn into VS(1000, 6096)), and
TriangleMix layers (methods.trianglemix.start_layer and deeper) are triangle, so they are refused.
Block sizes are not carried: imported rows get block_m = block_n = 64 (MInference's block). The score is
copied as is (MInference files use it for different things); null when the artifact has none. A NaN or
infinite score is refused on import (a missing score is null; NaN is not JSON).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..artifacts.columns import ALL_MODALITIES, check_window_rows, row_from_params, window_row
from ..artifacts.io import Artifact, sha256_bytes
from ..artifacts.manifest import empty_device, new_manifest
from ..artifacts.tables import heads_frame, to_query_heads
from ..json_input import parse_json, read_bytes
from ..models.info import ModelInfo
from ._common import effective_rows, write_file_atomic

TYPES = ("vertical_and_slash", "stream_llm", "block_sparse")
FALLBACK = ("vertical_and_slash", 1000, 6096)
DENSE_SIZE = 1 << 30
BLOCK = 64
VS_FIXED = {"last_q": 64, "force_vertical": 30, "force_slash": 100}
CONFIG_MAX_BYTES = 16 << 20


# ---------------------------------------------------------------------------------------------- export


def _entry(row: dict) -> list:
    where = f"layer {row['layer']} head {row['head']}"
    pattern, score = row["pattern"], row["score"]
    if row["boundary"] != "none":
        raise ValueError(f"{where}: boundary {row['boundary']!r} cannot be written to the MInference format (no boundaries there)")
    if pattern == "vertical_slash":
        for name, value in VS_FIXED.items():
            if row[name] != value:
                raise ValueError(
                    f"{where}: vertical_slash with {name} {row[name]} cannot be written to the MInference format "
                    f"(it fixes {', '.join(f'{k} {v}' for k, v in VS_FIXED.items())})"
                )
        return ["vertical_and_slash", row["vertical_size"], row["slash_size"], score]
    if pattern == "ashape":
        return ["stream_llm", row["sink"], row["local"], score]
    if pattern == "block_topk":
        return ["block_sparse", row["k_blocks"], row["sink_blocks"], score]
    if pattern == "dense":
        return ["vertical_and_slash", DENSE_SIZE, DENSE_SIZE, score]
    raise ValueError(f"{where}: pattern {pattern} cannot be written to the MInference format (types: {', '.join(TYPES)})")


def export_minference(artifact: Artifact) -> list[dict]:
    """The MInference config of an artifact: list (per layer) of {str(query head): [type, v, s, score]}."""
    rows, _ = effective_rows(artifact, "minference")
    config: list[dict] = [{} for _ in range(artifact.manifest["model"]["num_layers"])]
    for row in to_query_heads(list(rows.values()), artifact.manifest):  # sorted by (layer, head)
        config[row["layer"]][str(row["head"])] = _entry(row)
    return config


def minference_json(config: list[dict]) -> str:
    """JSON text, one layer per line (the format is a plain list; this just keeps diffs readable)."""
    return "[\n" + ",\n".join(json.dumps(layer, allow_nan=False) for layer in config) + "\n]\n"


def write_minference(artifact: Artifact, out) -> Path:
    return write_file_atomic(out, minference_json(export_minference(artifact)).encode())


# ---------------------------------------------------------------------------------------------- import


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_source(source) -> tuple[list, str | None, str]:
    """(parsed JSON, file name or None, sha256 of the bytes or of the canonical JSON of a list)."""
    if isinstance(source, list):
        data = json.dumps(source, sort_keys=True, separators=(",", ":")).encode()
        return source, None, sha256_bytes(data)
    path = Path(source)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a MInference JSON file")
    # One line each (sparsesearch.json_input): a missing file, a FIFO or device, a file too big to be a config (one of
    # 128 layers x 64 heads is about 300 KB), bad UTF-8, NaN/Infinity scores, repeated heads, deep nesting.
    data = read_bytes(path, str(path), max_bytes=CONFIG_MAX_BYTES)
    return parse_json(data, path.name), path.name, sha256_bytes(data)


def _row_from_entry(entry, layer: int, head: int, label: str, context: int | None = None) -> dict:
    """One heads row of an entry. ``context`` (the model's max_position_embeddings): a vertical_and_slash entry
    whose vertical size reaches it keeps every column of any prompt the model takes, so it is read as dense (the
    qwen-1m export writes dense heads that way, since those engines cannot take the 2**30 pair)."""
    from sparsesearch.patterns import PARAMS

    where = f"{label}: layer {layer} head {head}"
    if not isinstance(entry, list) or len(entry) not in (3, 4):
        raise ValueError(f"{where}: expected [type, vertical_size, slash_size, score], got {json.dumps(entry)[:60]}")
    kind, first, second = entry[0], entry[1], entry[2]
    score = entry[3] if len(entry) == 4 else None
    if kind not in TYPES:
        raise ValueError(f"{where}: unknown type {kind!r} (known: {', '.join(TYPES)})")
    if not _is_int(first) or not _is_int(second):
        raise ValueError(f"{where}: sizes must be integers, got {first!r} and {second!r}")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        raise ValueError(f"{where}: score must be a number or null, got {score!r}")
    if score is not None and not math.isfinite(score):  # a parsed list may hold float('nan'); files cannot (json_input)
        raise ValueError(f"{where}: score must be finite or null, got {score!r}")
    try:
        if kind == "vertical_and_slash" and (first == second == DENSE_SIZE or (context is not None and first >= context)):
            pattern, params = "dense", PARAMS["dense"]()
        elif kind == "vertical_and_slash":
            pattern, params = "vertical_slash", PARAMS["vertical_slash"](vertical_size=first, slash_size=second, **VS_FIXED)
        elif kind == "stream_llm":
            pattern, params = "ashape", PARAMS["ashape"](sink=first, local=second)
        else:
            pattern, params = "block_topk", PARAMS["block_topk"](k_blocks=first, sink_blocks=second)
    except ValueError as exc:
        raise ValueError(f"{where}: invalid {kind} entry: {exc}") from None
    return {
        "layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES,
        "boundary": "none", "pattern": pattern, **row_from_params(params),
        "block_m": BLOCK, "block_n": BLOCK, "score": None if score is None else float(score),
    }


def import_minference(source, model_info: ModelInfo, *, created: str | None = None) -> tuple[dict, dict]:
    """(manifest, tables) of an artifact holding a MInference config, ready for ``write_artifact``.

    source: path of the JSON file, or the parsed list. Heads a layer leaves out get MInference's fallback
    VS(1000, 6096); they are listed in ``methods.mminference.fallback_heads`` as [layer, head].
    """
    config, name, digest = _read_source(source)
    label = name or "minference config"
    layers, heads = model_info.num_layers, model_info.num_heads
    if not isinstance(config, list):
        raise ValueError(f"{label}: expected a JSON list with one object per layer, got {type(config).__name__}")
    if len(config) != layers:
        raise ValueError(f"{label} has {len(config)} layers, model {model_info.id} has {layers}")
    rows, fallback = [], []
    for layer, entries in enumerate(config):
        if not isinstance(entries, dict):
            raise ValueError(f"{label}: layer {layer} must be an object of head -> entry, got {type(entries).__name__}")
        seen = set()
        for key, entry in entries.items():
            if not (isinstance(key, str) and key.isdigit() and str(int(key)) == key):
                raise ValueError(f"{label}: layer {layer} has head key {key!r}; expected a query-head index like '0'")
            head = int(key)
            if head >= heads:
                raise ValueError(f"{label}: layer {layer} head {head} out of range [0, {heads}) (query heads of {model_info.id})")
            rows.append(_row_from_entry(entry, layer, head, label, model_info.max_position_embeddings))
            seen.add(head)
        window = model_info.window_of(layer)
        for head in range(heads):
            if head in seen:
                continue
            if window is not None:  # a sliding layer runs the model's window whatever the config leaves out
                rows.append(window_row(layer, head, window) | {"block_m": BLOCK, "block_n": BLOCK})
                continue
            rows.append(_row_from_entry([*FALLBACK, None], layer, head, label))
            fallback.append([layer, head])
    try:
        check_window_rows(rows, model_info.layer_types, model_info.sliding_window)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from None
    method = {"table": "heads.parquet", "format": "minference", "fallback": list(FALLBACK), "fallback_heads": fallback}
    manifest = new_manifest(
        model_info,
        head_index_space="query",
        provenance={"kind": "imported", "source": name, "sha256": digest},
        methods={"mminference": method},
        device=empty_device(),
        created=created,
    )
    return manifest, {"heads.parquet": heads_frame(rows)}
