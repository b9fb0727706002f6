"""Sweep launch configs of the block-sparse kernel on one GPU (bf16, 32 heads, 8 KV heads, d=128).

    python benchmarks/tune_kernel.py --n 32768

Prints TFLOP/s per computed element for an all-causal-blocks index (compare with SDPA directly) and a
25%-density block top-k index, for every (TILE_N, num_warps, num_stages) that compiles.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernels import bench, computed_density
from sparsesearch.kernels import block_sparse_attention
from sparsesearch.patterns import block_topk, dense


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--block", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    n, heads, kv_heads, dim = args.n, 32, 8, 128
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
    flops = 4 * n * n / 2 * dim * heads
    print(f"SDPA {t_sdpa:.3f} ms {flops / t_sdpa / 1e9:.0f} TFLOP/s")
    for block in args.block:
        indices = {
            "dense": dense.build_index(dense.DenseParams(), n, heads=kv_heads, block_m=block, block_n=block, head_space="kv", device="cuda"),
            "topk25": block_topk.build_index(block_topk.BlockTopKParams(k_blocks=max(1, round(0.25 * n / block / 2))), q, k, head_space="kv", block_m=block, block_n=block),
        }
        for name, index in indices.items():
            dens = computed_density(index, n)
            for tile_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4)):
                if tile_n > block:
                    continue
                cfg = {"TILE_N": tile_n, "num_warps": warps, "num_stages": stages}
                try:
                    block_sparse_attention(q, k, v, index, config=cfg)
                    t = bench(lambda: block_sparse_attention(q, k, v, index, config=cfg), warmup_ms=20, rep_ms=100)
                except Exception as exc:  # out of shared memory etc.
                    print(f"block {block} {name} {cfg} failed: {type(exc).__name__}")
                    continue
                print(f"block {block:3d} {name:7s} dens {dens:.3f} tile {tile_n:3d} w{warps} s{stages}: {t:7.3f} ms "
                      f"eff {dens * t_sdpa / t:.3f} ({dens * flops / t / 1e9:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
