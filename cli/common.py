"""Shared CLI pieces: option aliases, output helpers, and the bad-input -> exit 2 rule."""

from __future__ import annotations

import errno
import functools
import json
import sys
from typing import Annotated, Callable

import typer
from rich.console import Console
from rich.markup import escape

# People read rich output on stderr; pipes read JSON on stdout.
err_console = Console(stderr=True)
out_console = Console()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (cuda when present), cpu or cuda.")]


def _flags_take_no_value() -> None:
    """Show a flag in --help without a value type. typer 0.29 renders each option's type through
    TyperOption.display_type_rich, which (unlike its plain-text get_help_record) does not skip flags, so every
    flag read ``--resume <bool>`` as if it took a value. Patched once here, where every command module
    imports from, so every command and group (``--help`` itself included) renders flags bare; other options,
    and typer versions without the method, are left as they are."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "skips_flags", False):
        return

    def display_type_rich(self, ctx):
        if self.is_flag or self.count:
            return None
        return shown(self, ctx)

    display_type_rich.skips_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()


class BadInput(ValueError):
    """A user-facing input problem: one line, exit code 2."""


def resolve_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda asked for, but torch sees no CUDA device")
    return device


def prepare_cpu_kernels(device: str) -> None:
    """Triton kernels run on CPU tensors only under the interpreter, which must be on before triton.jit runs."""
    import os

    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


# OS errors that say something about a path the user gave (or the disk under it), not about this program.
PATH_ERRNOS = frozenset({
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTEMPTY, errno.EXDEV,
})


def path_error(exc: OSError) -> bool:
    """An OSError about a user path: one of PATH_ERRNOS, or one naming a file. Others (a refused connection, a
    timeout of a collective) are faults of the run, not of the input, and keep exit 1 with their traceback."""
    ours = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)  # raised with a message
    return exc.errno in PATH_ERRNOS or exc.filename is not None or (exc.errno is None and isinstance(exc, ours))


def error_line(exc: BaseException) -> str:
    """One line for a refused input: the message of ours, or for an OS error its path(s) and reason."""
    if isinstance(exc, OSError) and exc.strerror:
        paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
        return f"{paths}: {exc.strerror}" if paths else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def exits_cleanly(fn: Callable) -> Callable:
    """Turn bad input into one red line on stderr and exit code 2: ValueError (every check's refusal) and an OS
    error on a user path (permission, read-only or full disk, a missing parent, a file where a directory should
    be). Writes go through whole-or-nothing writers (sparsesearch.files, write_artifact), so a write that fails
    this way leaves nothing half-written."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError) as exc:
            if isinstance(exc, OSError) and not path_error(exc):
                raise
            err_console.print(f"[red]error:[/red] {escape(error_line(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


def print_json(payload) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
