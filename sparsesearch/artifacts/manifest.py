"""Building manifests: producer, time, environment and the defaults of every v1 field.

``new_manifest`` returns a plain dict that ``write_artifact`` validates and completes with ``files``.
"""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from ..models.info import ModelInfo
from .schema import SCHEMA_VERSION

METHODS = ("mminference", "trianglemix", "nosa", "spava")
PROVENANCE_KINDS = ("calibrated", "imported", "manual")


def utc_now() -> str:
    """Current time as ISO-8601 UTC with second precision, e.g. '2025-01-31T12:00:00Z'."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """Commit of the checkout this package runs from, or None (installed wheel, no git, not a repo)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    revision = done.stdout.strip()
    return revision if done.returncode == 0 and len(revision) == 40 else None


def producer_info() -> dict:
    return {"name": "sparsesearch", "version": _version("sparsesearch") or "0+unknown", "git": git_revision()}


def environment() -> dict:
    """The device block of this machine: GPU name (None without CUDA) and library versions."""
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the device block is informative; a broken CUDA setup must not stop a write
        gpu = None
    return {name: _version(name) for name in ("torch", "triton", "transformers")} | {"gpu": gpu}


def empty_device() -> dict:
    return {"gpu": None, "torch": None, "triton": None, "transformers": None}


def default_modalities(model: ModelInfo) -> dict:
    """Text plus every modality the model marks with special tokens, with the fixed ids of
    ``sparsesearch.models.modality.MODALITIES`` (text 0, image 1, video 2)."""
    from ..models.modality import MODALITIES

    names = {"text": MODALITIES.index("text")}
    for name in sorted(model.modality_token_ids):
        if name not in MODALITIES:
            raise ValueError(f"unknown modality {name!r} in modality_token_ids (known: {list(MODALITIES)})")
        names[name] = MODALITIES.index(name)
    token_ids = {name: list(ids) for name, ids in sorted(model.modality_token_ids.items())}
    return {"names": names, "token_ids": token_ids}


def new_manifest(
    model: ModelInfo,
    *,
    head_index_space: str,
    provenance: dict,
    methods: dict | None = None,
    modalities: dict | None = None,
    calibration: dict | None = None,
    search_space: dict | None = None,
    device: dict | None = None,
    created: str | None = None,
    producer: dict | None = None,
) -> dict:
    """A complete v1 manifest except ``files`` (``write_artifact`` fills it).

    methods: {name: {"table": "heads.parquet", <parameter>: value, ...}} for the methods that ran (others
    null); "table" names the file holding the method's results, when it has one. trianglemix needs
    start_layer (int or None), sink, window and last: layers >= start_layer run triangle in every head.
    provenance: {"kind": "calibrated" | "imported" | "manual", "source": str | None, "sha256": str | None}.
    created: fixed ISO-8601 UTC time for reproducible bytes; now when None.
    device: None means this machine's environment(); pass empty_device() for imports.
    """
    all_methods = {name: None for name in METHODS}
    for name, value in (methods or {}).items():
        if name not in all_methods:
            raise ValueError(f"unknown method {name!r} (known: {list(METHODS)})")
        all_methods[name] = value
    return {
        "schema_version": SCHEMA_VERSION,
        "producer": producer if producer is not None else producer_info(),
        "created": created if created is not None else utc_now(),
        "model": model.to_dict(),
        "head_index_space": head_index_space,
        "modalities": modalities if modalities is not None else default_modalities(model),
        "calibration": calibration,
        "search_space": search_space,
        "device": device if device is not None else environment(),
        "methods": all_methods,
        "files": {},
        "provenance": {"source": None, "sha256": None} | dict(provenance),
    }
