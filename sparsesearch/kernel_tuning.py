"""Measure the Triton block-sparse kernel's launch configs on this GPU and record the fastest (kernels/launch_table.py).

For each (block, head_dim) asked for: random bf16 q/k/v of one prompt, a kv-space block top-k index at ``density`` of
the causal blocks (the pattern the search picks most at long lengths), every candidate config timed by
``triton.testing.do_bench`` (L2 flushed), and the fastest kept if its output matches the default config's and it
beats the default by MIN_GAIN. This is
what ``sparsesearch tune-kernels`` runs; later processes' launches on this GPU read the table.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .kernels import block_sparse_attention
from .kernels._common import interpreting
from .kernels.block_sparse import _device_config
from .kernels.dynamic_index import block_topk_build
from .kernels.launch_table import TUNED, candidates, config_key, default_path, fastest, write_configs
from .patterns import block_topk

BLOCKS = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
MATCH_TOL = 2e-2  # bf16 outputs of two configs over the same keys: the accumulation order differs, nothing else
# A candidate replaces the default only when this much faster: two tunings on one H200 put the same d-64 winner at
# 1.01x and 1.046x the default, so a smaller margin would record noise (benchmarks/RESULTS.md, tune-kernels).
MIN_GAIN = 0.03


def check_args(blocks: Sequence[int], head_dims: Sequence[int], tokens: int, heads: int, kv_heads: int,
               density: float) -> None:
    """ValueError naming the first bad value (before any GPU work)."""
    for block in blocks:
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    for dim in head_dims:
        if dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {dim}")
    if tokens < 4 * max(blocks):
        raise ValueError(f"tokens must be at least 4 blocks ({4 * max(blocks)}), got {tokens}")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")


def _timer(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def tune_one(block: int, head_dim: int, tokens: int, heads: int, kv_heads: int, density: float,
             device: torch.device, time_ms: Callable[[Callable[[], object]], float] = _timer) -> dict:
    """One (block, head_dim): every candidate's row, the default's and the fastest matching config."""
    gen = torch.Generator(device=device).manual_seed(tokens + block + head_dim)
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k_blocks = max(1, round(density * tokens / block / 2))
    index = block_topk_build(block_topk.BlockTopKParams(k_blocks=k_blocks), q, k, head_space="kv",
                             block_m=block, block_n=block)
    # The Triton kernel as the device runs it (TMA where it has it), with Hopper's warp-specialized kernel off: it
    # does not read the table.
    base = {key: val for key, val in _device_config(block, head_dim, device, interpreting(), tuned=False).items() if key != "ws"}

    def run(config: dict):
        return block_sparse_attention(q, k, v, index, config={**base, **config})[0]

    reference = run({})
    default = {name: base[name] for name in TUNED}

    def timed(config: dict) -> float:
        diff = (run(config).float() - reference.float()).abs().max().item()
        if not diff <= MATCH_TOL:  # also catches NaN
            raise ArithmeticError(f"output differs from the default config's by {diff:.3g}")
        return time_ms(lambda: run(config))

    best, rows = fastest(candidates(block, head_dim), timed)
    default_ms = next((r.get("ms") for r in rows if all(r[n] == default[n] for n in TUNED)), None)
    best_ms = None if best is None else next(r["ms"] for r in rows if all(r[n] == best[n] for n in TUNED))
    if best_ms is not None and default_ms is not None and best_ms * (1 + MIN_GAIN) > default_ms:
        best, best_ms = default, default_ms  # within noise of the default: keep it
    return {"key": config_key(block, head_dim), "block": block, "head_dim": head_dim, "k_blocks": k_blocks,
            "default": default, "default_ms": default_ms, "best": best, "best_ms": best_ms, "rows": rows}


def tune_launches(blocks: Sequence[int] = (64, 128), head_dims: Sequence[int] = (64, 128), tokens: int = 16384,
                  heads: int = 32, kv_heads: int = 8, density: float = 0.25, write: bool = True,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Tune every (block, head_dim) on the current CUDA device; record the fastest configs (``write``) in the launch
    table. Returns the device, the table's path and env, and one result per pair (tune_one)."""
    from .kernels.version import cache_env

    check_args(blocks, head_dims, tokens, heads, kv_heads, density)
    if not torch.cuda.is_available():
        raise ValueError("tune-kernels times kernels on a GPU, and torch sees no CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    results = []
    for block in blocks:
        for dim in head_dims:
            if progress:
                progress(f"block {block}, head_dim {dim}")
            results.append(tune_one(block, dim, tokens, heads, kv_heads, density, device))
    path, env = default_path(), cache_env(name)
    if write:
        write_configs(path, name, env, {r["key"]: r["best"] for r in results if r["best"] is not None})
    return {"device": name, "path": str(path), "written": write, "env": env, "tokens": tokens, "heads": heads,
            "kv_heads": kv_heads, "density": density, "results": results}
