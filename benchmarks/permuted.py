"""Permutation read in place (issue 14): the block-sparse kernel reading a grid by index arithmetic or a
modality region through int32 row/col maps vs the same kernel without them at equal density vs the
gathered-copy path (regions) or the plain block cover (grid), with SDPA timed next to every case.

Cases: a grid head (patterns/grid.py build_lines_index, see ``grid_rows``) and the regions of a fragmented video/text prompt (Q-boundary rows video x all keys, 2D intra
video x video, 2D cross text x video) with an A-shape index in the region frame. For each case:

* ``t_ours_ms``     the kernel reading Q/K/V in place through the maps (index.RegionMaps: the full blocks
                    that are one run of a modality's consecutive keys load as plain tiles, after a small
                    pass that re-addresses them, kernels/region_runs.py, timed inside), O/lse stored in
                    original rows;
* ``t_plain_ms``    the same BlockIndex (same block lists: equal density, equal tiles) without maps, on
                    tensors of the region's size (copies made outside the timing) — the target is
                    t_ours <= 1.10 x t_plain (``overhead`` = t_ours / t_plain - 1);
* ``t_no_runs_ms``  (regions with a column map) the same maps with every key tile gathered through
                    col_map, as before runs were read as plain tiles; ``fold_ms`` that pass alone;
* ``t_gathered_ms`` the path this replaces: index_select copies of the rows and keys, the plain kernel,
                    and the outputs copied back to their original rows;
* ``index_ms`` / ``map_check_ms`` the index build and a full check of maps from elsewhere
                    (kernels.region_maps, once per maps; Region.maps needs none); neither is in t_ours.

Efficiency = density x t_SDPA / t_kernel; density = listed blocks x block area over the causal matrix
(N^2/2). ``map_bytes`` is the only memory proportional to the sequence that the maps add.

    PYTHONPATH=. python benchmarks/permuted.py                   # 32K and 128K, bf16, 32/8 heads, d 128
    PYTHONPATH=. python benchmarks/permuted.py --quick           # 4K, for a smoke run on a GPU
    TRITON_INTERPRET=1 python benchmarks/permuted.py --quick     # no GPU: a tiny shape, wall-clock times

Rows (JSON list) go to benchmarks/results/permuted_<device>.json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.timing import call_ms, cuda_clock
from sparsesearch.files import write_json_atomic
from sparsesearch.index import BlockIndex, explicit_lines
from sparsesearch.kernels import block_sparse_attention, region_maps
from sparsesearch.kernels.region_runs import fold_runs
from sparsesearch.kernels.triangle import line_rows_attention
from sparsesearch.patterns import ashape, boundary, grid
from sparsesearch.reference import index_mask_fn, masked_attention, relative_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("text", "image", "video")


def bench(fn, cuda: bool) -> float:
    """Median ms: CUDA events (triton.testing.do_bench) on a GPU, one wall-clock call otherwise. A call past a
    second (SDPA at 1M: ~16 s) is timed once after a warm one (benchmarks/timing.py call_ms)."""
    if cuda:
        return call_ms(fn, cuda_clock(), short=lambda: float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def block_density(index: BlockIndex, n: int) -> float:
    """Listed blocks x block area over the causal matrix (N^2/2), per index head."""
    blocks = (index.full_count.long() + index.partial_count.long()).sum().item()
    return blocks * index.block_m * index.block_n / (index.batch * index.heads * n * n / 2)


def video_layout(n: int) -> torch.Tensor:
    """Modality ids [n]: a text prefix, then video chunks separated by short text spans of odd lengths
    (a fragmented interleave, ~85% video)."""
    ids = torch.full((n,), 2, dtype=torch.long)
    ids[: max(1, n // 32)] = 0
    step = max(8, n // 6)
    for i, start in enumerate(range(step, n - 1, step)):
        ids[start : start + max(1, n // 97 + 2 * i + 1)] = 0
    ids[-max(1, n // 64):] = 0  # the question at the end
    return ids


GRID_CASES = (
    ("grid_hv_s256_l1024", grid.GridParams(stride=256, phase=7, use_hline=True, use_vline=True, local=1024)),
    ("grid_v_s64_l1024", grid.GridParams(stride=64, phase=3, use_hline=False, use_vline=True, local=1024)),
)


def grid_rows(n: int, q, k, v, sdpa, args, cuda: bool, common: dict) -> list[dict]:
    """The grid read in place by arithmetic (patterns/grid.py build_lines_index: keys in place, vertical
    lines as strided columns, horizontal-line rows split over keys) against the same lists run plain — the
    line columns as explicit gathered ids (index.explicit_lines), the same line-row pass — and against the
    plain block cover (grid.build_index) the search scores."""
    rows_out = []
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for name, params in GRID_CASES:
        if args.cases and not any(c in name for c in args.cases):
            continue
        p = params if params.stride <= n // 4 else grid.GridParams(**{**params.__dict__, "stride": max(2, n // 16), "phase": 1})
        build = lambda p=p: grid.build_lines_index(p, n, n, heads=k.shape[1], block_m=args.block_m, block_n=args.block_n,
                                                   head_space="kv", device=q.device)
        index, lines = build()
        explicit = explicit_lines(index, lines)
        line_rows = lines.rows(q.device)
        every = torch.arange(q.shape[1], dtype=torch.int32, device=q.device)
        cover = grid.build_index(p, n, n, heads=k.shape[1], block_m=args.block_m, block_n=args.block_n, head_space="kv", device=q.device)

        def ours():
            block_sparse_attention(q, k, v, index, lines=lines, out=out, lse=lse)

        def plain():
            block_sparse_attention(q, k, v, explicit, out=out, lse=lse)
            if lines.row_lines:
                o, l = line_rows_attention(q, k, v, lines.row_phase, lines.stride, lines.row_lines, every)
                out[:, :, line_rows] = o.to(out.dtype)
                lse[:, :, line_rows] = l

        def plain_cover():
            block_sparse_attention(q, k, v, cover, out=out, lse=lse)

        t_sdpa_before = bench(sdpa, cuda)
        t_ours, t_plain, t_cover = bench(ours, cuda), bench(plain, cuda), bench(plain_cover, cuda)
        t_sdpa = (t_sdpa_before + bench(sdpa, cuda)) / 2
        index_ms = bench(build, cuda)
        ours()
        tail = torch.arange(n - min(256, n), n, device=q.device)
        mask = grid.lines_mask(p, n, n, block_m=args.block_m, block_n=args.block_n, rows=tail)
        ref, _ = masked_attention(q[:, :, tail], k, v, lambda r: mask[r][None, None], chunk=64)
        err = relative_error(out[:, :, tail], ref)
        density = float(mask_density(p, n, args))
        cover_density = block_density(cover, n)
        row = {
            **common, "case": name, "params": {"stride": p.stride, "phase": p.phase, "hline": p.use_hline, "vline": p.use_vline,
                                               "local": p.local},
            "n": n, "density": round(density, 5), "cover_density": round(cover_density, 5),
            "t_sdpa_ms": round(t_sdpa, 4), "t_ours_ms": round(t_ours, 4), "t_plain_ms": round(t_plain, 4),
            "t_cover_ms": round(t_cover, 4), "t_gathered_ms": None,
            "overhead_vs_plain": round(t_ours / t_plain - 1, 4), "speedup_vs_cover": round(t_cover / t_ours, 3),
            "eff_ours": round(density * t_sdpa / t_ours, 3), "eff_plain": round(density * t_sdpa / t_plain, 3),
            "index_ms": round(index_ms, 4), "map_check_ms": 0.0,
            "map_bytes": 0 if lines.line_cols is None else lines.line_cols.numel() * 4, "rel_err_last_rows": round(err, 6),
        }
        rows_out.append(row)
        print(json.dumps({k_: row[k_] for k_ in ("case", "n", "density", "t_ours_ms", "t_plain_ms", "t_cover_ms",
                                                 "overhead_vs_plain", "index_ms", "rel_err_last_rows")}), flush=True)
    return rows_out


def mask_density(p: grid.GridParams, n: int, args) -> float:
    """Computed tokens (listed blocks whole, line columns, line rows over their causal keys) over the causal
    matrix (N^2/2), counted per query block from the cover without a token x token mask."""
    hit, _, line_cols, lines = grid.lines_cover(p, n, n, args.block_m, args.block_n)
    blocks = hit.sum().item() * args.block_m * args.block_n
    line_keys = (lines.rows() + 1).sum().item()
    return (blocks + line_cols.sum().item() * args.block_m + line_keys) / (n * n / 2)


def region_cases(n: int, heads: int, args, device) -> list[tuple]:
    ids = video_layout(n).to(device)
    pos = boundary.positions(ids, NAMES)
    a = ashape.AShapeParams(sink=128, local=min(4096, n // 4))
    cases = []
    for q_mod, k_mod in (("video", "all"), ("video", "video"), ("text", "video")):
        region = boundary.make_region(q_mod, k_mod, pos)
        maps = region.maps(device, n)
        build = lambda region=region: ashape.build_index(a, region.q_idx.numel(), region.k_idx.numel(), heads=heads, block_m=args.block_m,
                                                         block_n=args.block_n, head_space="kv", device=device, row_pos=region.row_pos)
        cases.append((f"region_{q_mod}>{k_mod}_ashape", {"sink": a.sink, "local": a.local, "rows": region.q_idx.numel(),
                                                         "keys": region.k_idx.numel()},
                      build, build(), maps))
    return cases


def mapped_mask(index: BlockIndex, row_map, col_map, row_pos, n: int, rows: torch.Tensor, group: int) -> torch.Tensor:
    """bool [Hq, len(rows), n]: the keys (original positions) the mapped launch admits for original rows
    ``rows`` (all in the region): the index's token mask in region coordinates, moved through the maps."""
    nq = n if row_map is None else row_map.numel()
    nk = n if col_map is None else col_map.numel()
    slot = torch.arange(n, device=rows.device) if row_map is None else torch.empty(n, dtype=torch.long, device=rows.device)
    if row_map is not None:
        slot[row_map.long()] = torch.arange(nq, device=rows.device)
    frame = index_mask_fn(index, nq, nk, group, row_pos)(slot[rows])[0]
    out = torch.zeros(frame.shape[0], rows.numel(), n, dtype=torch.bool, device=rows.device)
    out[..., torch.arange(n, device=rows.device) if col_map is None else col_map.long()] = frame
    return out


def run(args) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    device_name = torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)"
    group = args.heads // args.kv_heads
    rows_out = []
    for n in args.lengths:
        torch.manual_seed(n)
        q = torch.randn(1, args.heads, n, args.dim, device=device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, n, args.dim, device=device, dtype=dtype)
        v = torch.randn(1, args.kv_heads, n, args.dim, device=device, dtype=dtype)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=device)
        command_fields = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__, "batch": 1,
                          "q_heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.dim, "dtype": args.dtype,
                          "block_m": args.block_m, "block_n": args.block_n, "command": command}
        rows_out += grid_rows(n, q, k, v, sdpa, args, cuda, command_fields)
        cases = region_cases(n, args.kv_heads, args, device)
        for name, params, build, index, maps in cases:
            row_map, col_map, row_pos = maps.row_map, maps.col_map, maps.row_pos
            if args.cases and not any(c in name for c in args.cases):
                continue
            rows = torch.arange(n, device=device) if row_map is None else row_map.long()
            keys = torch.arange(n, device=device) if col_map is None else col_map.long()
            # Plain: the same index on copies the size of the region (made here, not timed).
            q_r, k_r, v_r = q.index_select(2, rows).contiguous(), k.index_select(2, keys).contiguous(), v.index_select(2, keys).contiguous()
            frame = row_pos  # the plain launch's causal rule differs for the grid (not its tiles or work)

            def ours():
                block_sparse_attention(q, k, v, index, maps=maps, out=out, lse=lse)

            def plain():
                block_sparse_attention(q_r, k_r, v_r, index, row_pos=frame)

            def gathered_tiles():  # the same maps without runs: every key tile gathered through col_map
                block_sparse_attention(q, k, v, index, maps=dataclasses.replace(maps, increasing=False), out=out, lse=lse)

            def gathered():
                qg, kg, vg = q.index_select(2, rows), k.index_select(2, keys), v.index_select(2, keys)
                o, l = block_sparse_attention(qg, kg, vg, index, row_pos=frame)
                out.index_copy_(2, rows, o)
                lse.index_copy_(2, rows, l)

            t_sdpa_before = bench(sdpa, cuda)
            t_ours = bench(ours, cuda)
            t_plain = bench(plain, cuda)
            t_gathered = bench(gathered, cuda)
            t_no_runs = bench(gathered_tiles, cuda) if col_map is not None else None
            fold_ms = bench(lambda: fold_runs(index, col_map), cuda) if col_map is not None else None
            t_sdpa = (t_sdpa_before + bench(sdpa, cuda)) / 2  # SDPA around the case: clocks drift in long runs
            index_ms = bench(build, cuda)
            map_check_ms = bench(lambda: region_maps(row_map, col_map, row_pos, n, n), cuda)
            ours()
            tail = rows[-min(256, rows.numel()):]
            mask = mapped_mask(index, row_map, col_map, row_pos, n, tail, group)
            ref, _ = masked_attention(q[:, :, tail], k, v, lambda r: mask[:, r][None], chunk=64)
            err = relative_error(out[:, :, tail], ref)
            density = block_density(index, n)
            map_bytes = sum(m.numel() * 4 for m in (row_map, col_map) if m is not None)
            row = {
                "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
                "case": name, "params": params, "n": n, "batch": 1, "q_heads": args.heads, "kv_heads": args.kv_heads,
                "head_dim": args.dim, "dtype": args.dtype, "block_m": args.block_m, "block_n": args.block_n,
                "density": round(density, 5), "t_sdpa_ms": round(t_sdpa, 4), "t_ours_ms": round(t_ours, 4),
                "t_plain_ms": round(t_plain, 4), "t_gathered_ms": round(t_gathered, 4),
                "t_no_runs_ms": None if t_no_runs is None else round(t_no_runs, 4),
                "fold_ms": None if fold_ms is None else round(fold_ms, 4),
                "overhead_vs_plain": round(t_ours / t_plain - 1, 4), "speedup_vs_gathered": round(t_gathered / t_ours, 3),
                "eff_ours": round(density * t_sdpa / t_ours, 3), "eff_plain": round(density * t_sdpa / t_plain, 3),
                "index_ms": round(index_ms, 4), "map_check_ms": round(map_check_ms, 4), "map_bytes": map_bytes,
                "rel_err_last_rows": round(err, 6), "command": command,
            }
            rows_out.append(row)
            print(json.dumps({k_: row[k_] for k_ in ("case", "n", "density", "t_ours_ms", "t_plain_ms", "t_gathered_ms",
                                                     "t_no_runs_ms", "fold_ms", "overhead_vs_plain", "index_ms", "map_check_ms", "rel_err_last_rows")}), flush=True)
        del q, k, v, out, lse
        if cuda:
            torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--quick", action="store_true", help="one small shape: 4K on a GPU, 512 tokens / 4+2 heads on the CPU interpreter")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--cases", nargs="*", help="substrings of case names to run (default all)")
    parser.add_argument("--out", type=Path, help="JSON file for the rows (default benchmarks/results/permuted_<device>.json)")
    args = parser.parse_args()
    if args.quick:
        if torch.cuda.is_available():
            args.lengths = [4096]
        else:
            args.lengths, args.heads, args.kv_heads, args.dim, args.block_m, args.block_n = [512], 4, 2, 64, 64, 64
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("benchmarks/permuted.py needs a CUDA GPU (or TRITON_INTERPRET=1 with --quick for a CPU smoke run)")
    started = time.time()
    rows = run(args)
    slug = re.sub(r"[^a-z0-9]+", "_", rows[0]["device"].lower()).strip("_") if rows else "none"
    path = args.out or Path("benchmarks/results") / f"permuted_{slug}.json"
    write_json_atomic(path, rows, end="\n", indent=1)
    print(f"{len(rows)} rows -> {path} in {time.time() - started:.0f} s")
    print(f"{'case':30s} {'N':>7s} {'dens':>6s} {'ours ms':>9s} {'plain ms':>9s} {'gath/cover':>10s} {'ovh':>7s} {'eff':>5s} {'SDPA ms':>9s} {'idx ms':>7s} {'chk ms':>7s} {'err':>8s}")
    for r in rows:
        other = r['t_gathered_ms'] if r['t_gathered_ms'] is not None else r['t_cover_ms']
        print(f"{r['case']:30s} {r['n']:7d} {r['density']:6.3f} {r['t_ours_ms']:9.3f} {r['t_plain_ms']:9.3f} {other:10.3f} "
              f"{100 * r['overhead_vs_plain']:6.1f}% {r['eff_ours']:5.2f} {r['t_sdpa_ms']:9.3f} {r['index_ms']:7.2f} {r['map_check_ms']:7.3f} {r['rel_err_last_rows']:8.1e}")


if __name__ == "__main__":
    main()
