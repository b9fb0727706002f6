"""Time to first token with TriangleMix layers vs dense, on random-weight model stacks (paper 002: 12–32%
TTFT reduction on Llama-3.1-8B).

    python benchmarks/ttft.py --shape 8b --tokens 32768 131072 --starts 16 0

Shapes: `8b` (Llama-3.1-8B: 32 layers, 32/8 heads, head_dim 128, hidden 4096, MLP 14336) and `smollm2`
(30 layers, 9/3 heads, head_dim 64, hidden 576, MLP 1536). Random weights give the real amount of work;
the prefill runs `model(input_ids, logits_to_keep=1)` in bf16 (what generate's first step does). Triangle
layers use the inference defaults sink 8 / window 512 / last 128 through the sparsesearch runtime.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
import triton
from transformers import LlamaConfig, LlamaForCausalLM

from sparsesearch.runtime import apply, remove

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    # Qwen2-7B's / Qwen2-VL-7B's language model (GQA 28/4: groups of 7), as a Llama stack (no q/k/v bias; timing only).
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
}


def triangle_artifact(start: int | None) -> SimpleNamespace:
    tri = None if start is None else {"start_layer": start, "sink": 8, "window": 512, "last": 128}
    return SimpleNamespace(manifest={"head_index_space": "kv", "methods": {"trianglemix": tri}}, heads=pd.DataFrame())


def prefill_fn(model, n: int):
    """generate's first step on ``n`` random tokens (no KV cache kept, last logits only), as a callable."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=1, use_cache=False)

    return prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--starts", type=int, nargs="+", default=[16, 0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ttft.jsonl"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ttft.py needs a CUDA GPU")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.tokens), attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    rows = []
    for n in args.tokens:
        prefill = prefill_fn(model, n)
        t_dense = triton.testing.do_bench(prefill, warmup=200, rep=1000, return_mode="median")
        for start in args.starts:
            apply(model, triangle_artifact(start), min_tokens=1024)
            try:
                t_tri = triton.testing.do_bench(prefill, warmup=200, rep=1000, return_mode="median")
            finally:
                remove(model)
            row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "shape": args.shape, "layers": config.num_hidden_layers, "q_heads": config.num_attention_heads,
                   "kv_heads": config.num_key_value_heads, "head_dim": config.hidden_size // config.num_attention_heads,
                   "tokens": n, "triangle_start_layer": start, "ttft_dense_ms": round(t_dense, 2), "ttft_triangle_ms": round(t_tri, 2),
                   "reduction": round(1 - t_tri / t_dense, 4), "command": command}
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
