"""Whole-or-nothing file writes, the one implementation every file the library writes in place goes through.

A reader of a path written here sees the old file or the new one, never half of either: the bytes go to a
temporary file in the target's own directory (a rename is atomic only within one filesystem), are fsynced (so a
crash after the rename cannot leave a renamed but empty file), and ``os.replace`` puts them in place; the
directory is then fsynced where the OS allows, so the rename itself survives a crash. On any failure, a
KeyboardInterrupt included, the temporary is removed and the target is as it was.

The temporary's name is unique per write (created with O_EXCL under a random name, as ``tempfile.mkstemp``
does), so two processes writing one file never write into each other's temporary. That alone keeps a shared
file whole, not complete: two read-modify-write cycles at once still lose the entries of whichever wrote first.
Files several processes update (the measured-cost cache, the launch table) take ``locked(path)`` around their
read, merge and write.

This module imports nothing from the rest of the package: everything may use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # Windows has no flock: writes stay whole, but concurrent updates may drop entries there
    fcntl = None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all (module docstring); return the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """``write_bytes_atomic`` of ``text`` encoded (UTF-8 by default, whatever the locale says)."""
    return write_bytes_atomic(path, text.encode(encoding))


def write_json_atomic(path: str | os.PathLike, payload: Any, *, end: str = "", **json_kwargs: Any) -> Path:
    """``json.dumps(payload, **json_kwargs) + end`` written whole or not at all. Serialised before any file is
    touched, so a payload that cannot be serialised leaves the target as it was and creates nothing. Callers pass
    their own options (sort_keys, indent, ...) because the bytes of each file are part of its format."""
    return write_text_atomic(path, json.dumps(payload, **json_kwargs) + end)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary path beside ``path``, for writers that want a path rather than bytes (pyarrow/pandas,
    matplotlib, a package's own assembler). When the block ends normally, what was written there is fsynced and
    replaces ``path``; when it raises, the temporary is removed and ``path`` is untouched. ``suffix`` ends the
    temporary's name, for writers that pick their format from the extension (``.tmp.png``)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_unique(target, suffix)
    except OSError as exc:
        raise naming(target, exc) from None
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (None, str(tmp)):
            raise naming(target, exc) from None
        raise
    fsync_dir(target.parent)


def naming(target: str | os.PathLike, exc: OSError) -> OSError:
    """``exc`` as the same kind of error about ``target``: a write that fails names the temporary (which the
    user never asked for and which is gone by now) or no file at all (a full disk fails in write()), and
    the one-line error a user sees should name the file they asked for. Errors without an errno are kept."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(target))


def write_bytes_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` directly and fsync it: for a file inside a directory that is itself renamed
    into place whole (an artifact), where a per-file rename would add nothing."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk. Best effort: some systems cannot open a directory
    (Windows) or fsync one (some network filesystems); the rename has happened either way."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive advisory lock for ``path`` (flock on the sidecar ``<name>.lock``, blocking until the
    holder lets go) around a read-modify-write of a file that other processes update too. The sidecar, not the
    file, is locked because the file is replaced by every write: a lock on the old inode would not exclude a
    process that opened the new one. The sidecar stays: removing it could let two processes lock different
    inodes of the same name."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as handle:  # "a": created if missing, never truncated
        if fcntl is None:
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            # Unlocked explicitly, not by closing: a child forked meanwhile shares this open file, and the lock
            # would last as long as the child's copy of it.
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _create_unique(target: Path, suffix: str) -> Path:
    """Create (O_EXCL) and return an empty ``.<name>.<random><suffix>`` beside ``target``. Like mkstemp, but with
    mode 0o666 filtered by the umask, the permissions a plain open() gives the target: mkstemp's 0o600 would make
    a shared cache unreadable to others, and reading the umask to chmod afterwards changes it process-wide for a
    moment (a race with any thread creating a file then)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}{suffix}")
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:  # 48 random bits: a collision is rare, and then the next name is tried
            continue
        return tmp


def _fsync_file(path: Path) -> None:
    """fsync a file the writer has closed (fsync acts on the file, whichever descriptor names it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
