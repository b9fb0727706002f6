"""Benchmark rows: one JSON line per measurement on stdout as it lands, all of them to a .jsonl file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(rows: list[dict], command: str) -> list[dict]:
    """Stamp each row with the command that produced it and print it (progress on long runs)."""
    for r in rows:
        r["command"] = command
        print(json.dumps(r), flush=True)
    return rows


def write_jsonl(path: Path | None, rows: list[dict]) -> None:
    """rows -> path, one JSON object per line (nothing when path is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
