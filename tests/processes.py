"""Process-table helpers for tests that kill commands and check what they leave running."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (over all its threads' children, as /proc lists them)."""
    kids = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(p) for p in path.read_text().split()]
        except FileNotFoundError:
            pass
    return kids + [d for k in kids for d in descendants(k)]
