"""Artifacts: versioned, validated, atomic directories of manifest.json + Parquet tables.

``write_artifact`` / ``load_artifact`` (io.py), the manifest JSON Schema and its validator (schema.py),
migrations between schema versions (migrations.py), manifest defaults (manifest.py), heads.parquet rows
(columns.py: the column contract; tables.py: normalising and checking rows), summaries and diffs.
Every problem with an artifact or with the input to write one raises ``ArtifactError`` (a ValueError)
with one line.
"""

from .columns import ALL_MODALITIES, BOUNDARIES, HEADS_KEY, HEADS_SCHEMA, PARAM_COLUMNS, params_from_row, row_from_params
from .io import Artifact, check_fits, load_artifact, read_manifest, sha256_bytes, sha256_file, write_artifact
from .manifest import METHODS, empty_device, environment, new_manifest, producer_info, utc_now
from .migrations import MIGRATIONS, migrate
from .schema import SCHEMA_VERSION, ArtifactError, manifest_schema, validate
from .tables import HEADS_FILE, check_heads, heads_frame, heads_records, to_query_heads

__all__ = [
    "ALL_MODALITIES", "BOUNDARIES", "HEADS_KEY", "HEADS_SCHEMA", "PARAM_COLUMNS", "params_from_row", "row_from_params",
    "Artifact", "check_fits", "load_artifact", "read_manifest", "sha256_bytes", "sha256_file", "write_artifact",
    "METHODS", "empty_device", "environment", "new_manifest", "producer_info", "utc_now",
    "MIGRATIONS", "migrate", "SCHEMA_VERSION", "ArtifactError", "manifest_schema", "validate",
    "HEADS_FILE", "check_heads", "heads_frame", "heads_records", "to_query_heads",
]
