"""Cost of a candidate per head: measured kernel time on a GPU, an analytic FLOP model on a CPU.

Both answer the same question with the same interface, ``cost_ms(pattern, density, n, q, index, run,
build_s) -> float64 [H]`` (milliseconds per head), so the search prunes the same way everywhere:
- ``MeasuredCost`` times the candidate's kernel launch on the current GPU (``kernel_ms``: the GPU time of the
  kernels it launches, the profiler's device time, as ``sparsesearch pareto`` costs every point) plus its
  measured index build, split evenly over the launch's heads; results for static
  patterns are cached per (device, shape, pattern, density) in memory and in a JSON file. Every timed
  launch is also a point of its family's cost table (``CostTable``: pattern, heads, head_dim, dtype, tile
  shape, device): kernel time against what the launch does (full blocks, partial blocks, gathered columns,
  row programs). Once the nearest measured launches of its family surround a new launch and a linear fit
  through them explains them to within ``FIT_TOLERANCE``, the launch is priced from that fit instead of
  timed, so a search over regions of many lengths and densities (each a new shape) stops re-measuring
  (issue 14 §3). One line through a whole family did not fit (median error 4–15% on an H200 modal
  search, launch floors and tile effects bend it); the local fit, checked by leaving each measured launch
  out, priced half of them with median error 2% and 90th percentile 7%.
- ``AnalyticCost`` models the kernel as its computed elements at a nominal rate (4·D FLOPs per element)
  plus, for dynamic patterns, the last_q x N estimate; it is what a CPU run records, labelled modelled.
  A permuted modality region on a CPU is costed by its own entries (``analytic_ms``); on a GPU it is timed
  like any candidate (``n`` is then the region's key count).
"""

from __future__ import annotations

import atexit
import json
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..files import locked, write_json_atomic
from ..patterns._common import causal_entries
from ..patterns.registry import REGISTRY
from ..user_cache import user_cache_dir

NOMINAL_FLOPS = 400e12  # a Hopper-class GPU at the kernel efficiency benchmarks/RESULTS.md measures
# Patterns whose runtime index is estimated per call (grid is not: an estimated stride is a search-time
# cost, stored in the params; the registry's DYNAMIC fact).
DYNAMIC = tuple(name for name, module in REGISTRY.items() if module.DYNAMIC)
ESTIMATE_ROWS = 64
FIT_TOLERANCE = 0.10  # the local fit's largest relative error on its own points before it may price a launch
NEIGHBOURS = 12  # measured launches nearest the new one that the local fit uses (5 coefficients)
MAX_POINTS = 2048  # points kept per family (the newest): the fit stays cheap and the file small
WRITE_EVERY_S = 10.0  # the cache file is rewritten at most this often while measuring (and at exit)
# How MeasuredCost times a launch, part of its cache stamp: times taken otherwise (CUDA events around the call,
# before Run 37) are not trusted.
TIMING = "profiler device time"
KERNEL_REPS = 10
KERNEL_WARMUP = 3


class CostModel(Protocol):
    kind: str

    def cost_ms(self, pattern: str, density: torch.Tensor, n: int, q: torch.Tensor, index, run: Callable[[], None], build_s: float,
                build: Callable[[], object] | None = None) -> torch.Tensor: ...


def analytic_ms(pattern: str, entries: torch.Tensor, dim: int, kv_len: int) -> torch.Tensor:
    """Modelled milliseconds per head: computed entries x 4·D FLOPs at NOMINAL_FLOPS, plus the last-queries
    estimate (ESTIMATE_ROWS x kv_len) for dynamic patterns. entries: float64 [H]."""
    per_head = entries.double() * 4 * dim / NOMINAL_FLOPS * 1e3
    if pattern in DYNAMIC:
        per_head = per_head + 2 * ESTIMATE_ROWS * kv_len * dim / NOMINAL_FLOPS * 1e3
    return per_head


class AnalyticCost:
    kind = "analytic"

    def cost_ms(self, pattern, density, n, q, index, run, build_s, build=None) -> torch.Tensor:
        return analytic_ms(pattern, density.double() * causal_entries(n), q.shape[-1], n)


def launch_features(index) -> list[float] | None:
    """What a block-sparse launch does, as the cost table's regressors: [1, full blocks, partial blocks,
    gathered columns in blocks of block_n, row programs]; None for an index that is not a BlockIndex."""
    if not all(hasattr(index, name) for name in ("full_count", "partial_count", "block_n")):
        return None
    cols = 0.0 if index.col_count is None else float(index.col_count.sum()) / index.block_n
    return [1.0, float(index.full_count.sum()), float(index.partial_count.sum()), cols, float(index.full_count.numel())]


class CostTable:
    """Measured (features, ms) points per launch family, and local least-squares lines through them.

    ``predict`` answers only inside what was measured: a launch measured before is priced at its own
    measured time (dynamic patterns have no exact key, so this is what makes a warm cache time nothing
    twice: the H200 modal search re-timed 816 of 987 launches before it); otherwise the NEIGHBOURS launches nearest the query (features
    scaled to the family's range) must surround it in every feature (interpolation, never extrapolation),
    and the line through them must explain each of them to within FIT_TOLERANCE; otherwise None (the
    caller times the launch and ``add``s it)."""

    def __init__(self, points: dict | None = None):
        self.points: dict[str, list[list[float]]] = points or {}
        self.unsaved: dict[str, list[list[float]]] = {}  # points added since the last write, per family

    def add(self, family: str, features: list[float], ms: float) -> None:
        for table in (self.points, self.unsaved):
            rows = table.setdefault(family, [])
            rows.append([*features, ms])
            del rows[:-MAX_POINTS]

    def merged(self, stored: dict) -> dict[str, list[list[float]]]:
        """What to write: ``stored`` (the points in the cache file now, which another process may have extended
        since this one read it) plus the points added here since the last write, the newest MAX_POINTS per
        family, so concurrent writers keep each other's measurements."""
        merged = {family: list(rows) for family, rows in stored.items()}
        for family, rows in self.unsaved.items():
            merged[family] = [*merged.get(family, []), *rows][-MAX_POINTS:]
        return merged

    def saved(self, points: dict[str, list[list[float]]]) -> None:
        """After a write: the file holds ``points``; they are this table's now, and nothing is unsaved. (Only
        after: a failed write keeps the unsaved points for the next merge.)"""
        self.points, self.unsaved = points, {}

    def predict(self, family: str, features: list[float]) -> float | None:
        rows = self.points.get(family, [])
        if not rows:
            return None
        data = torch.tensor(rows, dtype=torch.float64)
        want = torch.tensor(features, dtype=torch.float64)
        same = (data[:, :-1] == want).all(dim=1)
        if bool(same.any()):  # this very launch was measured (a warm cache): its median time, no fit
            return float(data[same, -1].median())
        if len(rows) < NEIGHBOURS:
            return None
        lo, hi = data[:, :-1].min(0).values, data[:, :-1].max(0).values
        near = ((data[:, :-1] - want) / (hi - lo).clamp(min=1e-9)).norm(dim=1).argsort()[:NEIGHBOURS]
        x, y = data[near, :-1], data[near, -1]
        if bool(((want < x.min(0).values) | (want > x.max(0).values)).any()):
            return None
        scale = x.abs().max(0).values.clamp(min=1e-9)  # block counts run to 1e5, the intercept is 1
        coef = torch.linalg.lstsq(x / scale, y[:, None], driver="gelsd").solution[:, 0] / scale
        fit = x @ coef
        if bool(((fit - y).abs() > FIT_TOLERANCE * y.abs()).any()):
            return None
        got = float(want @ coef)
        return got if got > 0 else None


def kernel_ms(fn: Callable[[], None], reps: int = KERNEL_REPS, warmup: int = KERNEL_WARMUP) -> float:
    """GPU time of the kernels one call of ``fn`` launches (ms, mean of ``reps`` calls after ``warmup``): the
    device time the profiler records, summed. Host time between launches is not counted: a short call is
    launch-bound, and its wall time would measure Python and the launch queue, not attention (at 8K on an
    H200 SmolLM2's SDPA call is ~0.05 ms of GPU time inside ~0.5 ms of wall time). 0.0 when the profiler
    saw no device activity (no CUDA, or no CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(_device_us(e) for e in prof.key_averages())
    return total_us / reps / 1e3


def _device_us(event) -> float:
    """An averaged profiler event's own device time (µs); the attribute was renamed in torch 2.4."""
    value = getattr(event, "self_device_time_total", None)
    return float(value if value is not None else getattr(event, "self_cuda_time_total", 0.0))


def _flush_if_alive(ref: weakref.ref) -> None:
    cost = ref()
    if cost is not None:
        cost.flush()


class MeasuredCost:
    """Times are cached per (device name, shape, pattern, density) in a JSON file stamped with
    ``kernels.version.cache_env(device_name)``, with the cost table's points beside them; a file stamped
    otherwise (another install, older kernels, another GPU) or unreadable is ignored with a warning and
    replaced on the next write, never trusted. ``timed`` / ``priced`` count launches measured and launches
    the table priced; ``interpolate=False`` times every launch the exact keys miss (the table still learns).

    Several processes may share the file (two ``calibrate`` runs on one machine): each write merges this
    process's measurements into what the file holds now, under the file's lock, and writes it whole, so no
    process loses another's entries and no reader sees half a file (``sparsesearch.files``)."""

    kind = "measured"

    def __init__(self, cache_path: Path | None = None, reps: int = 5, device_name: str | None = None, interpolate: bool = True):
        self.reps, self.interpolate = reps, interpolate
        self.cache_path = cache_path or user_cache_dir() / "costs.json"
        # imported here, not at the top: the kernels package loads Triton and every kernel, and the search
        # imports this module also where it only prices with AnalyticCost and never takes a stamp
        from ..kernels.version import cache_env

        self.env = {**cache_env(device_name), "timing": TIMING}
        stored = self._read()
        self._cache = stored.get("costs", {})
        self.table = CostTable(stored.get("points") if isinstance(stored.get("points"), dict) else None)
        self.timed = self.priced = 0
        # rewriting a file of thousands of points after every launch cost seconds per search (H200 modal run)
        self._dirty, self._written = False, time.monotonic()
        # At exit, flush whatever is still alive: a weak reference, so the registration does not keep every
        # instance (and its table) alive for the life of the process; the search flushes at its end anyway.
        atexit.register(_flush_if_alive, weakref.ref(self))

    def _read(self) -> dict:
        """The cache file's content when this install may trust it, else {} (with a warning unless missing)."""
        stored, why = self._load()
        if why is not None:
            warnings.warn(f"ignoring cost cache {self.cache_path}: {why}", stacklevel=3)
        return stored or {}

    def _load(self) -> tuple[dict | None, str | None]:
        """(the cache file's content when stamped with this install's env, else None; why it is not trusted,
        None when it is or the file is missing)."""
        try:
            stored = json.loads(self.cache_path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, json.JSONDecodeError) as exc:
            return None, f"unreadable ({exc.__class__.__name__})"
        env = stored.get("env") if isinstance(stored, dict) else None
        if env != self.env or not isinstance(stored.get("costs"), dict):
            return None, f"measured with {env or 'an unstamped version'}, this install is {self.env}"
        return stored, None

    def _payload(self, costs: dict, points: dict) -> dict:
        """The file's layout, stamped with this install's env."""
        return {"env": self.env, "costs": costs, "points": points}

    def _write(self) -> None:
        """Merge into the cache file and write it (class docstring): what it holds now (written by another process
        since this one read it, perhaps) and what was measured here, this process's times winning a shared key.
        A file this install may not trust is replaced by this process's cache."""
        with locked(self.cache_path):
            stored, _ = self._load()
            costs, points = self._merged(stored)
            write_json_atomic(self.cache_path, self._payload(costs, points), sort_keys=True)
        self._cache = costs
        self.table.saved(points)

    def _merged(self, stored: dict | None) -> tuple[dict, dict]:
        """(exact-key costs, table points) to write over ``stored`` (the trusted file content, or None)."""
        if stored is None:
            return self._cache, self.table.points
        points = stored.get("points")
        return {**stored["costs"], **self._cache}, self.table.merged(points if isinstance(points, dict) else {})

    def save_to(self, path: Path) -> None:
        """A copy of the cache beside an artifact (the same stamped layout: load it with cache_path=path); the
        artifact's own file, so written whole without merging into what was there."""
        write_json_atomic(path, self._payload(self._cache, self.table.points), sort_keys=True)

    def flush(self) -> None:
        """Write what was measured since the last write (the search calls it at the end; also at exit)."""
        if self._dirty:
            self._write()
            self._dirty, self._written = False, time.monotonic()

    def cost_ms(self, pattern, density, n, q, index, run, build_s, build=None) -> torch.Tensor:
        """The launch's kernel time plus, for a dynamic pattern (whose runtime builds its index every call), its index
        build: ``build`` timed like the launch (device time) when given, else the search's own wall time ``build_s``."""
        heads = density.numel()
        name = torch.cuda.get_device_name(q.device)
        key = None
        if pattern not in DYNAMIC:
            key = f"{name}|{tuple(q.shape)}|{n}|{q.dtype}|{pattern}|{float(density.sum()):.6f}|{index.block_m}x{index.block_n}"
            if key in self._cache:
                return torch.full((heads,), self._cache[key] / heads, dtype=torch.float64)
        features = launch_features(index)
        family = None if features is None else f"{name}|{pattern}|{q.shape[1]}x{q.shape[-1]}|{q.dtype}|{index.block_m}x{index.block_n}"
        launch_ms = self.table.predict(family, features) if family is not None and self.interpolate else None
        if launch_ms is None:
            launch_ms = self._time(run)
            self.timed += 1
            if family is not None:
                self.table.add(family, features, launch_ms)
                self._dirty = True
        else:
            self.priced += 1
        total = launch_ms + (self._build_ms(build, build_s) if pattern in DYNAMIC else 0.0)
        if key is not None:
            self._cache[key] = total
            self._dirty = True
        if time.monotonic() - self._written > WRITE_EVERY_S:
            self.flush()
        return torch.full((heads,), total / heads, dtype=torch.float64)

    def _build_ms(self, build: Callable[[], object] | None, build_s: float) -> float:
        """A dynamic index build's price: its kernels' device time (the search's wall time of it counted Python and
        host syncs: RESULTS Run 1 shows 1.4-1.5 ms of index time for block top-k at 8K, as much as its kernel)."""
        return self._time(build) if build is not None else 1e3 * build_s

    def dense_ms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_space: str, scale: float) -> torch.Tensor:
        """float64 [H] ms per head of the head space of what the runtime runs for dense heads: torch's causal SDPA
        over the layer (execute.dense_heads), timed once per (device, shapes, dtype) and cached with the patterns.
        q [1, Hq, N, D], k/v [1, Hkv, N, D]. Not our kernel on an all-causal index: dense heads never run through
        it, and at head_dim 256 it runs at ~0.7 of SDPA's rate (benchmarks/RESULTS.md, Run 34)."""
        import torch.nn.functional as F

        heads = k.shape[1] if head_space == "kv" else q.shape[1]
        key = f"{torch.cuda.get_device_name(q.device)}|{tuple(q.shape)}|{tuple(k.shape)}|{q.dtype}|sdpa"
        if key not in self._cache:
            gqa = q.shape[1] != k.shape[1]
            self._cache[key] = self._time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))
            self.timed += 1
            self._dirty = True
        return torch.full((heads,), self._cache[key] / heads, dtype=torch.float64)

    def mix_ms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_space: str, scale: float) -> float:
        """ms a layer pays on top of its heads' own prices when it mixes sparse and dense heads: the runtime's
        call (runtime/run.py: one sparse launch over the first half of the head space's heads, SDPA over the
        rest) minus what per-head prices add up to for it (that launch's share of one over every head, plus the
        other heads' SDPA shares), at >= 0. q [1, Hq, N, D], k/v [1, Hkv, N, D]; 0 where the head space has one
        head (a layer cannot mix).

        Per-head prices alone made a layer with one sparse head among dense ones look cheaper than dense when it
        cost more: Gemma 3 on an H200, 16K-32K, 0.25-0.55 ms more than the sum (benchmarks/mixed_layer.py), so
        the allocation sparsified single heads of layers 5 and 11 for KL and no saving. One A-shape stands for
        every candidate. Its window is a quarter of the length and it covers half the heads: the extra grows with
        the sparse launch's width and its head count (Run 36's rows at 16K: 0.105 / 0.145 / 0.138 ms for 1 / 2 / 3
        of 4 heads on a 2048 window, 0.168 / 0.193 / 0.160 on 6144), and one head on 64/512 measured 0.081 where
        Run 40's layer of two heads on 4096 windows paid 0.21."""
        from ..execute import HeadGroup, dense_heads, device_ids, query_heads, sparse_attend, static_index

        heads = k.shape[1] if head_space == "kv" else q.shape[1]
        if heads < 2:
            return 0.0
        key = _layer_key(q, k, head_space, "mix-half")
        if key not in self._cache:
            n, group, half = q.shape[2], q.shape[1] // k.shape[1], heads // 2
            out, lse = _out_buffers(q)
            params = _quarter_ashape(n)
            g_all = HeadGroup("ashape", params, tuple(range(heads)), 64, 64)
            g_half = HeadGroup("ashape", params, tuple(range(half)), 64, 64)
            index_all, index_half = (static_index(g, n, n, head_space, q.device) for g in (g_all, g_half))
            ids_all, ids_half = (device_ids(g.heads, q.device, torch.int32) for g in (g_all, g_half))
            rest = [h for h in range(q.shape[1]) if h not in query_heads(g_half.heads, head_space, group)]

            def mixed() -> None:
                sparse_attend(q, k, v, index_half, scale, ids_half, out, lse)
                dense_heads(q, k, v, rest, scale, out)

            sparse_all = self._time(lambda: sparse_attend(q, k, v, index_all, scale, ids_all, out, lse))
            sdpa = float(self.dense_ms(q, k, v, head_space, scale).sum())
            self._cache[key] = max(0.0, self._time(mixed) - (half * sparse_all + (heads - half) * sdpa) / heads)
            self.timed += 1
            self._dirty = True
        return self._cache[key]

    def split_ms(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_space: str, scale: float) -> float:
        """ms a layer pays for each sparse launch past its first: one launch per head of the head space minus one
        launch over them all, over (H - 1), at >= 0. q [1, Hq, N, D], k/v [1, Hkv, N, D]; 0 where the head space
        has one head.

        A candidate's price is its launch over every head divided among them, but the runtime runs heads on
        different candidates as separate launches (runtime/plan.py groups), each with its own fixed price and a
        grid of fewer programs: per-head shares priced Gemma 3's layer 11 at 16K, on three A-shape windows, at
        0.75 ms where it ran 0.96 and SDPA takes 0.92 (RESULTS Run 39). One A-shape at a quarter of the length
        stands for every candidate: wide enough that the grid's tail counts, not only the launch."""
        from ..execute import HeadGroup, device_ids, sparse_attend, static_index

        heads = k.shape[1] if head_space == "kv" else q.shape[1]
        if heads < 2:
            return 0.0
        key = _layer_key(q, k, head_space, "split")
        if key not in self._cache:
            n = q.shape[2]
            out, lse = _out_buffers(q)
            params = _quarter_ashape(n)
            groups = [HeadGroup("ashape", params, tuple(range(heads)), 64, 64)]
            groups += [HeadGroup("ashape", params, (h,), 64, 64) for h in range(heads)]
            launches = [(static_index(g, n, n, head_space, q.device), device_ids(g.heads, q.device, torch.int32)) for g in groups]
            run = lambda index, ids: sparse_attend(q, k, v, index, scale, ids, out, lse)

            def apart() -> None:
                for index, ids in launches[1:]:
                    run(index, ids)

            together = self._time(lambda: run(*launches[0]))
            self._cache[key] = max(0.0, (self._time(apart) - together) / (heads - 1))
            self.timed += 1
            self._dirty = True
        return self._cache[key]

    def _time(self, run: Callable[[], None]) -> float:
        """ms of GPU time one call of ``run`` launches (``kernel_ms``, over ``reps`` calls after one warm-up, which
        compiles on first use): the quantity ``sparsesearch pareto`` judges points by. CUDA events around each call
        counted the host's gaps between launches too, which at SmolLM2's 8K layer (~0.07 ms of kernels) priced every
        A-shape at ~0.23 ms, as much as SDPA, so the search left 69 of 90 heads dense where one A-shape on every
        head cost 0.32 of dense (RESULTS Run 37). Events only where the profiler sees no device time."""
        ms = kernel_ms(run, reps=self.reps, warmup=1)
        return ms if ms > 0 else _event_ms(run, self.reps)


def _layer_key(q: torch.Tensor, k: torch.Tensor, head_space: str, price: str) -> str:
    """The cache key of a per-layer price (``mix-half``, ``split``) at this device, shape and head space."""
    return f"{torch.cuda.get_device_name(q.device)}|{tuple(q.shape)}|{tuple(k.shape)}|{q.dtype}|{head_space}|{price}"


def _quarter_ashape(n: int):
    """The A-shape that stands for every candidate in the per-layer prices: sink 64, a window a quarter of the
    length (whole 64-blocks), wide enough that the grid's tail counts, not only the launch."""
    from ..patterns.ashape import AShapeParams

    return AShapeParams(sink=64, local=max(64, n // 4 // 64 * 64))


def _out_buffers(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output [1, Hq, N, D] laid out as the model's [1, N, Hq, D] (what the runtime writes into) and an lse
    [1, Hq, N] float32, for timing launches that write them."""
    out = torch.empty(1, q.shape[2], q.shape[1], q.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    return out, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


def _event_ms(run: Callable[[], None], reps: int) -> float:
    """Median ms between CUDA events around each of ``reps`` calls (after a warm-up): host gaps included."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cost_model_for(device: torch.device | str) -> CostModel:
    if not str(device).startswith("cuda"):
        return AnalyticCost()
    return MeasuredCost(device_name=torch.cuda.get_device_name(torch.device(device)))
