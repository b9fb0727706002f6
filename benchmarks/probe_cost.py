"""TriangleMix probe cost on a random-weight 8B-shaped stack: time and peak GPU memory per sample.

    python benchmarks/probe_cost.py --tokens 2048 8192 32768

One probe sample = forward with autograd + backward to y_gt + the blockwise section sums of every layer
(Triton kernel). The paper probes at 2K with eager attention (an n x n θ per layer); here memory is O(N)
in the probe itself, so the backward pass's activations dominate. Gradient checkpointing (on by default
above 8K) keeps them to one layer at a time.
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
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.ttft import SHAPES
from sparsesearch.probe.probe import probe_sample
from sparsesearch.probe.sections import SectionSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/probe_cost.jsonl"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/probe_cost.py needs a CUDA GPU")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.tokens), attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.requires_grad_(False)
    spec = SectionSpec(sink=64, window=128, last=128)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    for n in args.tokens:
        checkpoint = n > 8192
        if checkpoint:
            model.gradient_checkpointing_enable()
            model.train()  # transformers checkpoints only in training mode; Llama has no dropout
        else:
            model.gradient_checkpointing_disable()
            model.eval()
        ids = torch.randint(0, config.vocab_size, (n,))
        probe_sample(model, ids, 42, spec, device="cuda")  # warm-up: compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = probe_sample(model, ids, 42, spec, device="cuda")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "shape": args.shape,
               "tokens": n, "checkpointing": checkpoint, "seconds_per_sample": round(seconds, 3),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
               "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2),
               "last_layer_middle_abs": float(out["abs"][-1, :, 1].abs().max()), "command": command}
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
