"""SPAVA per-rank attention benchmark (P7 §6): one layer of 8B-shaped attention (32 query / 8 KV heads,
head_dim 128, bf16 on GPUs) spread over the ranks of a torchrun launch, SPAVA (sparsesearch/spava/
attention.py) against the exact zigzag ring (exact.py), both on the same process group, alternating.

Rows: one JSON line per (tokens, l_a, l_p, method) from rank 0 with device, world, backend, the slowest
rank's median ms, per-rank bytes sent, and the command that reproduces it.

    torchrun --nproc_per_node 8 benchmarks/spava_rank.py --tokens 32768,131072 --out benchmarks/results/spava_rank.jsonl
    torchrun --nproc_per_node 2 benchmarks/spava_rank.py --tokens 2048 --heads 4 --kv-heads 2 --dim 64   # CPU smoke run (gloo)

The attention math is this repository's plain-torch path (chunked rows, fp32 softmax), the same on both
methods: the rows compare the algorithms' work and traffic, not a fused kernel's speed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch
import torch.distributed as dist

from sparsesearch.spava.attention import spava_attention
from sparsesearch.spava.exact import ring_attention, zigzag_positions
from sparsesearch.spava.group import check_backend, init_group
from sparsesearch.spava.layout import Layout, default_lengths


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, reps: int, device: torch.device) -> float:
    """The slowest rank's median wall time of fn (ms), barriers around every call."""
    times = []
    for _ in range(reps + 1):  # the first call warms up
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([sorted(times[1:])[len(times[1:]) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--query", type=int, default=128)
    ap.add_argument("--anchor", default="default")
    ap.add_argument("--passing", default="default")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import os

    backend = check_backend(a.backend, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world, device = init_group(backend, 600)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        la0, lp0 = default_lengths(n)
        anchors = [la0 if t == "default" else int(t) for t in a.anchor.split(",")]
        passings = [lp0 if t == "default" else int(t) for t in a.passing.split(",")]
        g = torch.Generator(device="cpu").manual_seed(0)
        make = lambda h: torch.randn(1, h, n, a.dim, generator=g).to(device, dtype)
        q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
        zz = torch.tensor(zigzag_positions(n, world, rank), device=device)
        ring_stats: dict = {}
        ring_ms = median_ms(lambda: ring_attention(q[:, :, zz], k[:, :, zz], v[:, :, zz], zz, n, a.dim**-0.5, stats=ring_stats), a.reps, device)
        base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": world, "backend": backend,
                "tokens": n, "query": a.query, "heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim, "dtype": str(dtype).removeprefix("torch."),
                "command": "torchrun --nproc_per_node {} {}".format(world, shlex.join(sys.argv))}
        rows.append({**base, "method": "zigzag-ring", "ms": ring_ms, "bytes_sent": ring_stats.get("bytes_sent", 0) // (a.reps + 1)})
        for la in anchors:
            for lp in passings:
                lay = Layout(n - a.query, a.query, world, la, lp)
                pos = torch.tensor(lay.local_positions(rank), device=device)
                stats: dict = {}
                ms = median_ms(lambda: spava_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], lay, rank, a.dim**-0.5, stats=stats), a.reps, device)
                rows.append({**base, "method": "spava", "anchor": la, "passing": lp, "ms": ms,
                             "bytes_sent": stats.get("bytes_sent", 0) // (a.reps + 1), "speedup_vs_ring": ring_ms / ms})
    if rank == 0:
        for row in rows:
            print(json.dumps(row))
        if a.out:
            with open(a.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
