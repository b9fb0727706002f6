"""Sizes a user asks for, checked against the memory this machine has before anything is allocated.

A size from the command line (``--tokens``, ``--heads``, ``--samples``) or from a file's own header (a Parquet
table's uncompressed size) can imply an allocation no machine holds; torch then fails deep inside with a
traceback, or the kernel's OOM killer ends the process. Callers estimate the bytes their largest allocations
take and call ``fits_memory`` first, so the answer is one line naming the option.

This module imports nothing from the rest of the package: everything may use it.
"""

from __future__ import annotations

import os

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB")


def available_bytes() -> int | None:
    """Memory a new allocation can take now: MemAvailable on Linux, else free physical pages; None when the
    system says neither (then nothing is refused on memory grounds)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def human(nbytes: float) -> str:
    """``2.2 PB``: decimal units, as the allocation errors users compare against print them."""
    value, unit = float(nbytes), 0
    while value >= 1000 and unit < len(_UNITS) - 1:
        value, unit = value / 1000, unit + 1
    return f"{value:.1f} {_UNITS[unit]}" if unit else f"{int(value)} B"


def fits_memory(what: str, nbytes: int, available: int | None = None, where: str = "this machine") -> None:
    """Raise ValueError (one line naming ``what``) when ``nbytes`` exceed the memory available now: the host's,
    or ``available`` bytes of the memory ``where`` names (a GPU's free memory)."""
    have = available_bytes() if available is None else available
    if have is not None and nbytes > have:
        raise ValueError(f"{what} needs about {human(nbytes)} of memory; {where} has {human(have)} available")
