"""Pieces shared by the artifact commands (inspect, validate, export, import-minference, diff)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ArtifactArg = Annotated[Path, typer.Argument(help="Artifact directory (manifest.json + *.parquet).", show_default=False)]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub when reading its config.")]


def model_info(spec: str, trust_remote_code: bool = False):
    """ModelInfo of a model id / path / alias (config only; imported lazily so --help stays fast)."""
    from sparsesearch.models import resolve_model_info

    return resolve_model_info(spec, trust_remote_code=trust_remote_code)
