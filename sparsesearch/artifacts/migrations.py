"""Manifest migrations: old schema versions are brought up to ``SCHEMA_VERSION`` step by step on load.

``MIGRATIONS[v]`` turns a version-``v`` manifest into a version-``v + 1`` one (pure function on plain
data; it must not touch files). Version 1 is the first version, so the registry is empty for now; a v2
adds ``MIGRATIONS[1] = _v1_to_v2``. Newer versions than this package knows are refused by name.
"""

from __future__ import annotations

import copy
from typing import Callable

from .schema import SCHEMA_VERSION, ArtifactError

MIGRATIONS: dict[int, Callable[[dict], dict]] = {}


def manifest_version(manifest: dict) -> int:
    """The manifest's schema_version after checking it is a positive int."""
    if not isinstance(manifest, dict):
        raise ArtifactError(f"manifest.json must hold a JSON object, got {type(manifest).__name__}")
    if "schema_version" not in manifest:
        raise ArtifactError("manifest.json: schema_version is missing (not a sparsesearch artifact?)")
    version = manifest["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ArtifactError(f"manifest.json: schema_version must be a positive integer, got {version!r}")
    return version


def migrate(manifest: dict) -> dict:
    """A copy of ``manifest`` at ``SCHEMA_VERSION``; refuses newer or unsupported versions with one line."""
    version = manifest_version(manifest)
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"artifact schema_version {version} is newer than this sparsesearch ({SCHEMA_VERSION}); upgrade sparsesearch"
        )
    out = copy.deepcopy(manifest)
    while version < SCHEMA_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise ArtifactError(f"artifact schema_version {version} is not supported (no migration to {version + 1})")
        out = step(out)
        version += 1
        out["schema_version"] = version
    return out
