"""What a layer whose heads mix sparse and dense costs on a GPU, against the per-head prices calibrate adds up.

calibrate prices each head alone (search/cost.py MeasuredCost: a candidate's kernel over the layer's heads / H,
a dense head SDPA over the layer / H) and sums them, so a layer with one sparse head among dense ones is priced
at (H - 1) dense shares plus one sparse share. The runtime runs such a layer as SDPA over the dense heads'
gathered q/k/v plus one sparse launch (runtime/run.py); this script measures that call (the profiler's GPU
time, as `sparsesearch pareto` does) next to the sum calibrate would predict, on random tensors of a model's
shape. Gemma 3 270M's global layers: 4 query heads, 1 KV head, head_dim 256.

    python benchmarks/mixed_layer.py --tokens 16384 32768 [--heads 4 --kv-heads 1 --dim 256] [--sets 0,2 0 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from sparsesearch.execute import HeadGroup
from sparsesearch.search.cost import kernel_ms
from sparsesearch.patterns.ashape import AShapeParams
from sparsesearch.runtime.plan import LayerPlan, Plan
from sparsesearch.runtime.run import Runner


def layer_of(sparse_heads: tuple[int, ...], params: AShapeParams) -> LayerPlan:
    """A query-head-space layer whose ``sparse_heads`` run ``params`` (64 x 64 blocks) and the rest SDPA."""
    groups = (HeadGroup("ashape", params, sparse_heads, 64, 64),) if sparse_heads else ()
    return LayerPlan(layer=0, kind="sparse", groups=groups)


def measure(n: int, heads: int, kv_heads: int, dim: int, params: AShapeParams, sets: list[tuple[int, ...]] | None = None) -> list[dict]:
    """One row per set of sparse heads (default: the first s heads, s = 0..heads): measured call vs the per-head
    sum calibrate prices. Sets that are not a prefix (e.g. heads 0 and 2 sparse, 1 and 3 dense) show what the
    dense heads' gather costs: Run 40's layer 5 with heads 1 and 3 dense ran 0.13 ms over its price, one with
    heads 1-3 dense 0.02."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 1.0 / math.sqrt(dim)
    runner = Runner(Plan(head_space="query", layers=()))
    sdpa = kernel_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads))
    every = kernel_ms(lambda: runner.attend(layer_of(tuple(range(heads)), params), q, k, v, scale=scale))
    rows = []
    for chosen in sets if sets is not None else [tuple(range(s)) for s in range(heads + 1)]:
        s = len(chosen)
        layer = layer_of(chosen, params)
        got = kernel_ms(lambda: runner.attend(layer, q, k, v, scale=scale))
        priced = s * every / heads + (heads - s) * sdpa / heads
        rows.append({"tokens": n, "heads": heads, "kv_heads": kv_heads, "dim": dim, "sparse_heads": s, "sparse_set": list(chosen),
                     "pattern": f"ashape {params.sink}/{params.local}", "sdpa_ms": round(sdpa, 4),
                     "measured_ms": round(got, 4), "priced_ms": round(priced, 4),
                     "overhead_ms": round(got - priced, 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--sink", type=int, default=256)
    ap.add_argument("--local", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--sets", nargs="+", default=None, help='sparse head sets, e.g. "0,2" "0" "" (empty: all dense); default the prefixes')
    args = ap.parse_args()
    sets = None if args.sets is None else [tuple(int(h) for h in x.split(",") if h) for x in args.sets]
    for n in args.tokens:
        for local in args.local:
            for row in measure(n, args.heads, args.kv_heads, args.dim, AShapeParams(sink=args.sink, local=local), sets):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
