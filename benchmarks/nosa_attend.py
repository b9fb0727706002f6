"""NOSA slot attention alone (kernels/nosa_attend.py, P6 §5): the Triton kernel that reads the slot map,
adds the eviction bias and fetches pending blocks from pinned memory, vs torch SDPA over the same slots
timed alternately in one loop (benchmarks/timing.py): masked SDPA (cuDNN, the decoder's other path, with
the additive mask it needs) and unmasked GQA SDPA over the same number of keys (the bandwidth bar: it
reads the same K/V bytes with no mask, no bias, no fetch).

One decode token per sequence, 8B-shaped heads (32 query, 8 KV, head_dim 128), k slots of ``block``
tokens plus the tail. ``--miss`` is the fraction of slots pending a fetch from the host store (0.007 is
the steady-state miss rate of benchmarks/nosa_decode.py; 0.25 a block start). A first pass over splits,
warps and stages picks the launch settings (reported with the rows).

    PYTHONPATH=. python benchmarks/nosa_attend.py --batch 16 64 --out benchmarks/results/nosa_attend_h200.jsonl

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.rows import emit, write_jsonl
from benchmarks.timing import cuda_clock, interleaved_ms, l2_flush
from sparsesearch.kernels._common import group_rows
from sparsesearch.kernels.nosa_attend import AttendScratch, default_splits, slot_attend


def make_state(batch: int, heads: int, kv_heads: int, dim: int, k: int, block: int, context: int, miss: float, seed: int = 0):
    """Random slots, a slot map of distinct blocks below the tail, pending fetches for a ``miss`` share of
    slots, a pinned host store, per-token scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pairs, n_blocks = batch * kv_heads, context // block
    slots = (batch, kv_heads, (k + 1) * block, dim)
    st = dict(q=torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g),
              slots_k=torch.randn(slots, device="cuda", dtype=torch.bfloat16, generator=g),
              slots_v=torch.randn(slots, device="cuda", dtype=torch.bfloat16, generator=g),
              scores=torch.rand(batch, kv_heads, context, device="cuda", generator=g),
              lengths=torch.full((batch,), context, dtype=torch.long, device="cuda"))
    tail = (context - 1) // block
    st["slot_map"] = torch.stack([torch.randperm(tail, device="cuda", generator=g)[:k] for _ in range(pairs)]).view(batch, kv_heads, k)
    host = (batch, kv_heads, context, dim)
    st["keys_host"] = torch.randn(host, dtype=torch.bfloat16).pin_memory()
    st["values_host"] = torch.randn(host, dtype=torch.bfloat16).pin_memory()
    pending = torch.rand(pairs, k, device="cuda", generator=g) < miss
    rows = torch.arange(pairs, device="cuda")[:, None] * n_blocks + st["slot_map"].view(pairs, k)
    st["fetch_from"] = torch.where(pending, rows, -1)
    return st


def additive_mask(st: dict, block: int) -> torch.Tensor:
    """The masked SDPA path's [B, Hkv, 1, (k+1)·block] mask: every slot resident, bias on each token."""
    batch, kv_heads, k = st["slot_map"].shape
    offs = torch.arange(block, device="cuda")
    tokens = (st["slot_map"][..., None] * block + offs).flatten(2)
    tail = ((st["lengths"] - 1) // block * block)[:, None, None] + offs
    tokens = torch.cat([tokens, tail.expand(-1, kv_heads, -1)], 2)
    return st["scores"].gather(-1, tokens)[:, :, None].to(torch.bfloat16)


def measure(batch: int, args, settings) -> list[dict]:
    heads, kv_heads, dim, k, block = args.heads, args.kv_heads, args.dim, args.k, args.block
    st = make_state(batch, heads, kv_heads, dim, k, block, args.context, args.miss)
    pairs, group = batch * kv_heads, heads // kv_heads
    scale = dim ** -0.5
    mask = additive_mask(st, block)
    qg = st["q"].view(batch, kv_heads, group, dim)

    def kernel(splits, warps, stages):
        scratch = AttendScratch(pairs, splits, group_rows(group), dim, "cuda")
        fetch = st["fetch_from"].clone()
        return lambda: slot_attend(st["q"], st["slots_k"], st["slots_v"], st["keys_host"], st["values_host"], st["slot_map"], fetch,
                                   st["scores"], st["lengths"], scratch, block=block, scale=scale, bias=True, num_warps=warps, num_stages=stages)

    def masked():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(qg, st["slots_k"], st["slots_v"], attn_mask=mask, scale=scale)

    def plain():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(st["q"][:, :, None], st["slots_k"], st["slots_v"], scale=scale, enable_gqa=True)

    clock, flush = cuda_clock(), l2_flush()
    best = None
    for splits, warps, stages in settings(pairs):
        fn = kernel(splits, warps, stages)
        ms = interleaved_ms([fn], clock=clock, flush=flush, warmup=3, reps=20).ms[0]
        if best is None or ms < best[0]:
            best = (ms, splits, warps, stages)
    _, splits, warps, stages = best
    fn = kernel(splits, warps, stages)
    out = fn().view(batch, kv_heads, group, dim).float()
    # the reference reads the slots after the kernel filled the pending ones from the host store
    ref = F.scaled_dot_product_attention(qg.float(), st["slots_k"].float(), st["slots_v"].float(), attn_mask=mask.float(), scale=scale)
    err = float((out - ref).abs().max())
    t = interleaved_ms([fn, masked, plain], clock=clock, flush=flush)
    kv = 2 * pairs * (k + 1) * block * dim * 2
    common = dict(device=torch.cuda.get_device_name(), batch=batch, heads=heads, kv_heads=kv_heads, head_dim=dim, k=k, block=block,
                  context=args.context, miss=args.miss, kv_mb=round(kv / 2**20, 1), reps=t.reps)
    rows = []
    for name, ms in zip(("triton", "sdpa_masked", "sdpa_unmasked"), t.ms):
        rows.append(common | dict(method=name, ms=round(ms, 4), tb_per_s=round(kv / ms / 1e9, 2),
                                  vs_sdpa_unmasked=round(t.ms[2] / ms, 3)))
    rows[0] |= dict(splits=splits, num_warps=warps, num_stages=stages, max_abs_err_vs_fp32=round(err, 5), default_splits=default_splits(pairs, k + 1, torch.device("cuda")))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--miss", type=float, default=0.007)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("nosa_attend.py needs a CUDA GPU", file=sys.stderr)
        return 2
    command = "PYTHONPATH=. python benchmarks/nosa_attend.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = []
    for batch in args.batch:
        rows += emit(measure(batch, args, lambda pairs: itertools.product(args.splits, args.warps, args.stages)), command)
    write_jsonl(args.out, rows)
    print("\n| batch | method | ms | TB/s | × unmasked SDPA | settings |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        extra = f"split {r['splits']} · {r['num_warps']} warps · {r['num_stages']} stages (default split {r['default_splits']})" if r["method"] == "triton" else ""
        print(f"| {r['batch']} | {r['method']} | {r['ms']} | {r['tb_per_s']} | {r['vs_sdpa_unmasked']} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
