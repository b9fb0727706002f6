"""Dynamic index building at short lengths: eager vs CUDA-graph replays (sparsesearch/graphed.py), issue 14 §2.

    PYTHONPATH=. python benchmarks/index_build.py --lengths 4096 8192 16384 32768 --out rows.jsonl
    PYTHONPATH=. python benchmarks/index_build.py --lengths 8192 16384 --profile   # GPU us, kernel by kernel

One head group of every KV head (kv head space, the runtime's default), 32 query / 8 KV heads, head_dim 128,
bf16, blocks 64 x 64 (the search spaces' tile). Per length and pattern, timed interleaved in one loop with
causal SDPA over the same q/k/v: the eager torch build (``execute.build_group_index``: ~80 launches and
device syncs), the graphed build (``StaticIndexCache.index``: two index_selects and one replay; it captures
the fused Triton build where the pattern has one, kernels/index_build.py), the fused build launched eagerly
(``build_index(..., static_widths=True, fused=True)``), the torch static-widths build replayed from a graph
(the pre-fusion baseline, ``fused=False``), and index + kernel for the eager, graphed and fused builds. Rows
where the pattern has no fused build leave the fused columns null; past graphed.MAX_TOKENS (16K) the graphed
column is the eager torch build (the cache does not capture there). The patterns are Table 3's
vertical-slash (1000 verticals, 2048 slash lines at 32K, scaled linearly as the search space scales them)
and block top-k keeping ~10% of the causal blocks. Target (issue 14 §2): index_fused_over_sdpa <= 0.10 at 8K.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import cuda_clock, interleaved_ms
from sparsesearch.execute import HeadGroup, StaticIndexCache, build_group_index, estimate_heads, sparse_attend
from sparsesearch.index import BlockIndex
from sparsesearch.kernels.dynamic_index import BUILDS, build
from sparsesearch.patterns import block_topk, vertical_slash


def groups(n: int, kv_heads: int) -> list[HeadGroup]:
    """The two dynamic patterns at length n, every KV head in one group."""
    scale = min(1.0, n / 32768)
    vs = vertical_slash.VerticalSlashParams(vertical_size=max(1, int(1000 * scale)), slash_size=max(1, int(2048 * scale)))
    topk = block_topk.BlockTopKParams(k_blocks=max(1, n // 64 // 20), sink_blocks=1)  # ~10% of a causal row's blocks on average
    heads = tuple(range(kv_heads))
    return [HeadGroup("vertical_slash", vs, heads, 64, 64), HeadGroup("block_topk", topk, heads, 64, 64)]


def fused_build(g: HeadGroup, q, k, *, fused: bool) -> Callable[[], BlockIndex]:
    """The group's static-widths build on its own heads (what graphed.py captures), fused or torch; the
    head slicing runs outside, so the call times the build alone."""
    q_ids, kv_ids = estimate_heads(g, q.shape[1] // k.shape[1], "kv")
    qs = q.index_select(1, torch.tensor(q_ids, device=q.device))
    ks = k.index_select(1, torch.tensor(kv_ids, device=q.device))
    return lambda: build(g.pattern, g.params, qs, ks, head_space="kv", block_m=g.block_m, block_n=g.block_n,
                         static_widths=True, fused=fused)


def has_fused(g: HeadGroup, q, k) -> bool:
    """Whether the pattern has a fused build (kernels/dynamic_index.py BUILDS) and it takes these inputs
    (one build, refused or not)."""
    if g.pattern not in BUILDS:
        return False
    try:
        fused_build(g, q, k, fused=True)()
    except ValueError:
        return False
    return True


def graphed_torch(g: HeadGroup, q, k) -> Callable[[], BlockIndex]:
    """The torch static-widths build replayed from a CUDA graph: the pre-fusion graphed baseline."""
    build = fused_build(g, q, k, fused=False)
    build()  # lazy handles and the allocator's first blocks outside the capture (as graphed.py)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build()
    return graph.replay


def same_lists(a: BlockIndex, b: BlockIndex) -> bool:
    """Equal counts and equal ids up to each count (the lists may differ in width)."""
    for count, ids in (("full_count", "full_idx"), ("partial_count", "partial_idx"), ("col_count", "col_idx")):
        ca, cb = getattr(a, count), getattr(b, count)
        if (ca is None) != (cb is None) or (ca is not None and not torch.equal(ca, cb)):
            return False
        if ca is not None:
            width = min(getattr(a, ids).shape[-1], getattr(b, ids).shape[-1])
            live = torch.arange(width, device=ca.device) < ca[..., None]
            if not torch.equal(torch.where(live, getattr(a, ids)[..., :width], 0), torch.where(live, getattr(b, ids)[..., :width], 0)):
                return False
    return True


def row(g: HeadGroup, n: int, q, k, v, clock) -> dict:
    """Times (ms) of SDPA and of the eager, graphed, fused and graphed-torch builds, the first three also
    + kernel, in one interleaved loop."""
    q_heads = q.shape[1]
    heads = torch.arange(k.shape[1], dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    scale = q.shape[-1] ** -0.5
    graphed = StaticIndexCache()
    want = build_group_index(g, q, k, "kv")
    got = graphed.index(g, q, k, "kv")  # captures
    # Random bf16 data: a fused build may break a near-tie (scores equal to rounding) the other way; report it.
    graph_matches = same_lists(got, want)
    fns = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "index_eager": lambda: build_group_index(g, q, k, "kv"),
        "index_graph": lambda: graphed.index(g, q, k, "kv"),
        "index_graph_torch": graphed_torch(g, q, k),
        "total_eager": lambda: sparse_attend(q, k, v, build_group_index(g, q, k, "kv"), scale, heads, out, lse),
        "total_graph": lambda: sparse_attend(q, k, v, graphed.index(g, q, k, "kv"), scale, heads, out, lse),
    }
    if has_fused(g, q, k):
        fused = fused_build(g, q, k, fused=True)
        fns["index_fused"] = fused
        fns["total_fused"] = lambda: sparse_attend(q, k, v, fused(), scale, heads, out, lse)
    t = dict(zip(fns, interleaved_ms(list(fns.values()), clock=clock).ms))
    listed = int(want.full_count.sum() + want.partial_count.sum())
    causal_blocks = k.shape[1] * (n // 64) * (n // 64 + 1) // 2
    ms = {f"{name}_ms": round(t[name], 4) if name in t else None for name in COLUMNS}
    return {"pattern": g.pattern, "params": g.params.__dict__, "n": n, "q_heads": q_heads, "kv_heads": k.shape[1],
            "head_dim": q.shape[-1], "dtype": str(q.dtype).removeprefix("torch."), "block_density": round(listed / causal_blocks, 4),
            **ms, "graph_matches_eager": graph_matches,
            "index_graph_over_sdpa": round(t["index_graph"] / t["sdpa"], 3),
            "index_fused_over_sdpa": round(t["index_fused"] / t["sdpa"], 3) if "index_fused" in t else None,
            "speedup_graph_vs_sdpa": round(t["sdpa"] / t["total_graph"], 3)}


def gpu_profile(g: HeadGroup, q, k, v, calls: int = 20) -> dict:
    """GPU time (us per call, ``torch.profiler``) of the fused build, kernel by kernel, and of causal SDPA over
    the same q/k/v: the index target is GPU time, since a prefill hides the build's host launches behind
    the previous layer's work."""
    from torch.profiler import ProfilerActivity, profile

    fused = fused_build(g, q, k, fused=True)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for fn in (fused, sdpa):  # compiled and warm before the window
        fn()
    torch.cuda.synchronize()
    spans = {}
    for name, fn in (("build", fused), ("sdpa", sdpa)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        kernels = {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}
        spans[name] = kernels
    build_us, sdpa_us = sum(spans["build"].values()), sum(spans["sdpa"].values())
    return {"pattern": g.pattern, "params": g.params.__dict__, "n": q.shape[2], "q_heads": q.shape[1], "kv_heads": k.shape[1],
            "build_gpu_us": round(build_us, 1), "sdpa_gpu_us": round(sdpa_us, 1), "build_over_sdpa_gpu": round(build_us / sdpa_us, 4),
            "kernel_us": {name: round(us, 1) for name, us in sorted(spans["build"].items(), key=lambda kv: -kv[1])}}


COLUMNS = ("sdpa", "index_eager", "index_graph", "index_graph_torch", "index_fused", "total_eager", "total_graph", "total_fused")


def table(rows: list[dict]) -> str:
    """The rows as a text table for people (None shown as -)."""
    cell = lambda x: "-" if x is None else f"{x:.3f}"
    head = f"{'pattern':15} {'N':>6} {'blocks':>6} " + " ".join(f"{c:>17}" for c in COLUMNS) + f" {'fused/SDPA':>10} {'graph/SDPA':>10}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['pattern']:15} {r['n']:6d} {r['block_density']:6.3f} " + " ".join(f"{cell(r[c + '_ms']):>17}" for c in COLUMNS)
                     + f" {cell(r['index_fused_over_sdpa']):>10} {cell(r['index_graph_over_sdpa']):>10}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="instead of the timing rows: the fused builds' GPU time kernel by kernel vs SDPA's (torch.profiler)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/index_build.py needs a CUDA GPU")
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    device = torch.device("cuda")
    clock, rows = cuda_clock(), []
    for n in args.lengths:
        torch.manual_seed(n)
        q = torch.randn(1, args.heads, n, args.dim, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, args.kv_heads, n, args.dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        for g in groups(n, args.kv_heads):
            if args.profile:
                if has_fused(g, q, k):
                    r = gpu_profile(g, q, k, v) | {"device": torch.cuda.get_device_name(), "command": command}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                continue
            r = row(g, n, q, k, v, clock) | {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": command}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not args.profile:
        print(table(rows))

if __name__ == "__main__":
    main()
