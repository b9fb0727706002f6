"""Sweep launch configs of the triangle tail's split-K pass (kernels/triangle.tail_attention) on one GPU, bf16.

    python benchmarks/tune_tail.py --heads 4 --kv-heads 1 --dim 256 --n 8192 32768 --last 128 512 2048

Per length and tail, the default launch (``triangle.tail_config``) first, then every (BLOCK_M, TILE_N, num_warps,
num_stages) that compiles: median time and efficiency against SDPA over the same rows (the tail's share of the
causal matrix x SDPA's full causal time / the tail's time; 1.0 = SDPA's per-element rate).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernels import bench
from benchmarks.tune_kernel import shape_args
from sparsesearch.kernels.triangle import tail_attention, tail_config


def tail_share(n: int, last: int) -> float:
    """The last ``last`` causal rows' entries over the causal matrix's n (n + 1) / 2."""
    rows = min(last, n)
    return (rows * n - rows * (rows - 1) / 2) / (n * (n + 1) / 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[32768])
    parser.add_argument("--last", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--block-m", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--tile", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    shape_args(parser)
    args = parser.parse_args()
    for n in args.n:
        torch.manual_seed(n)
        q = torch.randn(1, args.heads, n, args.dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, args.kv_heads, n, args.dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        print(f"N {n} SDPA {t_sdpa:.3f} ms", flush=True)
        for last in args.last:
            share = tail_share(n, last)
            default = tail_config(last, args.dim, False)
            configs = [None] + [{"BLOCK_M": m, "TILE_N": t, "num_warps": w, "num_stages": s}
                                for m, t, w, s in itertools.product(args.block_m, args.tile, args.warps, args.stages)]
            for cfg in configs:
                try:
                    tail_attention(q, k, v, last, config=cfg)
                    t = bench(lambda: tail_attention(q, k, v, last, config=cfg), warmup_ms=20, rep_ms=100)
                except Exception as exc:  # out of shared memory etc.
                    print(f"N {n} last {last} {cfg} failed: {type(exc).__name__}", flush=True)
                    continue
                label = f"default {default}" if cfg is None else str(cfg)
                print(f"N {n:6d} last {last:5d} share {share:.4f} {label}: {t:8.4f} ms eff {share * t_sdpa / t:.3f}", flush=True)


if __name__ == "__main__":
    main()
