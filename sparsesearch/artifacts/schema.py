"""Artifact schema v1: the JSON Schema of manifest.json and a small validator for it.

The schema lives in ``sparsesearch/artifacts/manifest.v1.json`` (the one source of truth, shipped in the
package); ``artifacts/schema/manifest.v1.json`` at the top of the repository is a byte-identical copy that a
test keeps in sync. ``jsonschema`` is not a dependency, so ``validate`` implements the keywords the schema
uses: type, const, enum, required, properties, additionalProperties (bool or schema), items, minimum, maximum,
minLength, pattern and local ``$ref`` ("#/$defs/..."). Anything else in a schema is an error, so the
schema cannot quietly use a keyword that is not checked.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources

SCHEMA_VERSION = 1
SCHEMA_FILE = f"manifest.v{SCHEMA_VERSION}.json"


class ArtifactError(ValueError):
    """An artifact (or the input to write one) is invalid: one line naming the file, the field and the value."""


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}
_KEYWORDS = {
    "type", "const", "enum", "required", "properties", "additionalProperties", "items", "minimum",
    "maximum", "minLength", "pattern", "$ref",
}


@functools.lru_cache(maxsize=None)
def _schema_text() -> str:
    return resources.files("sparsesearch.artifacts").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def manifest_schema() -> dict:
    """The manifest JSON Schema of this version (a fresh copy)."""
    return json.loads(_schema_text())


def schema_bytes() -> bytes:
    """The schema file's exact bytes (what artifacts/schema/manifest.v1.json must equal)."""
    return resources.files("sparsesearch.artifacts").joinpath(SCHEMA_FILE).read_bytes()


def validate(instance, schema: dict | None = None, *, where: str = "manifest.json") -> None:
    """Raise ArtifactError naming the first field that breaks ``schema`` (the manifest schema by default)."""
    root = manifest_schema() if schema is None else schema
    _check(instance, root, root, where, "")


def _describe(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise ArtifactError(f"schema $ref {ref!r} is not local (only '#/...' is supported)")
    node = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            raise ArtifactError(f"schema $ref {ref!r} points nowhere")
        node = node[part]
    return node


def _check(value, schema: dict, root: dict, where: str, path: str) -> None:
    unknown = set(schema) - _KEYWORDS - _ANNOTATIONS
    if unknown:
        raise ArtifactError(f"schema keyword(s) {sorted(unknown)} at {path or '(root)'} are not supported by the validator")
    name = path or "(root)"
    if "$ref" in schema:
        _check(value, _resolve(schema["$ref"], root), root, where, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](value) for t in types):
            raise ArtifactError(f"{where}: {name} must be {' or '.join(types)}, got {_describe(value)}")
    if "const" in schema and not _same(value, schema["const"]):
        raise ArtifactError(f"{where}: {name} must be {_describe(schema['const'])}, got {_describe(value)}")
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        raise ArtifactError(f"{where}: {name} must be one of {schema['enum']}, got {_describe(value)}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise ArtifactError(f"{where}: {name} must have at least {schema['minLength']} character(s), got {_describe(value)}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise ArtifactError(f"{where}: {name} does not match {schema['pattern']}: {_describe(value)}")
    if _TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        raise ArtifactError(f"{where}: {name} must be >= {schema['minimum']}, got {value}")
    if _TYPES["number"](value) and "maximum" in schema and value > schema["maximum"]:
        raise ArtifactError(f"{where}: {name} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], root, where, f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ArtifactError(f"{where}: {path + '.' + key if path else key} is missing")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if key in properties:
                _check(item, properties[key], root, where, child)
            elif extra is False:
                raise ArtifactError(f"{where}: unknown field {child!r} (known: {sorted(properties)})")
            elif isinstance(extra, dict):
                _check(item, extra, root, where, child)


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0 but True != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b
