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


class MeasuredCost:
    kind = "measured"

    def __init__(self, cache_path: Path | None = None, reps: int = 5):
        self.reps = reps
        self.cache_path = cache_path or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparsesearch" / "costs.json"
        self._cache = self._read()

    def _read(self) -> dict:
        try:
            return json.loads(self.cache_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _write(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._cache, sort_keys=True))
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
    return MeasuredCost() if str(device).startswith("cuda") else AnalyticCost()
