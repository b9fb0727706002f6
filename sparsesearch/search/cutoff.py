"""The dense cut-off, measured: the prompt length below which dense SDPA beats index build + sparse kernel.

Sparse attention pays a fixed price per call (index build, launch, for dynamic patterns the last-queries
estimate) that only long prompts earn back, so the runtime runs dense below ``min_tokens``. Instead of a
guessed constant, ``measure_cutoff`` times both paths on the current device at a ladder of lengths with
the model's head shape and the artifact's own most frequent sparse pattern (the one most heads run), and
``min_tokens`` is the shortest length from which sparse is faster at every measured length above it.

Both paths are the ones the runtime takes: SDPA (torch, causal, GQA without repeating K/V) for dense, and
the runtime's ``execute.StaticIndexCache.index`` + ``execute.sparse_attend`` for sparse — a static index
built once per shape, a dynamic one rebuilt per call (from a CUDA-graph replay up to graphed.MAX_TOKENS, 16K) —
on the Triton kernel on a GPU, the index-driven torch backend on a CPU (so a CPU's cut-off is the torch
backend's, and is usually "never").
Timing: median of ``reps`` calls after one warm-up, CUDA-synchronised on a GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..artifacts.columns import is_global, params_from_row
from ..execute import HeadGroup, StaticIndexCache, sparse_attend

LADDER = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def ladder(max_tokens: int) -> list[int]:
    """Lengths of LADDER up to max_tokens, plus max_tokens itself when it is not on it (>= 1 length)."""
    out = [n for n in LADDER if n <= max_tokens]
    return out if out and out[-1] == max_tokens else out + [max_tokens]


def representative_group(rows: list[dict], heads: int) -> HeadGroup | None:
    """The (pattern, params, blocks) most global sparse rows share, as a group over every head (None when
    every row is dense): one launch over all heads, as the runtime's largest group would run."""
    keys = Counter()
    for r in rows:
        if is_global(r) and r["pattern"] != "dense":
            keys[(r["pattern"], params_from_row(r), int(r["block_m"]), int(r["block_n"]))] += 1
    if not keys:
        return None
    (pattern, params, bm, bn), _ = keys.most_common(1)[0]
    return HeadGroup(pattern, params, tuple(range(heads)), bm, bn)


def _median_ms(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: compiles kernels, fills caches
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_paths(group: HeadGroup, n: int, *, num_heads: int, num_kv_heads: int, head_dim: int, head_space: str,
               dtype: torch.dtype, device: torch.device, reps: int = 3, seed: int = 0) -> tuple[float, float]:
    """(dense_ms, sparse_ms) of one layer's prefill attention at length n: q [1, num_heads, n, head_dim],
    k/v [1, num_kv_heads, n, head_dim] random (timing depends on the index, not on the values, except for
    dynamic patterns' estimates, whose cost is the same work for any values)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(1, num_kv_heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(1, num_kv_heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    gqa = num_heads // num_kv_heads > 1
    ids = torch.tensor(group.heads, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=device)

    def dense():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    indices = StaticIndexCache()  # the warm-up call builds (static) or captures (dynamic on a GPU), as a first prompt does

    def sparse():
        sparse_attend(q, k, v, indices.index(group, q, k, head_space), scale, ids, out, lse)

    with torch.no_grad():
        return _median_ms(dense, device, reps), _median_ms(sparse, device, reps)


def measure_cutoff(rows: list[dict], info, *, head_space: str, max_tokens: int, dtype: torch.dtype,
                   device: torch.device | str, reps: int = 3) -> dict:
    """The cut-off record (plain data, the manifest's ``methods.mminference.dense_cutoff``): device, the
    pattern timed, per ladder length dense_ms and sparse_ms, and min_tokens — the shortest ladder length
    from which sparse is faster at every longer measured length, or None when sparse never was (the
    runtime then runs dense up to ``measured_up_to`` and sparse only beyond what was measured)."""
    device = torch.device(device)
    heads = info.num_kv_heads if head_space == "kv" else info.num_heads
    group = representative_group(rows, heads)
    record = {"device": _device_name(device), "backend": "triton" if device.type == "cuda" else "torch",
              "dtype": str(dtype).removeprefix("torch."), "reps": reps, "measured_up_to": max_tokens}
    if group is None:
        return {**record, "pattern": None, "points": [], "min_tokens": None,
                "note": "every head is dense: nothing sparse to time"}
    points = []
    for n in ladder(max_tokens):
        dense_ms, sparse_ms = time_paths(group, n, num_heads=info.num_heads, num_kv_heads=info.num_kv_heads,
                                         head_dim=info.head_dim, head_space=head_space, dtype=dtype, device=device, reps=reps)
        points.append({"tokens": n, "dense_ms": round(dense_ms, 4), "sparse_ms": round(sparse_ms, 4)})
    return {**record, "pattern": {"name": group.pattern, **asdict(group.params)}, "points": points,
            "min_tokens": cutoff_from(points)}


def cutoff_from(points: list[dict]) -> int | None:
    """The shortest measured length from which sparse_ms < dense_ms at it and every longer point; None when
    the longest point itself is not faster sparse."""
    found = None
    for p in reversed(sorted(points, key=lambda p: p["tokens"])):
        if p["sparse_ms"] >= p["dense_ms"]:
            break
        found = p["tokens"]
    return found


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
