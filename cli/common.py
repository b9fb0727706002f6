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
from rich.table import Table

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


def short_label(name: str) -> str:
    """A pattern's column header: the registry's LABEL fact (a table with one column per pattern fits 80
    columns with these), or the name itself for anything the registry does not know."""
    from sparsesearch.patterns.registry import REGISTRY

    module = REGISTRY.get(name)
    return module.LABEL if module is not None else name


def fold_cells(table: Table) -> Table:
    """Wrap a table's cells and headers at any width instead of cutting them to 'vertical_slash…': at 80
    columns, and when piped (rich then lays out at 80), every value stays readable whole."""
    for column in table.columns:
        column.overflow, column.no_wrap = "fold", False
    return table


def print_json(payload) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")


# Plain progress lines (stderr not a terminal): at most one per stage this often, besides a stage's first and
# last count, so a log of a long run shows it moving without a line per layer.
PLAIN_EVERY_S = 10.0


def _bar_columns():
    """Rich columns that stay blank while a stage has no count, so a stage like 'writing artifact' does not
    read '0/?', and show an ETA only once a count gives a rate."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.text import Text

    class Counted:
        def render(self, task):
            return Text("") if task.total is None else super().render(task)

    class Bar(Counted, BarColumn):
        pass

    class Count(Counted, MofNCompleteColumn):
        pass

    class Eta(TimeRemainingColumn):
        def render(self, task):
            return Text("") if task.total is None or not task.completed else Text("~") + super().render(task)

    return TextColumn("{task.description}"), Bar(), Count(), TimeElapsedColumn(), Eta()


def _clock(seconds: float) -> str:
    """'42s', '3m05s', '1h02m': short enough for a log line."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RunProgress:
    """The one progress display of long commands: ``stage(name)`` starts a stage, ``tick(done, total)``
    counts inside it. On a terminal a rich bar with counts, elapsed time and an ETA; otherwise (a pipe,
    a log file, CliRunner) plain timestamped lines 'stage: k/n, elapsed 12s, ~ETA 30s' on stderr, written
    as they happen (a rich live display would print only when it stops) and throttled to one per
    ``every`` seconds. The ETA extrapolates the rate since the stage's first count, so counts resumed from
    disk do not make it optimistic."""

    def __init__(self, console: Console | None = None, *, transient: bool = False, every: float = PLAIN_EVERY_S):
        self.console = console or err_console
        self.transient, self.every = transient, every
        self._bar = self._task = None
        self._name, self._t0, self._first, self._printed = "", 0.0, None, -1.0

    def __enter__(self) -> "RunProgress":
        if self.console.is_terminal:
            from rich.progress import Progress

            self._bar = Progress(*_bar_columns(), console=self.console, transient=self.transient)
            self._bar.__enter__()
            self._task = self._bar.add_task("starting", total=None)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def stage(self, name: str) -> None:
        """A new stage: its name, its clock from zero, no count until the first tick."""
        import time

        self._name, self._t0, self._first, self._printed = name, time.monotonic(), None, -1.0
        if self._bar is not None:
            self._bar.reset(self._task, total=None, completed=0, description=name)
        else:
            self._line(name)

    def tick(self, done: int, total: int | None, note: str = "") -> None:
        """``done`` of ``total`` items of the current stage are finished; ``note`` names the one now running."""
        import time

        now = time.monotonic()
        if self._first is None:
            self._first = (now, done)
        if self._bar is not None:
            self._bar.update(self._task, total=total, completed=done, description=f"{self._name}: {note}" if note else self._name)
            return
        last = total is not None and done >= total
        if not last and self._printed >= 0 and now - self._printed < self.every:
            return
        self._printed = now
        count = f"{done}/{total}" if total is not None else str(done)
        now_on = f" (now {note})" if note else ""
        self._line(f"{self._name}: {count}, elapsed {_clock(now - self._t0)}{self._eta(now, done, total)}{now_on}")

    def _eta(self, now: float, done: int, total: int | None) -> str:
        t1, d1 = self._first
        if total is None or done >= total or done <= d1:
            return ""
        return f", ~ETA {_clock((now - t1) / (done - d1) * (total - done))}"

    def _line(self, text: str) -> None:
        """One timestamped line, flushed now: a log shows it while the run goes on."""
        import time

        stream = self.console.file
        stream.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        stream.flush()
