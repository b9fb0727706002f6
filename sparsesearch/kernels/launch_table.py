"""Per-device launch configs of the Triton block-sparse kernel: measured once on a GPU, cached, then used.

``block_sparse._launch_config``'s defaults (64-wide key tiles, 4 warps, 2 stages) were measured on an H200. A GPU
with less shared memory or another balance of tensor and load throughput may want others. ``sparsesearch
tune-kernels`` times every candidate on the GPU at a representative launch, keeps the fastest per (block_n,
head_dim), and records it here:

    $XDG_CACHE_HOME/sparsesearch/launch_configs.json   (~/.cache/... without XDG_CACHE_HOME)
    {"schema_version": 1, "devices": {"NVIDIA H200": {"env": {torch, triton, kernels, device},
                                                      "configs": {"64x128": {"TILE_N": 64, "num_warps": 4, ...}}}}}

A device's entry holds only for the torch, Triton and kernel versions it was measured under (``version.cache_env``,
the cost cache's stamp): one stamped otherwise, or malformed, is ignored with a warning and never trusted. Hopper's
warp-specialized kernel (block_sparse_ws.py) has its own measured plan and does not read the table; the launches it
does not take (regions, grid lines, varlen, 128-row blocks, query-space indexes) do.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from ..files import locked, write_json_atomic
from ..user_cache import user_cache_dir
from .version import cache_env

SCHEMA_VERSION = 1
TUNED = ("TILE_N", "num_warps", "num_stages")  # what an entry may set; the rest stays the device default
TILE_CHOICES = (32, 64)  # key tile widths timed (16-blocks take 16)
WARP_CHOICES = (4, 8)
STAGE_CHOICES = (1, 2, 3)


def default_path() -> Path:
    return user_cache_dir() / "launch_configs.json"


def config_key(block_n: int, head_dim: int) -> str:
    return f"{block_n}x{head_dim}"


def candidates(block_n: int, head_dim: int) -> list[dict[str, int]]:
    """Every (TILE_N, num_warps, num_stages) worth timing for a launch: key tiles no wider than a block (a config
    that does not fit this GPU's shared memory, e.g. 64-wide d-256 tiles in three stages, fails and is skipped)."""
    widths = [t for t in TILE_CHOICES if t <= block_n] or [block_n]
    return [{"TILE_N": t, "num_warps": w, "num_stages": s} for t in widths for w in WARP_CHOICES for s in STAGE_CHOICES]


def _valid_config(config: Any) -> bool:
    return (isinstance(config, dict) and set(TUNED) <= set(config)
            and config["TILE_N"] in (16, *TILE_CHOICES) and config["num_warps"] in WARP_CHOICES
            and config["num_stages"] in STAGE_CHOICES)


def read_table(path: Path) -> dict:
    """The file's content, or an empty table (with a warning) when it is unreadable or of another schema."""
    if not path.exists():
        return {"schema_version": SCHEMA_VERSION, "devices": {}}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        warnings.warn(f"launch table {path} unreadable ({exc}); ignored", stacklevel=2)
        return {"schema_version": SCHEMA_VERSION, "devices": {}}
    if not isinstance(table, dict) or table.get("schema_version") != SCHEMA_VERSION or not isinstance(table.get("devices"), dict):
        warnings.warn(f"launch table {path} is not schema {SCHEMA_VERSION}; ignored", stacklevel=2)
        return {"schema_version": SCHEMA_VERSION, "devices": {}}
    return table


def device_configs(table: dict, device_name: str, env: dict[str, str], path: Path) -> dict[str, dict[str, int]]:
    """The device's valid configs when its entry was measured under ``env``; {} otherwise (a stale or foreign entry
    warns: its timings say nothing about these versions)."""
    entry = table["devices"].get(device_name)
    if entry is None:
        return {}
    if not isinstance(entry, dict) or entry.get("env") != env:
        warnings.warn(f"launch table {path}: the entry for {device_name!r} was measured under other versions "
                      f"({entry.get('env') if isinstance(entry, dict) else entry!r}, now {env}); ignored until "
                      f"`sparsesearch tune-kernels` measures it again", stacklevel=2)
        return {}
    configs = entry.get("configs")
    if not isinstance(configs, dict):
        return {}
    return {key: {name: c[name] for name in TUNED} for key, c in configs.items() if _valid_config(c)}


def write_configs(path: Path, device_name: str, env: dict[str, str], configs: dict[str, dict]) -> None:
    """Record a device's tuned configs (merged over its entry when that has the same env). The read, merge and
    write hold the table's lock, so two tunings at once (two GPUs of one host) both land; the write is whole or
    nothing (``sparsesearch.files``): a reader never sees half a file, and a failed write leaves the table as it
    was and no temporary behind."""
    with locked(path):
        table = read_table(path)
        entry = table["devices"].get(device_name)
        kept = entry.get("configs") if isinstance(entry, dict) and entry.get("env") == env else None
        table["devices"][device_name] = {"env": env, "configs": {**(kept if isinstance(kept, dict) else {}), **configs}}
        write_json_atomic(path, table, end="\n", indent=2, sort_keys=True)


def tuned_config(device_name: str, block_n: int, head_dim: int) -> dict[str, int] | None:
    """This device's measured config for (block_n, head_dim) from the default table, or None. Its caller,
    block_sparse._device_config, is cached per key, so the table is read once per process and key: a table written
    later is seen by the next process."""
    path = default_path()
    configs = device_configs(read_table(path), device_name, cache_env(device_name), path)
    return configs.get(config_key(block_n, head_dim))


def fastest(configs: Iterable[dict], time_ms: Callable[[dict], float]) -> tuple[dict | None, list[dict]]:
    """(the config with the least time, one row per config: the config, ``ms``, or ``error`` where it failed to
    compile or run, e.g. out of shared memory)."""
    rows = []
    for config in configs:
        try:
            rows.append({**config, "ms": float(time_ms(config))})
        except Exception as exc:  # a candidate that does not fit this GPU is a row, not the end of the tuning
            rows.append({**config, "error": f"{type(exc).__name__}: {exc}"[:200]})
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return (None if best is None else {name: best[name] for name in TUNED}), rows
