"""Where the block-sparse kernel's time goes at low density: a per-program fixed cost and a per-tile cost.

    python -m benchmarks.program_cost --n 32768 --k-blocks 1 2 4 8 12 24 48 96

Block top-k indexes (64 x 64 blocks, kv head space, 32 query / 8 KV heads, d=128, bf16) give every query block
about the same number of key blocks, so the kernel's time is close to linear in tiles per row:
t = fixed + per_tile x tiles. Two more indexes isolate the intercept: "diag_only" keeps each row's partial
(diagonal) block and no full one, "null" lists nothing (a program loads Q, stores O and lse, and leaves). Each
launch config (``--config``, JSON objects of launch overrides on top of the device's own; on Hopper that default
is the warp-specialized kernel, ``{"ws": false}`` times the Triton one) is replayed from a CUDA
graph; the configs of a case alternate in one loop (benchmarks/timing.py), L2 flushed before each call. SDPA gets
its own loop once per length: right after a full-power SDPA call (250 ms at 128K) the next call runs 10-23%
slower, so pairing each call with SDPA would charge that to whichever config follows it (RESULTS.md, Run 13).

The fit (least squares over the top-k rows with at least ``--fit-from`` tiles per row) reports the fixed cost in
the same unit as SDPA's per-tile time: "fixed 6.5 tiles" means each program costs as much, before its first key
tile, as 6.5 tiles of SDPA's work. Efficiency at d tiles per row is then at most d / (fixed + d x per_tile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kernels import computed_density
from benchmarks.rows import emit, write_jsonl
from benchmarks.timing import cuda_clock, graphed, interleaved_ms, l2_flush


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points; ValueError below two distinct x."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs at least two distinct x values, got {xs}")
    mx = sum(xs) / len(xs)
    my = sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def sdpa_tile_us(sdpa_ms: float, n: int, block: int) -> float:
    """SDPA's time per (query block, key block) tile of a causal row, averaged: the unit of the fit.
    A causal row crosses (q_blocks + 1) / 2 key blocks on average."""
    q_blocks = -(-n // block)
    return sdpa_ms * 1e3 / ((q_blocks + 1) / 2)


def cases(q, k, k_blocks: list[int], block: int) -> dict:
    """name -> index: block top-k per k_blocks, plus diag_only and null (from the smallest top-k's lists)."""
    from sparsesearch.kernels.dynamic_index import block_topk_build
    from sparsesearch.patterns import block_topk

    out = {}
    for kb in k_blocks:
        out[f"topk_kb{kb}"] = block_topk_build(
            block_topk.BlockTopKParams(k_blocks=kb, sink_blocks=1), q, k, head_space="kv", block_m=block, block_n=block)
    first = out[f"topk_kb{min(k_blocks)}"]
    zero = torch.zeros_like(first.full_count)
    out["diag_only"] = dataclasses.replace(first, full_count=zero)
    out["null"] = dataclasses.replace(first, full_count=zero, partial_count=zero.clone())
    return out


def gqa_inputs(n: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random bf16 q [1, heads, n, dim], k/v [1, kv_heads, n, dim] on the GPU: the shapes these benchmarks
    time (32/8 heads at d 128 by default, an 8B model's)."""
    torch.manual_seed(n)
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def sdpa_alone_ms(q, k, v, clock, flush) -> float:
    """Causal GQA SDPA replayed from a graph in its own loop (not paired with the kernels: Run 13)."""
    sdpa = graphed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    return interleaved_ms([sdpa], clock=clock, flush=flush).ms[0]


def run(args) -> list[dict]:
    from sparsesearch.kernels import block_sparse_attention
    from sparsesearch.kernels.block_sparse import _launch_config

    clock, flush = cuda_clock(), l2_flush()
    configs = [json.loads(c) for c in args.config] if args.config else [None]
    command = "python -m benchmarks.program_cost " + " ".join(sys.argv[1:])
    device = torch.cuda.get_device_name()
    rows = []
    for n in args.n:
        q, k, v = gqa_inputs(n)
        sdpa_ms = sdpa_alone_ms(q, k, v, clock, flush)
        for name, index in cases(q, k, args.k_blocks, args.block).items():
            tiles = (index.full_count + index.partial_count).float().mean().item()
            density = computed_density(index, n)
            # --config objects override the device's own launch config (a bare one would drop TILE_N and TMA).
            base = _launch_config(args.block, args.block, q.shape[-1], q.device)
            fns = [graphed(lambda c=c: block_sparse_attention(q, k, v, index, config=None if c is None else {**base, **c}))
                   for c in configs]
            timed = interleaved_ms(fns, clock=clock, flush=flush)
            for c, ms in zip(configs, timed.ms):
                rows += emit([{
                    "bench": "program_cost", "device": device, "n": n, "block": args.block, "case": name,
                    "config": c, "tiles_per_row": round(tiles, 3), "density": round(density, 5),
                    "us": round(ms * 1e3, 1), "sdpa_ms": round(sdpa_ms, 3),
                    "efficiency": round(density * sdpa_ms / ms, 4) if density else None, "reps": timed.reps,
                }], command)
    return rows


def summarize(rows: list[dict], fit_from: float) -> list[dict]:
    """Per (n, config): the line fit over top-k rows, in SDPA tiles (module docstring)."""
    out = []
    keys = sorted({(r["n"], json.dumps(r["config"])) for r in rows})
    for n, cfg in keys:
        mine = [r for r in rows if r["n"] == n and json.dumps(r["config"]) == cfg]
        unit = sum(sdpa_tile_us(r["sdpa_ms"], n, r["block"]) for r in mine) / len(mine)
        points = [(r["tiles_per_row"], r["us"]) for r in mine if r["case"].startswith("topk") and r["tiles_per_row"] >= fit_from]
        fixed, per_tile = fit_line(points)
        by_case = {r["case"]: r["us"] for r in mine}
        out.append({"n": n, "config": json.loads(cfg), "sdpa_tile_us": round(unit, 2),
                    "fixed_tiles": round(fixed / unit, 2), "per_tile_vs_sdpa": round(per_tile / unit, 3),
                    "null_tiles": round(by_case["null"] / unit, 2), "diag_only_tiles": round(by_case["diag_only"] / unit, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[32768])
    parser.add_argument("--k-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 12, 24, 48, 96])
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--config", nargs="*", default=[], help='launch overrides as JSON, e.g. \'{"pack": 1}\'')
    parser.add_argument("--fit-from", type=float, default=8.0, help="tiles per row below which top-k rows stay out of the fit")
    parser.add_argument("--out", type=str, default=None, help="write every row to this .jsonl")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("program_cost needs a CUDA device")
    rows = run(args)
    for s in summarize(rows, args.fit_from):
        print(json.dumps(s), flush=True)
    write_jsonl(None if args.out is None else Path(args.out), rows)


if __name__ == "__main__":
    main()
