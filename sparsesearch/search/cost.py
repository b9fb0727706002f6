"""Cost of a candidate per head: measured kernel time on a GPU, an analytic FLOP model on a CPU.

Both answer the same question with the same interface, ``cost_ms(pattern, density, n, q, index, run,
build_s) -> float64 [H]`` (milliseconds per head), so the search prunes the same way everywhere:
- ``MeasuredCost`` times the candidate's kernel launch on the current GPU (median of a few runs after a
  warm-up) plus its measured index build, split evenly over the launch's heads; results for static
  patterns are cached per (device, shape, pattern, density) in memory and in a JSON file.
- ``AnalyticCost`` models the kernel as its computed elements at a nominal rate (4·D FLOPs per element)
  plus, for dynamic patterns, the last_q x N estimate; it is what a CPU run records, labelled modelled.
  A permuted modality region on a CPU is costed by its own entries (``analytic_ms``); on a GPU it is timed
  like any candidate (``n`` is then the region's key count).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..patterns._common import causal_entries
from ..patterns.registry import REGISTRY

NOMINAL_FLOPS = 400e12  # a Hopper-class GPU at the kernel efficiency benchmarks/RESULTS.md measures
# Patterns whose runtime index is estimated per call (grid is not: an estimated stride is a search-time
# cost, stored in the params; the registry's DYNAMIC fact).
DYNAMIC = tuple(name for name, module in REGISTRY.items() if module.DYNAMIC)
ESTIMATE_ROWS = 64


class CostModel(Protocol):
    kind: str

    def cost_ms(self, pattern: str, density: torch.Tensor, n: int, q: torch.Tensor, index, run: Callable[[], None], build_s: float) -> torch.Tensor: ...


def analytic_ms(pattern: str, entries: torch.Tensor, dim: int, kv_len: int) -> torch.Tensor:
    """Modelled milliseconds per head: computed entries x 4·D FLOPs at NOMINAL_FLOPS, plus the last-queries
    estimate (ESTIMATE_ROWS x kv_len) for dynamic patterns. entries: float64 [H]."""
    per_head = entries.double() * 4 * dim / NOMINAL_FLOPS * 1e3
    if pattern in DYNAMIC:
        per_head = per_head + 2 * ESTIMATE_ROWS * kv_len * dim / NOMINAL_FLOPS * 1e3
    return per_head


class AnalyticCost:
    kind = "analytic"

    def cost_ms(self, pattern, density, n, q, index, run, build_s) -> torch.Tensor:
        return analytic_ms(pattern, density.double() * causal_entries(n), q.shape[-1], n)


def kernel_version(kernels: Path | None = None) -> str:
    """sha256 (16 hex) of the Triton kernels' source (``kernels``: their directory, default ours): any
    change to a kernel is a new version."""
    import hashlib

    kernels = kernels or Path(__file__).resolve().parents[1] / "kernels"
    digest = hashlib.sha256()
    for path in sorted(kernels.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_env(device_name: str | None = None) -> dict[str, str]:
    """What a measured time depends on besides its key: the torch, Triton and kernel versions, and the GPU
    (``device_name``, e.g. "NVIDIA H200") when the cache is for one."""
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "kernels": kernel_version()}
    return env if device_name is None else {**env, "device": device_name}


class MeasuredCost:
    """Times are cached per (device name, shape, pattern, density) in a JSON file stamped with
    ``cache_env(device_name)``; a file stamped otherwise (another install, older kernels, another GPU) or
    unreadable is ignored with a warning and replaced on the next write, never trusted."""

    kind = "measured"

    def __init__(self, cache_path: Path | None = None, reps: int = 5, device_name: str | None = None):
        self.reps = reps
        self.cache_path = cache_path or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsesearch" / "costs.json"
        self.env = cache_env(device_name)
        self._cache = self._read()

    def _read(self) -> dict:
        try:
            stored = json.loads(self.cache_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as exc:
            warnings.warn(f"ignoring cost cache {self.cache_path}: unreadable ({exc.__class__.__name__})", stacklevel=3)
            return {}
        env = stored.get("env") if isinstance(stored, dict) else None
        if env != self.env or not isinstance(stored.get("costs"), dict):
            warnings.warn(f"ignoring cost cache {self.cache_path}: measured with {env or 'an unstamped version'}, "
                          f"this install is {self.env}", stacklevel=3)
            return {}
        return stored["costs"]

    def _write(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"env": self.env, "costs": self._cache}, sort_keys=True))
        os.replace(tmp, self.cache_path)

    def cost_ms(self, pattern, density, n, q, index, run, build_s) -> torch.Tensor:
        heads = density.numel()
        key = None
        if pattern not in DYNAMIC:
            name = torch.cuda.get_device_name(q.device)
            key = f"{name}|{tuple(q.shape)}|{n}|{q.dtype}|{pattern}|{float(density.sum()):.6f}|{index.block_m}x{index.block_n}"
            if key in self._cache:
                return torch.full((heads,), self._cache[key] / heads, dtype=torch.float64)
        run()  # warm-up (compiles on first use)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.reps):
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        total = sorted(times)[len(times) // 2] + (1e3 * build_s if pattern in DYNAMIC else 0.0)
        if key is not None:
            self._cache[key] = total
            self._write()
        return torch.full((heads,), total / heads, dtype=torch.float64)


def cost_model_for(device: torch.device | str) -> CostModel:
    if not str(device).startswith("cuda"):
        return AnalyticCost()
    return MeasuredCost(device_name=torch.cuda.get_device_name(torch.device(device)))
