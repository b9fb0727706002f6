"""Kernel benchmark: our index-driven kernels vs torch SDPA (dense causal) and FlexAttention, one run.

Writes one JSON row per (length, case) with device, shapes, density, times, efficiency and the command.
Efficiency = density x t_SDPA / t_kernel, density = computed fraction of the causal matrix
(listed blocks x block area + gathered columns x block_m, over N^2/2). 1.0 = as fast per computed
element as dense SDPA.

Each kernel row times its kernel and SDPA alternately in one loop (``timing.interleaved_ms``: kernel,
SDPA, kernel, SDPA, ..., CUDA events per call, L2 flushed before each) and divides by that paired SDPA
median (``t_sdpa_paired_ms``), so a baseline that drifts during the run cannot move every row's
efficiency. FlexAttention gets its own paired SDPA (``t_sdpa_flex_paired_ms``). The cold SDPA number,
timed alone once per length as before, stays in ``t_sdpa_ms``; ``eff_ours_cold`` / ``eff_flex_cold``
divide by it (the definition of rows written before ``sdpa_timing: "interleaved"``).

    python -m benchmarks.kernels --lengths 8192 32768 131072 --out benchmarks/results/kernels.jsonl  # from the repo root

``--graphs`` adds each kernel (ours and FlexAttention) replayed from a CUDA graph, paired with SDPA the
same way (``t_ours_graph_ms``, ``eff_ours_graph``, ``t_flex_graph_ms``, ``eff_flex_graph``): the GPU's time
without the host's launch cost, which at 4K exceeds the triangle kernel's GPU work.

``--gap-ms G`` idles the GPU G ms before every timed call. Without it, each kernel call follows an SDPA call,
and after a 250 ms full-power SDPA call (128K) the GPU runs the next one 10-23% slower (RESULTS.md, Run 13). At
32K SDPA from idle runs at boost clocks, 13% faster than back to back.

Each row also times the kernel the way issue 14 set its bar: ``triton.testing.do_bench`` alone, back to back with
the L2 flushed, against SDPA timed the same way just before it (``t_ours_alone_ms``, ``t_sdpa_alone_ms``,
``eff_ours_alone``, ``eff_flex_alone``; with ``--graphs`` also ``eff_ours_graph_alone``). The three protocols differ most for short calls:
a sub-millisecond kernel timed from idle runs mostly while the clocks ramp, and one right after a full-power SDPA
call runs throttled.

Needs a CUDA GPU. Index building is timed separately (``index_ms``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.timing import cuda_clock, graphed, interleaved_ms, l2_flush
from sparsesearch.index import BlockIndex, to_block_masks
from sparsesearch.kernels import block_sparse_attention, triangle_attention
from sparsesearch.kernels.dynamic_index import block_topk_build
from sparsesearch.patterns import ashape, block_topk, triangle, vertical_slash
from sparsesearch.reference import index_mask_fn, masked_attention, predicate_mask_fn, relative_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench(fn, warmup_ms: int = 50, rep_ms: int = 200) -> float:
    """Median milliseconds of fn() measured with CUDA events (triton.testing.do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def paired(fn, sdpa, clock, flush, gap_ms: float = 0.0) -> tuple[float, float, int]:
    """(fn median ms, SDPA median ms, reps): fn and SDPA alternating in one loop (module docstring); gap_ms of
    idle before every call."""
    timed = interleaved_ms([fn, sdpa], clock=clock, flush=flush, gap_ms=gap_ms)
    return timed.ms[0], timed.ms[1], timed.reps


def alone(fn, sdpa) -> tuple[float, float]:
    """(fn ms, SDPA ms), each a do_bench median of back-to-back calls, SDPA first: the protocol of issue 14's bar."""
    t_sdpa = bench(sdpa)
    return bench(fn), t_sdpa


def computed_density(index: BlockIndex, n: int) -> float:
    """Computed elements over the causal matrix (N^2/2): what the kernel pays for, partial blocks whole."""
    blocks = (index.full_count.long() + index.partial_count.long()).sum().item() * index.block_m * index.block_n
    cols = 0 if index.col_count is None else index.col_count.long().sum().item() * index.block_m
    return (blocks + cols) / (index.batch * index.heads * n * n / 2)


def index_bytes(index: BlockIndex) -> int:
    tensors = [index.full_count, index.full_idx, index.partial_count, index.partial_idx, index.col_count, index.col_idx]
    # Expanded (stride-0) views cost only their storage.
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def flex_block_mask(index: BlockIndex, n: int, q_heads: int, mask_mod, tail_from: int | None = None):
    """BlockMask.from_kv_blocks with the same blocks (partial -> mask_mod, full -> none), query-head space."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_blocks = triton.cdiv(n, index.block_n)
    full, partial = to_block_masks(index, kv_blocks)
    if tail_from is not None:  # triangle: query blocks holding dense rows see every causal block
        qb = torch.arange(full.shape[2], device=full.device)[:, None]
        kb = torch.arange(kv_blocks, device=full.device)[None, :]
        dense_rows = ((qb + 1) * index.block_m > tail_from) & (kb * index.block_n <= (qb + 1) * index.block_m - 1)
        partial = (partial | dense_rows) & ~full
    if index.heads != q_heads:
        group = q_heads // index.heads
        full, partial = full.repeat_interleave(group, 1), partial.repeat_interleave(group, 1)

    def lists(mask):
        count = mask.sum(-1, dtype=torch.int32)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count, order

    p_count, p_idx = lists(partial)
    f_count, f_idx = lists(full)
    return BlockMask.from_kv_blocks(p_count, p_idx, f_count, f_idx, BLOCK_SIZE=(index.block_m, index.block_n), mask_mod=mask_mod, seq_lengths=(n, n))


VS_CASES = (("vs_planted_1000v_2048s", 1000, 2048), ("vs_vertical_heavy_4000v_256s", 4000, 256))


def planted_vs_lines(n: int, h_kv: int, device, n_vert: int, n_slash: int, gen: torch.Generator):
    """Planted vertical-slash lines for every KV head: a band of the nearest n_slash diagonals and n_vert fixed
    columns (the first 30 forced, the rest drawn from ``gen``)."""
    vert = torch.cat([torch.arange(30), 30 + torch.randperm(n - 30, generator=gen)[: n_vert - 30]]).sort().values
    return vertical_slash.VSLines(
        vertical=vert.to(device).expand(1, h_kv, -1).contiguous(),
        slash=torch.arange(n_slash, device=device).expand(1, h_kv, -1).contiguous(),
        q_len=n, kv_len=n, head_space="kv",
    )


def make_cases(n: int, q, k, args):
    """(name, params dict, build_index() -> (index, run, mask_mod, tail_from))."""
    h_kv = k.shape[1]
    dev = q.device
    cases = []
    a = ashape.AShapeParams(sink=128, local=4096)
    # 128-blocks: the rows of Runs 1-6; 64-blocks: what the search spaces and the runtime use (GQA heads stacked).
    for block, suffix in ((128, ""), (64, "_b64")):
        causal_blocks = triton.cdiv(n, block) / 2
        for target in (0.05, 0.10, 0.25):
            kb = max(1, round(target * causal_blocks) - 2)
            params = block_topk.BlockTopKParams(k_blocks=kb, sink_blocks=1)
            cases.append((f"block_topk_{int(target * 100)}pct{suffix}", {"k_blocks": kb, "block": block},
                          lambda p=params, b=block: (block_topk_build(p, q, k, head_space="kv", block_m=b, block_n=b), None, "causal", None)))
        cases.append((f"ashape_128_4096{suffix}", {"sink": 128, "local": 4096, "block": block},
                      lambda b=block: (ashape.build_index(a, n, heads=h_kv, block_m=b, block_n=b, head_space="kv", device=dev), None, ashape.predicate(a), None)))
    gen = torch.Generator().manual_seed(0)
    for name, n_vert, n_slash in VS_CASES:
        lines = planted_vs_lines(n, h_kv, dev, n_vert, n_slash, gen)
        for bm, bn in ((64, 64), (128, 64)):
            cases.append((f"{name}_b{bm}x{bn}", {"vertical": n_vert, "slash": n_slash, "block_m": bm, "block_n": bn},
                          lambda lines=lines, bm=bm, bn=bn: (vertical_slash.index_from_lines(lines, block_m=bm, block_n=bn), None, None, None)))
    t = triangle.TriangleParams(sink=64, window=512, last=128)
    # 128-blocks: the rows of Runs 1-6; LAYER_BLOCK (64): what the runtime runs a TriangleMix layer with.
    for block, suffix in ((128, ""), (triangle.LAYER_BLOCK, f"_b{triangle.LAYER_BLOCK}")):
        cases.append((f"triangle_64_512_128{suffix}", {"sink": 64, "window": 512, "last": 128, "block": block},
                      lambda block=block: (triangle.build_index(t, n, heads=h_kv, block_m=block, block_n=block, head_space="kv", device=dev),
                                           lambda q_, k_, v_, i_: triangle_attention(q_, k_, v_, i_, t.last), triangle.predicate(t, n),
                                           triangle.split_row(t, n))))
    return cases


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def run(args) -> list[dict]:
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    command = "python -m benchmarks.kernels " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    props = torch.cuda.get_device_properties(dev)
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        # Every (length, mask_mod) pair compiles anew; past dynamo's default limit of 8 recompiles flex
        # falls back to its eager path, which materialises the scores (2 TiB at 128K).
        torch._dynamo.config.cache_size_limit = 64
        flex = torch.compile(flex_attention, dynamic=False)
    clock, flush = cuda_clock(), l2_flush()
    rows = []
    for n in args.lengths:
        torch.manual_seed(n)
        q = torch.randn(1, args.heads, n, args.dim, device=dev, dtype=dtype)
        k = torch.randn(1, args.kv_heads, n, args.dim, device=dev, dtype=dtype)
        v = torch.randn(1, args.kv_heads, n, args.dim, device=dev, dtype=dtype)
        group = args.heads // args.kv_heads
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        sdpa = lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
        t_sdpa = bench(sdpa)  # cold: alone, once per length
        sdpa_tflops = 4 * n * n / 2 * args.dim * args.heads / t_sdpa / 1e9
        vs_params = vertical_slash.VerticalSlashParams(vertical_size=1000, slash_size=2048)
        t_estimate = bench(lambda: vertical_slash.estimate(vs_params, q, k, head_space="query"), warmup_ms=10, rep_ms=50)
        print(f"N={n}: SDPA causal {t_sdpa:.3f} ms ({sdpa_tflops:.0f} TFLOP/s); VS estimate {args.heads} heads {t_estimate:.3f} ms "
              f"({100 * t_estimate / t_sdpa:.1f}% of SDPA)", flush=True)
        for name, params, build in make_cases(n, q, k, args):
            if args.cases and not any(c in name for c in args.cases):
                continue
            index, runner, mask_mod, tail_from = build()
            torch.cuda.synchronize()
            index_ms = bench(lambda: build(), warmup_ms=10, rep_ms=50)
            runner = runner or (lambda q_, k_, v_, i_: block_sparse_attention(q_, k_, v_, i_))
            out, _ = runner(q, k, v, index)
            t_ours, t_sdpa_paired, reps = paired(lambda: runner(q, k, v, index), sdpa, clock, flush, args.gap_ms)
            t_alone, t_sdpa_alone = alone(lambda: runner(q, k, v, index), sdpa)
            density = computed_density(index, n)
            if tail_from is not None:  # triangle: the dense tail rows are computed too
                density += (args.heads * 128 * n) / (args.heads * n * n / 2)
            err = _check(q, k, v, out, index, n, group, mask_mod, tail_from)
            row = {
                "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                "case": name, "params": params, "n": n, "batch": 1, "q_heads": args.heads, "kv_heads": args.kv_heads,
                "head_dim": args.dim, "dtype": args.dtype, "density": round(density, 5),
                "t_sdpa_ms": round(t_sdpa, 4), "t_ours_ms": round(t_ours, 4),
                "sdpa_timing": "interleaved", "gap_ms": args.gap_ms, "paired_reps": reps, "t_sdpa_paired_ms": round(t_sdpa_paired, 4),
                "eff_ours": round(density * t_sdpa_paired / t_ours, 3), "eff_ours_cold": round(density * t_sdpa / t_ours, 3),
                "speedup_vs_sdpa": round(t_sdpa_paired / t_ours, 2),
                "t_ours_alone_ms": round(t_alone, 4), "t_sdpa_alone_ms": round(t_sdpa_alone, 4),
                "eff_ours_alone": round(density * t_sdpa_alone / t_alone, 3),
                "index_ms": round(index_ms, 4), "index_bytes": index_bytes(index), "rel_err_last_rows": err,
                "command": command,
            }
            if name.startswith("vs_"):
                row.update(vs_estimate_ms=round(t_estimate, 4), vs_estimate_pct_of_sdpa=round(100 * t_estimate / t_sdpa, 2))
            if args.graphs:
                replay = graphed(lambda: runner(q, k, v, index))
                t_graph, t_sdpa_graph, _ = paired(replay, sdpa, clock, flush, args.gap_ms)
                t_graph_alone, t_sdpa_graph_alone = alone(replay, sdpa)
                row.update(t_ours_graph_ms=round(t_graph, 4), eff_ours_graph=round(density * t_sdpa_graph / t_graph, 3),
                           t_ours_graph_alone_ms=round(t_graph_alone, 4),
                           eff_ours_graph_alone=round(density * t_sdpa_graph_alone / t_graph_alone, 3))
            if flex is not None and index.col_count is None:
                mm = causal if mask_mod == "causal" else mask_mod
                try:
                    bm = flex_block_mask(index, n, args.heads, mm, tail_from)
                    # Flex tiles must divide the mask's blocks: its default tiles (128 x 64 for d=128) refuse 64-blocks.
                    opts = {"BLOCK_M": 64, "BLOCK_N": 64} if min(index.block_m, index.block_n) < 128 else None
                    run_flex = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=opts)  # noqa: E731
                    run_flex()
                    t_flex, t_sdpa_flex, _ = paired(run_flex, sdpa, clock, flush, args.gap_ms)
                    t_flex_alone, t_sdpa_flex_alone = alone(run_flex, sdpa)
                    row.update(t_flex_ms=round(t_flex, 4), t_sdpa_flex_paired_ms=round(t_sdpa_flex, 4),
                               eff_flex=round(density * t_sdpa_flex / t_flex, 3), eff_flex_cold=round(density * t_sdpa / t_flex, 3),
                               t_flex_alone_ms=round(t_flex_alone, 4), eff_flex_alone=round(density * t_sdpa_flex_alone / t_flex_alone, 3))
                    if args.graphs:
                        t_graph, t_sdpa_graph, _ = paired(graphed(run_flex), sdpa, clock, flush, args.gap_ms)
                        row.update(t_flex_graph_ms=round(t_graph, 4), eff_flex_graph=round(density * t_sdpa_graph / t_graph, 3))
                except Exception as exc:  # report, keep benchmarking the rest
                    row["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps({k_: row[k_] for k_ in ("case", "n", "density", "t_ours_ms", "eff_ours", "eff_ours_alone", "t_flex_ms", "eff_flex", "t_ours_graph_ms", "t_flex_graph_ms", "t_sdpa_paired_ms", "index_ms", "rel_err_last_rows") if k_ in row}), flush=True)
        del q, k, v, k_rep, v_rep
        torch.cuda.empty_cache()
    return rows


def _check(q, k, v, out, index, n, group, mask_mod, tail_from, rows: int = 256) -> float:
    """Relative error of our output on the last `rows` query rows against the fp32 oracle."""
    qs = q[:, :, -rows:]
    if tail_from is not None:
        mask = predicate_mask_fn(mask_mod, 1, q.shape[1], rows, n)
    else:
        full = index_mask_fn(index, n, n, group)
        mask = lambda r: full(r + n - rows)
    ref, _ = masked_attention(qs, k, v, mask, chunk=64)
    return round(relative_error(out[:, :, -rows:], ref), 6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--cases", nargs="*", help="substrings of case names to run (default all)")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--graphs", action="store_true",
                        help="also time each kernel (ours and FlexAttention) as a CUDA-graph replay: GPU time without host launch cost")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle the GPU this long before every timed call, so each starts from the same power state (RESULTS.md, Run 13)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.jsonl"),
                        help="JSON-lines file for the rows (replaced, unless --append)")
    parser.add_argument("--append", action="store_true",
                        help="add the rows to --out instead of replacing it (several --lengths/--cases calls, one file)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels needs a CUDA GPU")
    started = time.time()
    rows = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a" if args.append else "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows -> {args.out} in {time.time() - started:.0f} s")
    print(f"{'case':32s} {'N':>7s} {'dens':>6s} {'ours ms':>9s} {'eff':>5s} {'flex ms':>9s} {'eff':>5s} {'SDPA pair':>9s} {'SDPA cold':>9s} {'idx ms':>7s} {'err':>8s}")
    for r in rows:
        print(f"{r['case']:32s} {r['n']:7d} {r['density']:6.3f} {r['t_ours_ms']:9.3f} {r['eff_ours']:5.2f} "
              f"{r.get('t_flex_ms', math.nan):9.3f} {r.get('eff_flex', math.nan):5.2f} {r['t_sdpa_paired_ms']:9.3f} {r['t_sdpa_ms']:9.3f} "
              f"{r['index_ms']:7.2f} {r['rel_err_last_rows']:8.1e}")


if __name__ == "__main__":
    main()
