"""The work directory of a long command: a fingerprint of its settings, one file per finished unit, resume.

A command that runs many independent units (probe-layers: one per probe prompt; sweep-spava: one per
configuration) keeps them in a directory beside its output, ``OUT.<command>.partial/``, named per command so
that two commands writing one artifact (calibrate, then probe-layers into it) never drop each other's state.

- ``state.json`` holds the fingerprint: the sha256 of the run's settings as sorted JSON. Only settings that
  change a unit's result belong in it (a start-layer threshold, applied after the probes, does not).
- ``resume=True`` continues a directory whose fingerprint matches and refuses one that does not (one-line
  ValueError: the saved units would mix into a run they do not belong to); with no directory there it starts
  fresh. ``resume=False`` drops any old partial state first.
- Each unit is one JSON file written whole (files.write_json_atomic): a kill leaves a unit done or absent,
  never torn, so "done" is simply "its file exists".
- ``remove()`` after the final output is written: a finished run leaves nothing beside it.

Imports only ``files`` and the standard library, so any floor may use it (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from .files import write_json_atomic

STATE = "state.json"


def fingerprint(settings: dict) -> str:
    """sha256 of ``settings`` as sorted JSON (``default=str`` for paths and the like)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def partial_path(out: str | Path, command: str) -> Path:
    """``OUT.<command>.partial`` beside ``out``: where ``command``'s work directory for ``out`` lives."""
    out = Path(out)
    return out.with_name(f"{out.name}.{command}.partial")


class WorkDir:
    """Unit files of one run in ``path`` (module docstring). ``WorkDir(path)`` uses a directory opened already
    (the ranks of a launch, told its path); ``WorkDir.open`` checks or starts it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def open(cls, out: str | Path, command: str, settings: dict, *, resume: bool) -> "WorkDir":
        """The work directory of ``command`` writing ``out``, for a run with ``settings`` (module docstring)."""
        work = cls(partial_path(out, command))
        key = fingerprint(settings)
        state = work.path / STATE
        if resume and state.is_file():
            if _stored_key(state) != key:
                raise ValueError(f"--resume: {work.path} was started with other settings; drop --resume to start over")
            return work
        work.remove()
        work.path.mkdir(parents=True)
        write_json_atomic(state, {"command": command, "fingerprint": key}, sort_keys=True)
        return work

    def unit_path(self, name: str) -> Path:
        return self.path / f"{name}.json"

    def done(self, name: str) -> bool:
        """Whether unit ``name`` finished (its file is whole or absent: module docstring)."""
        return self.unit_path(name).is_file()

    def names(self) -> set[str]:
        """The finished units, read once: a snapshot for processes that must agree on what to skip."""
        return {p.stem for p in self.path.glob("*.json") if p.name != STATE}

    def load(self, name: str) -> Any:
        return json.loads(self.unit_path(name).read_text())

    def save(self, name: str, payload: Any) -> None:
        """Write unit ``name`` whole. Floats round-trip exactly through JSON (shortest repr), NaN included, so a
        resumed run computes from the very values an uninterrupted one would; keys keep the payload's order
        (a row's keys are its table's column order)."""
        write_json_atomic(self.unit_path(name), payload, default=str)

    def remove(self) -> None:
        """Delete the directory (after the final output is written, or before a fresh start)."""
        if self.path.exists():
            shutil.rmtree(self.path)


def _stored_key(state: Path) -> str | None:
    """The fingerprint in ``state``; None when the file does not parse (then it matches no run)."""
    try:
        return json.loads(state.read_text()).get("fingerprint")
    except (ValueError, AttributeError):
        return None
