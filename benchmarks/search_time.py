"""Search time of `calibrate` on 7B-shaped synthetic activations (paper 000: ~15 min per 7B model on an A100).

    python benchmarks/search_time.py --layers 28 --heads 28 --kv-heads 4 --dim 128 --tokens 25000
    python benchmarks/search_time.py --modal ...   # the whole Alg. 4 on a video/text interleave

With --modal the sequence is video frames interleaved with text segments (~25% text, like MM-NIAH) and
each layer runs search_modal_layer: the global, intra, cross, row and key regions, then the none/K/Q/2D
composition per head.

Per layer: synthetic post-RoPE q/k/v with real structure (positional features so attention is local,
a few heavy "vertical" keys per head, noise), then the same `score_layer` calibrate runs, with measured
kernel costs on this GPU. Prints the time split (index estimation, kernels, objective, cost measurement)
and writes a JSON row.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import triton

from sparsesearch.search.boundary import choose_boundary, search_modal_layer
from sparsesearch.search.cost import AnalyticCost, MeasuredCost
from sparsesearch.search.layer import head_rows, score_layer
from sparsesearch.search.space import load_space

NAMES = ("text", "image", "video")


def activations(layer: int, heads: int, kv_heads: int, n: int, dim: int, device, dtype):
    gen = torch.Generator(device=device).manual_seed(layer)
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    freqs = torch.logspace(-4, -1, dim // 2, device=device)[None, :] * (1 + layer % 3)
    feats = torch.cat([torch.cos(pos * freqs), torch.sin(pos * freqs)], dim=1)  # [n, dim], smooth in position
    noise = lambda h: torch.randn(1, h, n, dim, device=device, generator=gen)
    k = feats[None, None] * 2.0 + noise(kv_heads) * 0.5
    stars = torch.randint(0, n, (kv_heads, 64), device=device, generator=gen)
    direction = torch.randn(kv_heads, dim, device=device, generator=gen)
    for h in range(kv_heads):
        k[0, h, stars[h]] += direction[h] * 3.0
    q = feats[None, None] * 2.0 + noise(heads) * 0.5 + direction.repeat_interleave(heads // kv_heads, 0)[None, :, None, :] * 0.5
    v = noise(kv_heads)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def interleave(n: int, device, span: int = 1024) -> torch.Tensor:
    """Modality ids [n]: video spans of 3 x span tokens, then a text span of span tokens, repeated; text last."""
    ids = torch.full((n,), 2, dtype=torch.long, device=device)
    unit = 4 * span
    for start in range(3 * span, n, unit):
        ids[start : start + span] = 0
    ids[-span // 4 :] = 0  # the question at the end is text
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=25000)
    parser.add_argument("--head-space", default="kv", choices=["kv", "query"])
    parser.add_argument("--modal", action="store_true", help="video/text interleave: the whole Alg. 4 per layer")
    parser.add_argument("--device", default="cuda", help="cuda (timings) or cpu (a smoke run at small shapes)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/sparsesearch_costs.json"), help="the measured-cost cache (a warm run reuses it)")
    parser.add_argument("--no-table", action="store_true", help="time every launch the exact cache keys miss (no cost-table interpolation)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/search_time.py needs a CUDA GPU (or --device cpu for a smoke run)")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out_path = args.out or Path(f"benchmarks/results/search_time{'_modal' if args.modal else ''}.json")
    space = load_space()
    costs = MeasuredCost(cache_path=args.cache, interpolate=not args.no_table) if dev.type == "cuda" else AnalyticCost()
    modality = interleave(args.tokens, dev, span=min(1024, args.tokens // 8)) if args.modal else None
    kinds: dict[str, int] = {}
    totals = {"index_s": 0.0, "kernel_s": 0.0, "objective_s": 0.0}
    mix: dict[str, int] = {}
    picks: list[str] = []  # every head's pattern, layer by layer (two runs' choices compare position by position)
    started = time.perf_counter()
    gen_s = 0.0
    for layer in range(args.layers):
        t0 = time.perf_counter()
        q, k, v = activations(layer, args.heads, args.kv_heads, args.tokens, args.dim, dev, dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        gen_s += time.perf_counter() - t0
        if modality is None:
            scored, budget, t = score_layer(q, k, v, space, costs, head_space=args.head_space)
            timings = [t]
        else:
            results, scores = search_modal_layer(q, k, v, modality, NAMES, space, costs, head_space=args.head_space, objective="output_error")
            scored, budget = results["all>all"].scored, results["all>all"].budget
            timings = [r.timings for r in results.values()]
            for kind in choose_boundary(scores["types"], scores["budget_ms"], "output_error"):
                kinds[kind] = kinds.get(kind, 0) + 1
        for r in head_rows(scored, budget, "output_error"):
            mix[r["pattern"]] = mix.get(r["pattern"], 0) + 1
            picks.append(r["pattern"])
        for t in timings:
            for key in totals:
                totals[key] += getattr(t, key)
        print(f"layer {layer:2d}: {time.perf_counter() - started:6.1f} s", flush=True)
    if hasattr(costs, "flush"):
        costs.flush()
    wall = time.perf_counter() - started - gen_s
    row = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
        "modal": args.modal, "boundaries": kinds or None,
        "layers": args.layers, "q_heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.dim, "tokens": args.tokens,
        "dtype": str(dtype).removeprefix("torch."), "head_space": args.head_space, "search_s": round(wall, 2),
        **{k: round(v, 2) for k, v in totals.items()},
        "cost_measurement_and_other_s": round(wall - sum(totals.values()), 2), "patterns": mix,
        "costs_timed": getattr(costs, "timed", None), "costs_priced": getattr(costs, "priced", None), "table": not args.no_table,
        "picks": picks,
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
