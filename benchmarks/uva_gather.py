"""Offload gather benchmark (P6 §5): blocks read straight from pinned host memory by our Triton kernel
(kernels/gather.py) vs the contiguous pinned host-to-device copy of the same bytes, and vs torch's
index_select on the host followed by a copy — all timed in the same loop, alternating, on one GPU.

Rows: one JSON line per (block size, blocks, method) with device, bytes, median ms, GB/s and the ratio to
the contiguous copy measured in the same run; a markdown table on stdout. A first pass over chunk sizes and
warps picks the kernel's launch settings for the rows (reported with them).

    python benchmarks/uva_gather.py --out benchmarks/results/uva_gather.jsonl

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from benchmarks.rows import write_jsonl
from sparsesearch.kernels.gather import CHUNK_BYTES, NUM_WARPS, ROWS_PER_PROGRAM, gather_blocks

POOL_BYTES = 1 << 30  # the host-side KV store the blocks are drawn from: far larger than any L2 or TLB reach


def timed(fns: dict, reps: int, inner: int) -> dict[str, float]:
    """Median ms per call of each fn, the fns alternating within every rep (a drifting clock moves all
    alike). Each sample times ``inner`` calls back to back, as a decode loop issues them: the host's launch
    cost (tens of µs for a Triton launch from Python) then overlaps the previous call's transfer instead of
    being counted against an idle GPU."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: compiles, faults the pages in
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def case(block_bytes: int, blocks: int, reps: int, inner: int, settings: list[tuple[int, int, int]], seed: int = 0) -> list[dict]:
    """One (block size, gathered blocks) case: every method and kernel setting, alternating."""
    words = block_bytes // 2  # bf16 elements: a block is [tokens, head_dim] of one KV head
    pool = torch.empty(POOL_BYTES // block_bytes, words, dtype=torch.bfloat16).pin_memory()
    pool.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    gen = torch.Generator().manual_seed(seed)
    rows_cpu = torch.randperm(pool.shape[0], generator=gen)[:blocks]
    rows, slots = rows_cpu.cuda(), torch.randperm(blocks, generator=gen).cuda()
    dst = torch.empty(blocks, words, dtype=torch.bfloat16, device="cuda")
    fns = {"contiguous_pinned_copy": lambda: dst.copy_(pool[:blocks], non_blocking=True),
           "torch_index_select_then_copy": lambda: dst.copy_(pool.index_select(0, rows_cpu), non_blocking=True)}
    for chunk, per, warps in settings:
        name = f"c{chunk}_r{per}_w{warps}"
        fns[f"uva_gather_{name}"] = lambda c=chunk, r=per, w=warps: gather_blocks(pool, rows, dst, slots, chunk_bytes=c, rows_per_program=r, num_warps=w)
    ms = timed(fns, reps, inner)
    gather_blocks(pool, rows, dst, slots, check=True)
    torch.cuda.synchronize()
    want = torch.empty_like(dst)
    want[slots.cpu()] = pool[rows_cpu].cuda()
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16)), "gather result differs from indexing"  # bits: random words hold NaNs
    moved = blocks * block_bytes
    base = ms["contiguous_pinned_copy"]
    return [{"block_bytes": block_bytes, "blocks": blocks, "method": name, "bytes": moved, "ms": round(t, 4),
             "GBps": round(moved / t / 1e6, 2), "vs_contiguous": round(base / t, 3)} for name, t in ms.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-bytes", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rows-per-program", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--inner", type=int, default=10, help="calls per timed sample, back to back")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    settings = [(c, r, w) for c in args.chunks for r in args.rows_per_program for w in args.warps]
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": shlex.join(["python", *sys.argv])}
    rows = []
    for block_bytes in args.block_bytes:
        for blocks in args.blocks:
            rows.extend({**env, **r} for r in case(block_bytes, blocks, args.reps, args.inner, settings))
    write_jsonl(args.out, rows)
    print(f"{env['device']} · torch {env['torch']} · `{env['command']}`")
    print("| block | blocks | MiB | contiguous GB/s | gather GB/s, default | ratio | best gather GB/s (setting) | ratio | index_select+copy GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    default = f"uva_gather_c{CHUNK_BYTES}_r{ROWS_PER_PROGRAM}_w{NUM_WARPS}"
    for block_bytes in args.block_bytes:
        for blocks in args.blocks:
            sel = {r["method"]: r for r in rows if r["block_bytes"] == block_bytes and r["blocks"] == blocks}
            best = max((r for m, r in sel.items() if m.startswith("uva_gather")), key=lambda r: r["GBps"])
            base = sel.get(default, {"GBps": "-", "vs_contiguous": "-"})
            print(f"| {block_bytes // 1024} KiB | {blocks} | {blocks * block_bytes / 2**20:.0f} | {sel['contiguous_pinned_copy']['GBps']} | "
                  f"{base['GBps']} | {base['vs_contiguous']} | {best['GBps']} ({best['method'].removeprefix('uva_gather_')}) | {best['vs_contiguous']} | "
                  f"{sel['torch_index_select_then_copy']['GBps']} |")

if __name__ == "__main__":
    main()
