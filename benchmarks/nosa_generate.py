"""Decode throughput of ``model.generate()`` itself (P6 §4): dense (transformers' own cache, SDPA) vs NOSA
through ``enable_nosa`` with the engine's torch decoder and with its slot decoder (runtime/nosa_device.py: the
fused Triton step on a GPU), on a real-shaped model built from its config with random weights (no
download: the GPU host has no network).

benchmarks/nosa_decode.py measures the decoder alone in CUDA graphs under an equal GPU KV budget; this one
measures what a user calling generate() gets, eager, at an equal batch: transformers' per-step Python and
the model's projections and MLPs included. Per (context, batch, system) it times generate() of 1 token
(the prefill) and of ``--new-tokens`` tokens after a warm-up run of the same shape, and reports decode
tokens/s = batch · (new_tokens − 1) / (t_new − t_1), the speed-up over dense at the same (context, batch),
the NOSA cache's device vs host bytes, H2D traffic, and blocks dropped (must be 0).

    PYTHONPATH=. python benchmarks/nosa_generate.py --shape smollm2 --contexts 16384 32768 --batch 8 16 --out nosa_generate.jsonl
    PYTHONPATH=. python benchmarks/nosa_generate.py --shape llama1b --contexts 16384 32768 --batch 8 16

CPU smoke run (tiny shape, not a speed claim):

    PYTHONPATH=. python benchmarks/nosa_generate.py --shape tiny --contexts 300 --batch 2 --new-tokens 6 --budget 128 --block 32

Rows: one JSON line each (--out), a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from benchmarks.rows import emit, write_jsonl
from sparsesearch.nosa.config import make_config
from sparsesearch.runtime.nosa_engine import disable_nosa, enable_nosa

# LlamaConfig fields of each shape (SmolLM2-135M and Llama-3.2-1B as published; tiny for the CPU smoke run)
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=300),
}
SYSTEMS = ("dense", "nosa-torch", "nosa-slot")


def build_model(shape: str, context: int, dtype: torch.dtype, device: str):
    """A LlamaForCausalLM of the named shape with random weights, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(context * 2, 4096), attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model, ids, new_tokens: int, cache_of, device: str) -> tuple[float, object]:
    """Seconds of one greedy generate() of exactly ``new_tokens`` tokens; cache_of() makes its cache (None: dense)."""
    cache = cache_of()
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
    sync(device)
    return time.perf_counter() - start, cache


def measure(model, system: str, ids, args, device: str) -> dict:
    """One (system, context, batch) row: prefill and decode times, tokens/s, the NOSA cache's accounting."""
    cache_of = lambda: None  # noqa: E731
    if system != "dense":
        cfg = make_config(args.budget, args.kq_ratio, args.block, args.proxy)
        fused = None if device.startswith("cuda") else False  # the Triton step on a GPU; the torch path on a CPU run
        engine = enable_nosa(model, cfg=cfg, decoder=system.removeprefix("nosa-"), fused=fused if system == "nosa-slot" else None)
        cache_of = lambda: engine.new_cache(max_new_tokens=args.new_tokens)  # noqa: E731
    try:
        timed_generate(model, ids, 2, cache_of, device)  # warm-up: kernels compiled, allocator primed at this shape
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t1, _ = timed_generate(model, ids, 1, cache_of, device)
        tn, cache = timed_generate(model, ids, args.new_tokens, cache_of, device)
    finally:
        if system != "dense":
            disable_nosa(model)
    batch, steps = ids.shape[0], args.new_tokens - 1
    row = {"system": system, "context": ids.shape[1], "batch": batch, "new_tokens": args.new_tokens, "prefill_ms": t1 * 1e3,
           "decode_ms_per_step": (tn - t1) / steps * 1e3, "tokens_per_s": batch * steps / max(tn - t1, 1e-9)}
    if device.startswith("cuda"):
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if system != "dense":
        layers = [layer for layer in cache.layers if getattr(layer, "filled", False)]
        totals = {key: sum(layer.memory()[key] for layer in layers) for key in ("device_bytes", "host_bytes", "h2d_bytes")}
        row |= {"proxy": args.proxy, "budget": args.budget, "kq_ratio": args.kq_ratio, "block": args.block,
                "nosa_device_mib": totals["device_bytes"] / 2**20, "nosa_host_mib": totals["host_bytes"] / 2**20,
                "h2d_mib_per_step": totals["h2d_bytes"] / 2**20 / steps,
                "dropped_blocks": sum(layer.memory().get("dropped_blocks", 0) for layer in layers)}
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--budget", type=int, default=2048, help="NOSA budget in tokens (k = budget / block)")
    parser.add_argument("--kq-ratio", type=float, default=0.25)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--proxy", default="vnorm", choices=["vnorm", "random"], help="a proxy both decoders serve on a stock model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: needs at least 2 (the first token comes from the prefill)")
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    command = "PYTHONPATH=. python benchmarks/nosa_generate.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    model = build_model(args.shape, max(args.contexts), dtype, device)
    rows = []
    for context in args.contexts:
        for batch in args.batch:
            ids = torch.randint(0, SHAPES[args.shape]["vocab_size"], (batch, context), device=device)
            got = [measure(model, system, ids, args, device) | {"device": name, "shape": args.shape} for system in args.systems]
            dense = next((r["tokens_per_s"] for r in got if r["system"] == "dense"), None)
            for r in got:
                r["speedup_vs_dense"] = r["tokens_per_s"] / dense if dense else None
            rows += emit(got, command)
    write_jsonl(args.out, rows)
    print("\n| system | context | batch | tokens/s | ms/step | vs dense | H2D MiB/step | dropped |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else "-"
        print(f"| {r['system']} | {r['context']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['decode_ms_per_step']:.2f} | {vs} | "
              f"{r.get('h2d_mib_per_step', 0):.2f} | {r.get('dropped_blocks', '-')} |")
    return rows


if __name__ == "__main__":
    main()
