"""Sweep launch configs of the block-sparse kernel on one GPU (bf16; 32 heads, 8 KV heads, d=128 unless told).

    python benchmarks/tune_kernel.py --n 32768 131072 --block 64 128 --density 0.05 0.1 0.25
    python benchmarks/tune_kernel.py --heads 4 --kv-heads 1 --dim 256 --n 8192 32768   # Gemma 3 270M's shape

Prints, per length, block size and index (all causal blocks, and block top-k at each requested density of
the causal blocks, kv head space as the runtime uses it), the time and efficiency (computed density x SDPA
time / kernel time, SDPA over the same q/k/v measured once per length) of every (TILE_N, num_warps,
num_stages, TMA loads of full tiles off/on, query heads stacked per program, gathered-column tile width,
vertical-slash columns from the column table or the lists) that compiles.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.kernels import bench, computed_density
from sparsesearch.kernels import block_sparse_attention
from sparsesearch.kernels.dynamic_index import block_topk_build
from sparsesearch.patterns import block_topk, dense, vertical_slash


def indices(q, k, n: int, block: int, densities: list[float], vs: list[str]) -> dict:
    """The dense index, one block top-k index per density (k_blocks = density x a causal row's mean blocks) and
    one planted vertical-slash index per "V,S" (V columns, the first 30 forced, and the S nearest diagonals, as
    benchmarks/kernels.py plants them; 64 x 64 blocks: the column gathers are what they measure)."""
    out = {"dense": dense.build_index(dense.DenseParams(), n, heads=k.shape[1], block_m=block, block_n=block, head_space="kv", device="cuda")}
    for d in densities:
        params = block_topk.BlockTopKParams(k_blocks=max(1, round(d * n / block / 2)))
        out[f"topk{round(d * 100)}"] = block_topk_build(params, q, k, head_space="kv", block_m=block, block_n=block)
    gen = torch.Generator().manual_seed(0)
    for spec in vs:
        n_vert, n_slash = (int(x) for x in spec.split(","))
        vert = torch.cat([torch.arange(30), 30 + torch.randperm(n - 30, generator=gen)[: n_vert - 30]]).sort().values
        lines = vertical_slash.VSLines(
            vertical=vert.cuda().expand(1, k.shape[1], -1).contiguous(),
            slash=torch.arange(n_slash, device="cuda").expand(1, k.shape[1], -1).contiguous(), q_len=n, kv_len=n, head_space="kv",
        )
        out[f"vs{n_vert}v{n_slash}s"] = vertical_slash.index_from_lines(lines, block_m=64, block_n=64)
    return out


def shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, nargs="+", default=[32768])
    parser.add_argument("--block", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--density", type=float, nargs="*", default=[0.25])
    parser.add_argument("--tile", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--tma", choices=["off", "on"], nargs="+", default=["off", "on"])
    parser.add_argument("--pack", type=int, nargs="+", default=[1], help="query heads of a GQA group per program")
    parser.add_argument("--col-tile", type=int, nargs="+", default=[0], help="gathered-column tile (0: TILE_N)")
    parser.add_argument("--vs", nargs="*", default=[], help="planted vertical-slash indexes, each 'V,S'")
    parser.add_argument("--col-table", choices=["off", "on"], nargs="+", default=["on"],
                        help="vertical-slash columns from the column table's slabs (on) or gathered from the lists (off)")
    shape_args(parser)
    args = parser.parse_args()
    heads, kv_heads, dim = args.heads, args.kv_heads, args.dim
    for n in args.n:
        torch.manual_seed(n)
        q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        flops = 4 * n * n / 2 * dim * heads
        print(f"N {n} SDPA {t_sdpa:.3f} ms {flops / t_sdpa / 1e9:.0f} TFLOP/s", flush=True)
        for block in args.block:
            for name, index in indices(q, k, n, block, args.density, args.vs).items():
                dens = computed_density(index, n)
                axes = itertools.product(args.tile, args.warps, args.stages, args.tma, args.pack, args.col_tile, args.col_table)
                for tile_n, warps, stages, tma, pack, col_tile, table in axes:
                    if tile_n > block or (table == "off" and index.col_table is None and len(args.col_table) > 1):
                        continue
                    cfg = {"TILE_N": tile_n, "num_warps": warps, "num_stages": stages, "tma": tma == "on", "pack": pack,
                           "COL_TILE": col_tile or tile_n, "col_table": table == "on"}
                    try:
                        block_sparse_attention(q, k, v, index, config=cfg)
                        t = bench(lambda: block_sparse_attention(q, k, v, index, config=cfg), warmup_ms=20, rep_ms=100)
                    except Exception as exc:  # out of shared memory etc.
                        print(f"N {n} block {block} {name} {cfg} failed: {type(exc).__name__}")
                        continue
                    print(f"N {n:6d} block {block:3d} {name:7s} dens {dens:.3f} tile {tile_n:3d} w{warps} s{stages} tma {tma:3s} pack {pack} cols {col_tile or tile_n} table {table}: "
                          f"{t:8.3f} ms eff {dens * t_sdpa / t:.3f} ({dens * flops / t / 1e9:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
