"""`sparsesearch import-minference`: turn a MInference / Qwen-1M per-head JSON into a validated artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._shared import TrustOpt, model_info
from .common import JsonOpt, err_console, exits_cleanly, print_json


@exits_cleanly
def import_minference(
    file: Annotated[Path, typer.Argument(help="MInference config JSON (list per layer of {query head: [type, v, s, score]}).", show_default=False)],
    model: Annotated[str, typer.Option("--model", help="Model id, path or alias the config belongs to.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory to create.", show_default=False)],
    created: Annotated[Optional[str], typer.Option("--created", help="Fixed ISO-8601 UTC time for reproducible bytes (default: now).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a different artifact already at --out.")] = False,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Import a MInference (or Qwen2.5-1M sparse_attention_config.json) per-head config as an artifact.

    Heads a layer leaves out get MInference's fallback vertical_and_slash(1000, 6096), recorded in the manifest.
    On a hybrid model (Gemma 3) a sliding-window layer takes only ["stream_llm", 0, window] (its heads left
    out get that window); any other entry there is refused.

    Example: sparsesearch import-minference Qwen2.5_7B_best_pattern.json --model Qwen/Qwen2.5-7B-Instruct --out runs/qwen-imported
    """
    from sparsesearch import preflight as check
    from sparsesearch.artifacts import load_artifact, write_artifact
    from sparsesearch.export.minference import import_minference as load_config

    check.output_path("--out", out, reads={"FILE": file}, model=model)
    info = model_info(model, trust_remote_code)
    manifest, tables = load_config(file, info, created=created)
    path = write_artifact(out, manifest, tables, overwrite=overwrite)
    art = load_artifact(path, model_info=info)
    fallback = manifest["methods"]["mminference"]["fallback_heads"]
    if json_out:
        print_json({"out": str(path), "rows": len(art.heads), "fallback_heads": len(fallback), "sha256": manifest["provenance"]["sha256"]})
    else:
        err_console.print(f"imported {file.name} into {path}: {len(art.heads)} rows, {len(fallback)} fallback heads", highlight=False)
