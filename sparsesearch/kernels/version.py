"""The environment stamp of per-user caches of measured kernel times: torch, Triton, our kernels' source, the GPU.

A time measured on one GPU under one torch, Triton and kernel version says nothing about another, so every cache
of them (the search's cost cache, search/cost.py; the launch table, launch_table.py) stores ``cache_env`` beside
its entries and trusts them only when the stamp matches. It lives with the kernels because ``kernel_version``
hashes their sources, and so the launch table reads it without reaching up a floor to the search.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton


def kernel_version(kernels: Path | None = None) -> str:
    """sha256 (16 hex) of the Triton kernels' source (``kernels``: their directory, default ours): any
    change to a kernel is a new version."""
    kernels = kernels or Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(kernels.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_env(device_name: str | None = None) -> dict[str, str]:
    """What a measured time depends on besides its key: the torch, Triton and kernel versions, and the GPU
    (``device_name``, e.g. "NVIDIA H200") when the cache is for one."""
    env = {"torch": torch.__version__, "triton": triton.__version__, "kernels": kernel_version()}
    return env if device_name is None else {**env, "device": device_name}
