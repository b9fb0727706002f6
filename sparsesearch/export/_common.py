"""Shared by the exporters: text-only row lookup and atomic single-file output.

Exporters write exactly one file, at the path the user chose: never a directory, never a generated name
elsewhere. It is written whole or not at all (``sparsesearch.files``), so a failure leaves the old file (or
nothing) behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..artifacts.columns import ALL_MODALITIES, row_from_params, window_row
from ..artifacts.io import Artifact
from ..artifacts.tables import row_name
from ..files import write_bytes_atomic

SYNTH_BLOCK = 64  # block size of rows the artifact implies but does not store (triangle layers, missing heads)


def global_only(artifact: Artifact) -> Artifact:
    """The artifact as a deployment without modality ids runs it: the global (all x all) rows only, every
    head boundary none (a boundary head falls back to its global pattern, as the runtime does)."""
    from dataclasses import replace

    heads = artifact.heads
    keep = heads[(heads["q_modality"] == ALL_MODALITIES) & (heads["k_modality"] == ALL_MODALITIES)].copy()
    keep["boundary"] = "none"
    return replace(artifact, tables={**artifact.tables, "heads.parquet": keep.reset_index(drop=True)})


def implied_row(layer: int, head: int, pattern: str, params) -> dict:
    """A heads row the artifact means without storing it (no measurements, no score)."""
    return {
        "layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES,
        "boundary": "none", "pattern": pattern, **row_from_params(params), "block_m": SYNTH_BLOCK,
        "block_n": SYNTH_BLOCK, "density": None, "recall": None, "output_error": None, "latency_ms": None,
        "score": None,
    }


def effective_rows(artifact: Artifact, fmt: str, *, modality_rows: bool = False) -> tuple[dict[tuple[int, int], dict], list[dict]]:
    """What the runtime runs per (layer, head) of the artifact's head space, as text-only rows, plus the
    modality-pair rows.

    Same reading as ``runtime.plan.build_plan``: a hybrid model's sliding layers (manifest model.layer_types)
    run the model's window, ashape(sink 0, local sliding_window), in every head — their rows say exactly that
    (validated) or are implied; global layers at or past ``methods.trianglemix.start_layer`` run
    triangle(sink, window, last) in every head whatever their rows say; a head with no text row runs dense.
    Formats without modalities cannot say what a modality-pair row means: with ``modality_rows=False`` any
    such row (outside TriangleMix layers) is an error naming it; with True they are returned separately.
    """
    from sparsesearch.patterns import PARAMS

    manifest = artifact.manifest
    model = manifest["model"]
    heads = model["num_heads"] if manifest["head_index_space"] == "query" else model["num_kv_heads"]
    tri = manifest["methods"].get("trianglemix")
    start = tri["start_layer"] if tri is not None and tri.get("start_layer") is not None else model["num_layers"]
    types = model.get("layer_types") or ["full_attention"] * model["num_layers"]
    sliding = {layer for layer, kind in enumerate(types) if kind == "sliding_attention"}
    text, pairs = {}, []
    for row in artifact.head_rows():
        if row["layer"] >= start and row["layer"] not in sliding:
            continue
        if row["q_modality"] != ALL_MODALITIES or row["k_modality"] != ALL_MODALITIES:
            if not modality_rows:
                raise ValueError(
                    f"the {fmt} format carries text-only rows (q_modality == k_modality == 'all'); "
                    f"the artifact has a modality-pair row ({row_name(row)}); --global-only exports its global rows"
                )
            pairs.append(row)
            continue
        text[(row["layer"], row["head"])] = row
    out = {}
    for layer in range(model["num_layers"]):
        for head in range(heads):
            if layer in sliding:
                out[(layer, head)] = text.get((layer, head)) or window_row(layer, head, model["sliding_window"])
            elif layer >= start:
                params = PARAMS["triangle"](sink=tri["sink"], window=tri["window"], last=tri["last"])
                out[(layer, head)] = implied_row(layer, head, "triangle", params)
            else:
                out[(layer, head)] = text.get((layer, head)) or implied_row(layer, head, "dense", PARAMS["dense"]())
    return out, pairs


def check_output_file(out) -> Path:
    """The output path of a single-file export, refused when it is a directory (or names one)."""
    path = Path(out)
    if str(out).endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"--out {out} is a directory; give the path of the file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"--out {out}: {path.parent} is not a directory")
    return path


def write_file_atomic(out, data: bytes) -> Path:
    """Write ``data`` to the export's ``out`` whole or not at all (``files.write_bytes_atomic``), refused first
    when ``out`` is a directory."""
    return write_bytes_atomic(check_output_file(out), data)


def read_tagged_safetensors(path, fmt: str) -> tuple[dict[str, str], dict]:
    """(header metadata, tensors by name) of a .safetensors file whose metadata ``format`` is ``fmt``; ValueError
    (one line) for a missing, damaged or other file. Tensors are read only once the format matches."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()} if meta.get("format") == fmt else {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise ValueError(f"{path.name}: cannot read safetensors ({' '.join(str(exc).split())})") from None
    if meta.get("format") != fmt:
        raise ValueError(f"{path.name}: not a {fmt} file (metadata format {meta.get('format')!r})")
    return meta, tensors
