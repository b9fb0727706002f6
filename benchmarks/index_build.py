"""Dynamic index building at short lengths: eager vs CUDA-graph replays (sparsesearch/graphed.py), issue 14 §2.

    PYTHONPATH=. python benchmarks/index_build.py --lengths 4096 8192 16384 32768 --out rows.jsonl

One head group of every KV head (kv head space, the runtime's default), 32 query / 8 KV heads, head_dim 128,
bf16, blocks 64 x 64 (the search spaces' tile). Per length and pattern, timed interleaved in one loop with
causal SDPA over the same q/k/v: the eager build (``execute.build_group_index``: ~80 launches and device
syncs), the graphed build (``StaticIndexCache.index``: two index_selects and one replay), and index + kernel
both ways. The patterns are Table 3's vertical-slash (1000 verticals, 2048 slash lines at 32K, scaled
linearly as the search space scales them) and block top-k keeping ~10% of the causal blocks.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import cuda_clock, interleaved_ms
from sparsesearch.execute import HeadGroup, StaticIndexCache, build_group_index, sparse_attend
from sparsesearch.patterns import block_topk, vertical_slash


def groups(n: int, kv_heads: int) -> list[HeadGroup]:
    """The two dynamic patterns at length n, every KV head in one group."""
    scale = min(1.0, n / 32768)
    vs = vertical_slash.VerticalSlashParams(vertical_size=max(1, int(1000 * scale)), slash_size=max(1, int(2048 * scale)))
    topk = block_topk.BlockTopKParams(k_blocks=max(1, n // 64 // 20), sink_blocks=1)  # ~10% of a causal row's blocks on average
    heads = tuple(range(kv_heads))
    return [HeadGroup("vertical_slash", vs, heads, 64, 64), HeadGroup("block_topk", topk, heads, 64, 64)]


def row(g: HeadGroup, n: int, q, k, v, clock) -> dict:
    """Times (ms) of the eager and graphed builds, each + kernel, and SDPA, in one interleaved loop."""
    q_heads = q.shape[1]
    heads = torch.arange(k.shape[1], dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    graphed = StaticIndexCache()
    want = build_group_index(g, q, k, "kv")
    got = graphed.index(g, q, k, "kv")  # captures
    assert torch.equal(got.full_count, want.full_count) and torch.equal(got.partial_count, want.partial_count)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    eager_build = lambda: build_group_index(g, q, k, "kv")
    graph_build = lambda: graphed.index(g, q, k, "kv")
    eager_total = lambda: sparse_attend(q, k, v, build_group_index(g, q, k, "kv"), q.shape[-1] ** -0.5, heads, out, lse)
    graph_total = lambda: sparse_attend(q, k, v, graphed.index(g, q, k, "kv"), q.shape[-1] ** -0.5, heads, out, lse)
    t = interleaved_ms([sdpa, eager_build, graph_build, eager_total, graph_total], clock=clock).ms
    listed = int(want.full_count.sum() + want.partial_count.sum())
    causal_blocks = k.shape[1] * (n // 64) * (n // 64 + 1) // 2
    return {"pattern": g.pattern, "params": g.params.__dict__, "n": n, "q_heads": q_heads, "kv_heads": k.shape[1],
            "head_dim": q.shape[-1], "dtype": str(q.dtype).removeprefix("torch."), "block_density": round(listed / causal_blocks, 4),
            "sdpa_ms": round(t[0], 4), "index_eager_ms": round(t[1], 4), "index_graph_ms": round(t[2], 4),
            "total_eager_ms": round(t[3], 4), "total_graph_ms": round(t[4], 4),
            "index_graph_over_sdpa": round(t[2] / t[0], 3), "speedup_graph_vs_sdpa": round(t[0] / t[4], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
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
            r = row(g, n, q, k, v, clock) | {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": command}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'pattern':15} {'N':>6} {'blocks':>6} {'SDPA':>8} {'idx eager':>9} {'idx graph':>9} {'graph/SDPA':>10} "
          f"{'tot eager':>9} {'tot graph':>9} {'vs SDPA':>7}")
    for r in rows:
        print(f"{r['pattern']:15} {r['n']:6d} {r['block_density']:6.3f} {r['sdpa_ms']:8.3f} {r['index_eager_ms']:9.3f} "
              f"{r['index_graph_ms']:9.3f} {r['index_graph_over_sdpa']:10.3f} {r['total_eager_ms']:9.3f} {r['total_graph_ms']:9.3f} "
              f"{r['speedup_graph_vs_sdpa']:6.2f}x")


if __name__ == "__main__":
    main()
