"""`sparsesearch validate`: check an artifact (schema, hashes, rows) and, with --model, that it fits the model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ._shared import ArtifactArg, TrustOpt, model_info
from .common import JsonOpt, exits_cleanly, out_console, print_json


@exits_cleanly
def validate(
    artifact: ArtifactArg,
    model: Annotated[Optional[str], typer.Option("--model", help="Model id, path or alias the artifact must fit.")] = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Validate an artifact: manifest schema, file hashes, Parquet schema versions, every heads row;
    with --model also layers, heads, KV heads, head_dim and architecture. Exit 2 with one line on a problem.

    Example: sparsesearch validate runs/llama-3.1-8b --model meta-llama/Llama-3.1-8B-Instruct
    """
    from sparsesearch.artifacts import load_artifact

    info = model_info(model, trust_remote_code) if model is not None else None
    art = load_artifact(artifact, model_info=info)
    rows = len(art.tables["heads.parquet"]) if "heads.parquet" in art.tables else 0
    if json_out:
        print_json({"ok": True, "path": str(art.path), "schema_version": art.manifest["schema_version"], "rows": rows,
                    "files": sorted(art.manifest["files"]), "model": model})
        return
    fits = f", fits {model}" if model is not None else ""
    out_console.print(f"[green]ok[/green] {art.path}: schema v{art.manifest['schema_version']}, {rows} rows, "
                      f"model {art.manifest['model']['id']}{fits}", highlight=False)
