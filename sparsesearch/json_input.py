"""JSON that a user hands us (an artifact's manifest, a MInference config, a search space), read so that any
malformation is one ``ValueError`` line naming the file, never a traceback.

What is refused, and why:

* bytes that are not UTF-8 (RFC 8259 JSON is UTF-8; a Latin-1 file would otherwise decode into wrong names);
* invalid JSON, with the line and column of the first error;
* ``NaN``, ``Infinity`` and ``-Infinity``: Python's parser accepts them, but they are not JSON, no other tool
  reads them back, and every JSON this package writes is written with ``allow_nan=False``. A NaN score or size
  is therefore refused, not read as a missing value (a missing value is ``null``);
* a key repeated in one object: which of the two values wins is up to the parser;
* nesting deeper than ``MAX_DEPTH``: Python's parser recurses per level and gives up with a RecursionError
  near 1000 levels, and the code reading the result (schema validation, deep copies) recurses too. No file of
  ours nests deeper than a handful of levels;
* a file larger than the caller's ``max_bytes``: it is read whole, so a size limit bounds the memory taken.

This module imports nothing from the rest of the package: everything may use it.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_DEPTH = 64
MAX_BYTES = 64 << 20  # 64 MiB: a manifest or config is kilobytes; a bigger file is not one of ours


def _refuse_constant(name: str):
    """json's parse_constant hook: called for NaN, Infinity and -Infinity, which are not JSON."""
    raise ValueError(f"{name} is not a JSON number (write null for a missing value)")


def _no_repeats(pairs: list) -> dict:
    """json's object_pairs_hook: an object whose keys repeat is refused, naming them."""
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"repeated key(s) {repeated} in one JSON object")
    return dict(pairs)


def depth(value) -> int:
    """Nesting depth of parsed JSON (a scalar is 0, ``[]`` is 1), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1) for child in item)
    return deepest


def parse_json(data: bytes, where: str, *, max_depth: int = MAX_DEPTH, line: bool = False):
    """Parse ``data`` as strict JSON (module docstring); ``where`` names the source in the one-line error
    (``line``: one line of a JSON-lines file, whose ``where`` ends in its number already)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as exc:
        if line:
            raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # the hooks above: NaN/Infinity, repeated keys
        raise ValueError(f"{where}: {exc}") from None
    if depth(value) > max_depth:
        raise ValueError(f"{where}: JSON nested deeper than {max_depth} levels")
    return value


def read_bytes(path: str | Path, where: str | None = None, *, max_bytes: int = MAX_BYTES) -> bytes:
    """A regular file's bytes, refused (one line) when it is missing, a directory or larger than ``max_bytes``."""
    path = Path(path)
    where = where or str(path)
    if path.is_dir():
        raise ValueError(f"{where}: is a directory, not a file")
    if path.exists() and not path.is_file():  # a FIFO or a device: reading it could block or never end
        raise ValueError(f"{where}: not a regular file")
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{where}: {size / (1 << 20):.1f} MiB, more than the {max_bytes >> 20} MiB such a file can be")
    return path.read_bytes()


def read_json(path: str | Path, where: str | None = None, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """Parse the JSON file at ``path`` strictly (module docstring); errors name ``where`` (default: the path)."""
    where = where or str(path)
    return parse_json(read_bytes(path, where, max_bytes=max_bytes), where, max_depth=max_depth)


def read_json_lines(path: str | Path, where: str | None = None, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> list:
    """The values of a JSON-lines file (blank lines skipped), each parsed strictly; errors name the line."""
    where = where or str(path)
    data = read_bytes(path, where, max_bytes=max_bytes)
    return [parse_json(text, f"{where}:{number}", max_depth=max_depth, line=True)
            for number, text in enumerate(data.split(b"\n"), 1) if text.strip()]
