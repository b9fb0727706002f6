"""The persistent warp-specialized kernel (kernels/block_sparse_ws.py) against the Triton kernel it replaces.

    python -m benchmarks.ws_ab --n 4000 32768 --k-blocks 12 24 48 [--stages N] [--vs] [--ashape] [--heads 28 4] [--dim 64]

Per length: block top-k indexes (64-blocks, kv head space, 32 query / 8 KV heads unless --heads, d 128 unless --dim, bf16) plus the
"diag_only" and "null" indexes of benchmarks/program_cost.py (--vs: also benchmarks/kernels.py's planted vertical-slash indexes, whose
columns both kernels read from the column table; --ashape: A-shape with a 128-token sink and a 4096-token window,
every block partial under the window/sink mask, near-dense at 8K). Each row checks the new kernel against the Triton one
(max |out| and |lse| difference, -inf lse where Triton has it), then times Triton, new, Triton in one loop from CUDA
graphs with the L2 flushed (ABA: neither kernel always follows the other), and SDPA in its own loop once per length
(RESULTS.md, Run 13). Efficiency = density x t_SDPA / t. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.kernels import VS_CASES, computed_density, planted_vs_lines
from benchmarks.program_cost import cases, gqa_inputs, sdpa_alone_ms
from benchmarks.rows import emit
from benchmarks.timing import cuda_clock, graphed, interleaved_ms, l2_flush


def _cases(q, k, args) -> dict:
    """name -> index: program_cost's top-k/diag_only/null indexes, plus the vertical-slash ones with --vs and
    A-shape 128/4096 with --ashape."""
    from sparsesearch.patterns import ashape, vertical_slash

    out = cases(q, k, args.k_blocks, 64)
    if args.vs:
        gen = torch.Generator().manual_seed(0)
        for name, n_vert, n_slash in VS_CASES:
            lines = planted_vs_lines(q.shape[2], k.shape[1], q.device, n_vert, n_slash, gen)
            out[name] = vertical_slash.index_from_lines(lines, block_m=64, block_n=64)
    if args.ashape:
        out["ashape_128_4096"] = ashape.build_index(ashape.AShapeParams(sink=128, local=4096), q.shape[2],
                                                    heads=k.shape[1], block_m=64, block_n=64, head_space="kv",
                                                    device=q.device)
    return out


def run(args) -> list[dict]:
    from sparsesearch.kernels import block_sparse_attention
    from sparsesearch.kernels.block_sparse import _launch_config
    from sparsesearch.kernels.block_sparse_ws import block_sparse_ws_attention, ws_eligible

    clock, flush = cuda_clock(), l2_flush()
    command = "python -m benchmarks.ws_ab " + " ".join(sys.argv[1:])
    rows = []
    for n in args.n:
        q, k, v = gqa_inputs(n, *args.heads, args.dim)
        sdpa_ms = sdpa_alone_ms(q, k, v, clock, flush)
        triton_cfg = {key: val for key, val in _launch_config(64, 64, args.dim, q.device).items() if key != "ws"}
        new = lambda index: block_sparse_ws_attention(q, k, v, index, scale=1 / math.sqrt(args.dim), stages=args.stages)
        old = lambda index: block_sparse_attention(q, k, v, index, config=dict(triton_cfg))
        for name, index in _cases(q, k, args).items():
            if not ws_eligible(q, k, v, index):
                raise SystemExit(f"{name}: the new kernel does not take this launch")
            (o1, l1), (o2, l2) = old(index), new(index)
            finite = torch.isfinite(l1)
            timed = interleaved_ms([graphed(lambda: old(index)), graphed(lambda: new(index)), graphed(lambda: old(index))],
                                   clock=clock, flush=flush)
            t_old, t_new = (timed.ms[0] + timed.ms[2]) / 2, timed.ms[1]
            density = computed_density(index, n)
            rows += emit([{
                "bench": "ws_ab", "device": torch.cuda.get_device_name(), "n": n, "heads": list(args.heads), "dim": args.dim, "case": name,
                "density": round(density, 5),
                "stages": args.stages, "triton_ms": round(t_old, 4), "ws_ms": round(t_new, 4),
                "speedup": round(t_old / t_new, 3), "sdpa_ms": round(sdpa_ms, 3),
                "eff_triton": round(density * sdpa_ms / t_old, 4) if density else None,
                "eff_ws": round(density * sdpa_ms / t_new, 4) if density else None,
                "max_out_diff": round((o1.float() - o2.float()).abs().max().item(), 5),
                "max_lse_diff": round((l1[finite] - l2[finite]).abs().max().item(), 5) if finite.any() else 0.0,
                "empty_rows_match": bool(torch.equal(finite, torch.isfinite(l2))), "reps": timed.reps,
            }], command)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[32768])
    parser.add_argument("--k-blocks", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--stages", type=int, default=None, help="K/V ring depth (default: the kernel's plan, 3 or 4)")
    parser.add_argument("--vs", action="store_true", help="add the planted vertical-slash indexes (column table)")
    parser.add_argument("--ashape", action="store_true", help="add A-shape 128/4096 (window/sink masks)")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"),
                        help="query and KV heads (28 4: Qwen2-VL-7B's odd group of 7)")
    parser.add_argument("--dim", type=int, default=128, choices=(64, 128), help="head dim (64: Llama-3.2-1B's)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    run(args)


if __name__ == "__main__":
    main()
