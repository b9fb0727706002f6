"""Shared CLI pieces: option aliases, output helpers, and the bad-input -> exit 2 rule."""

from __future__ import annotations

import functools
import json
import sys
from typing import Annotated, Callable

import typer
from rich.console import Console

# People read rich output on stderr; pipes read JSON on stdout.
err_console = Console(stderr=True)
out_console = Console()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (cuda when present), cpu or cuda.")]


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


def exits_cleanly(fn: Callable) -> Callable:
    """Turn bad input (ValueError, missing files) into one red line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


def print_json(payload) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
