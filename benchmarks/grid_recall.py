"""Grid heads against vertical-slash heads at equal recall, on planted grid attention (issue 14 §2).

A vertical-slash head can hold a grid's vertical lines as gathered columns and its local band as slash lines,
but not its horizontal lines (rows that attend every key). This benchmark plants grid attention (the
construction of tests/planted.py: flagged line keys at logit 12, a local band peaking near 6 nats, zeroed line
rows, small noise), then scores both patterns by recall: the share of each row's exact softmax mass on the keys
the kernel computes (``reference.admitted_mass``), on sampled rows, line rows weighted by their share of all rows.
It times, each alone after a warm call (a call past a second once, else do_bench's median):

* grid: the lines form read in place (``grid.build_lines_index`` + ``block_sparse_attention(lines=...)``), as
  the runtime runs a grid head;
* vertical-slash: the cheapest budget of a ladder (verticals 0.5 / 1 / 1.25 x the line count, slashes 128 / 1024)
  whose recall is within ``--tolerance`` of the grid's, else the ladder's best recall (``equal_recall`` false).
  Its index is estimated from the last 64 queries (``vertical_slash.build_index``): fused where the build takes
  the shape, else the torch build one KV head at a time (a whole-layer torch build needs tens of GiB at 1M);
* SDPA, causal, GQA-native.

Density is what each kernel computes over the causal matrix (listed blocks whole, gathered or line columns,
line rows over their causal keys). Rows go to ``--out`` (JSON lines) as they are made.

    python -m benchmarks.grid_recall --lengths 131072 524288 1048576
    TRITON_INTERPRET=1 python -m benchmarks.grid_recall --quick      # CPU smoke run at 1024 tokens
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.kernels import computed_density
from benchmarks.permuted import mask_density
from benchmarks.timing import call_ms, cpu_clock, cuda_clock
from sparsesearch.index import stack
from sparsesearch.kernels import block_sparse_attention
from sparsesearch.kernels.dynamic_index import vertical_slash_build, vertical_slash_refusal
from sparsesearch.patterns import grid, vertical_slash
from sparsesearch.reference import admitted_mass, index_mask_fn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = (
    ("grid_hv_s256_l1024", grid.GridParams(stride=256, phase=7, use_hline=True, use_vline=True, local=1024)),
    ("grid_v_s64_l1024", grid.GridParams(stride=64, phase=3, use_hline=False, use_vline=True, local=1024)),
)
LINE_LOGIT = 12.0  # a line key's logit after the 1/sqrt(D) scale: e^12 ~ 1.6e5 plain keys
BAND_AMP = 3.0  # band peak amp^2 * 8 cosines / sqrt(128) ~ 6.4 nats at offset 0
NOISE = 0.5  # per-dim std of q and k elsewhere: ~0.2 nats of logit noise at D = 128
VERTICAL_FRACTIONS = (0.5, 1.0, 1.25)
SLASH_SIZES = (128, 1024)


def planted(n: int, p: grid.GridParams, heads: int, kv_heads: int, dim: int, band: int, seed: int, device, dtype):
    """q [1, heads, n, dim], k, v [1, kv_heads, n, dim]: keys on phase (mod stride) flagged in dim 0 (every row
    scores them LINE_LOGIT), a local band ``band`` tokens wide in dims 8-23 (8 jittered frequencies in
    [0.5, 1.5] / band, so far aliases stay low), noise elsewhere, and line rows zeroed (uniform over their
    prefix) when ``p.use_hline``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, heads, n, dim, generator=gen, device=device, dtype=dtype) * NOISE
    k = torch.randn(1, kv_heads, n, dim, generator=gen, device=device, dtype=dtype) * NOISE
    v = torch.randn(1, kv_heads, n, dim, generator=gen, device=device, dtype=dtype)
    q[..., 0] = LINE_LOGIT * math.sqrt(dim)
    k[..., 0] = 0.0
    k[:, :, p.phase:: p.stride, 0] = 1.0
    jitter = torch.rand(8, generator=torch.Generator().manual_seed(seed))
    w = ((torch.arange(8) + jitter) / 8 + 0.5) / band  # evenly spread in [0.5, 1.5] / band, jittered
    pos = torch.arange(n, dtype=torch.float64)[:, None] * w[None, :].double()
    wave = (torch.cat([torch.cos(pos), torch.sin(pos)], 1) * BAND_AMP).to(device=device, dtype=dtype)  # [n, 16]
    q[..., 8:24] = wave
    k[..., 8:24] = wave
    if p.use_hline:
        q[:, :, p.phase:: p.stride] = 0.0
    return q, k, v


def sample_rows(n: int, p: grid.GridParams, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows int64 [R], weights float32 [R] summing to 1) from [n / 16, n): a quarter of the rows on the
    horizontal lines when the grid has them, weighted so the weighted mean is the mean over all rows."""
    gen = torch.Generator().manual_seed(seed)
    lo = n // 16
    line_rows = count // 4 if p.use_hline else 0
    others = torch.randint(lo, n, (4 * count,), generator=gen)
    if p.use_hline:
        others = others[(others - p.phase) % p.stride != 0]
    others = others[: count - line_rows]
    first_line = lo + (p.phase - lo) % p.stride
    lines = first_line + p.stride * torch.randint(0, max(1, (n - 1 - first_line) // p.stride + 1), (line_rows,), generator=gen)
    share = 1.0 / p.stride if p.use_hline else 0.0
    weights = torch.cat([torch.full((others.numel(),), (1 - share) / others.numel()),
                         torch.full((line_rows,), share / max(1, line_rows))])
    return torch.cat([others, lines]), weights


def recall(q, k, rows, weights, mask_fn) -> dict:
    """Weighted mean recall over rows (heads averaged) and the lowest row's."""
    mass = admitted_mass(q, k, rows.to(q.device), mask_fn).mean(dim=(0, 1)).cpu()  # [R]
    return {"recall": round(float((mass * weights).sum()), 5), "recall_min": round(float(mass.min()), 5)}


def vs_build(params: vertical_slash.VerticalSlashParams, q, k, block_m: int, block_n: int):
    """The layer's vertical-slash index, and how it was built: fused, else torch one KV head at a time."""
    if q.is_cuda and vertical_slash_refusal(params, q, k, block_n=block_n) is None:
        index = vertical_slash_build(params, q, k, head_space="kv", block_m=block_m, block_n=block_n, fused=True)
        return index, "fused"
    group = q.shape[1] // k.shape[1]
    parts = [vertical_slash.build_index(params, q[:, h * group: (h + 1) * group], k[:, h: h + 1], head_space="kv",
                                        block_m=block_m, block_n=block_n) for h in range(k.shape[1])]
    return stack(parts, dim=1), "torch per KV head"


def timer(cuda: bool):
    """ms of one call, warm: one call past a second, else do_bench's median (a GPU) or a median (the CPU)."""
    if cuda:
        return lambda fn: call_ms(fn, cuda_clock(), short=lambda: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")))
    return lambda fn: call_ms(fn, cpu_clock(), max_calls=3, budget_ms=1.0)


def case_row(n: int, name: str, p: grid.GridParams, args, device, dtype, time_ms, t_sdpa: float, common: dict) -> dict:
    q, k, v = planted(n, p, args.heads, args.kv_heads, args.dim, args.band, seed=n + p.stride, device=device, dtype=dtype)
    group = args.heads // args.kv_heads
    rows, weights = sample_rows(n, p, args.rows, seed=n)
    bm, bn = args.block_m, args.block_n

    def grid_build():
        return grid.build_lines_index(p, n, n, heads=args.kv_heads, block_m=bm, block_n=bn, head_space="kv", device=device)

    index, lines = grid_build()
    grid_mask = lambda r: grid.lines_mask(p, n, n, block_m=bm, block_n=bn, rows=r)[None, None]
    g = {"density": round(float(mask_density(p, n, args)), 5), **recall(q, k, rows, weights, grid_mask)}
    g["t_ms"] = round(time_ms(lambda: block_sparse_attention(q, k, v, index, lines=lines)), 4)
    g["index_ms"] = round(time_ms(grid_build), 4)
    del index, lines

    line_count = len(range(p.phase, n, p.stride))
    ladder = []
    budgets = dict.fromkeys((max(1, round(f * line_count)), min(s, max(1, n // 8))) for f in VERTICAL_FRACTIONS for s in SLASH_SIZES)
    for vertical, slash in budgets:
        params = vertical_slash.VerticalSlashParams(vertical_size=vertical, slash_size=slash)
        vs_index, built = vs_build(params, q, k, bm, bn)
        step = {"vertical": params.vertical_size, "slash": params.slash_size, "build": built,
                "density": round(computed_density(vs_index, n), 5),
                **recall(q, k, rows, weights, index_mask_fn(vs_index, n, n, group=group))}
        ladder.append(step)
        print(json.dumps({"n": n, "case": name, "vs_step": step}), flush=True)
        del vs_index
    equal = [s for s in ladder if s["recall"] >= g["recall"] - args.tolerance]
    chosen = dict(min(equal, key=lambda s: s["density"]) if equal else max(ladder, key=lambda s: s["recall"]))
    params = vertical_slash.VerticalSlashParams(vertical_size=chosen["vertical"], slash_size=chosen["slash"])
    vs_index, _ = vs_build(params, q, k, bm, bn)
    chosen["t_ms"] = round(time_ms(lambda: block_sparse_attention(q, k, v, vs_index)), 4)
    del vs_index
    chosen["index_ms"] = round(time_ms(lambda: vs_build(params, q, k, bm, bn)), 4)
    return {
        **common, "case": name, "n": n,
        "params": {"stride": p.stride, "phase": p.phase, "hline": p.use_hline, "vline": p.use_vline, "local": p.local, "band": args.band},
        "rows_scored": rows.numel(), "t_sdpa_ms": round(t_sdpa, 4), "grid": g, "vs": chosen, "vs_ladder": ladder,
        "equal_recall": bool(equal),
        "grid_vs_sdpa": round(t_sdpa / g["t_ms"], 2), "vs_vs_sdpa": round(t_sdpa / chosen["t_ms"], 2),
        "grid_vs_vs": round(chosen["t_ms"] / g["t_ms"], 2),
        "grid_vs_vs_with_index": round((chosen["t_ms"] + chosen["index_ms"]) / (g["t_ms"] + g["index_ms"]), 2),
    }


def run(args) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    time_ms = timer(cuda)
    common = {"device": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)", "torch": torch.__version__,
              "triton": triton.__version__, "batch": 1, "q_heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.dim,
              "dtype": args.dtype, "block_m": args.block_m, "block_n": args.block_n,
              "command": "python -m benchmarks.grid_recall " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    rows_out = []
    for n in args.lengths:
        q = torch.randn(1, args.heads, n, args.dim, device=device, dtype=dtype)
        k = torch.randn(1, args.kv_heads, n, args.dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        del q, k, v
        for name, params in CASES:
            if args.cases and not any(c in name for c in args.cases):
                continue
            if params.stride > n // 4:
                params = grid.GridParams(**{**params.__dict__, "stride": max(2, n // 16), "phase": 1})
            if params.local > n // 8:  # short smoke runs: keep the band a band
                params = grid.GridParams(**{**params.__dict__, "local": max(1, n // 8)})
            row = case_row(n, name, params, args, device, dtype, time_ms, t_sdpa, common)
            rows_out.append(row)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            print(json.dumps({key: row[key] for key in ("case", "n", "t_sdpa_ms", "grid", "vs", "equal_recall", "grid_vs_sdpa", "grid_vs_vs")}), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return rows_out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 4/2 heads, d 64: a CPU smoke run under TRITON_INTERPRET=1")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--band", type=int, default=64, help="planted local band width (tokens)")
    parser.add_argument("--rows", type=int, default=64, help="query rows scored for recall")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="recall a vertical-slash budget may miss the grid's by")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--cases", nargs="*", help="substrings of case names to run (default all)")
    parser.add_argument("--out", type=Path, help="JSON-lines file the rows are appended to")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.heads, args.kv_heads, args.dim, args.block_m, args.block_n, args.band, args.rows = [1024], 4, 2, 64, 64, 64, 8, 16
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("benchmarks/grid_recall.py needs a CUDA GPU (or TRITON_INTERPRET=1 with --quick for a CPU smoke run)")
    started = time.time()
    rows = run(args)
    print(f"{len(rows)} rows in {time.time() - started:.0f} s" + (f" -> {args.out}" if args.out else ""))
    print(f"{'case':20s} {'N':>8s} {'grid dens':>9s} {'recall':>7s} {'ms':>9s} | {'VS V/S':>12s} {'dens':>6s} {'recall':>7s} {'ms':>9s} | "
          f"{'SDPA ms':>9s} {'grid/SDPA':>9s} {'grid/VS':>7s}")
    for r in rows:
        g, s = r["grid"], r["vs"]
        print(f"{r['case']:20s} {r['n']:8d} {g['density']:9.4f} {g['recall']:7.4f} {g['t_ms']:9.3f} | {s['vertical']:>6d}/{s['slash']:<5d} "
              f"{s['density']:6.4f} {s['recall']:7.4f} {s['t_ms']:9.3f} | {r['t_sdpa_ms']:9.2f} {r['grid_vs_sdpa']:8.1f}x {r['grid_vs_vs']:6.2f}x"
              + ("" if r["equal_recall"] else "  (VS below the grid's recall)"))


if __name__ == "__main__":
    main()
