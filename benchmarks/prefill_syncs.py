"""Host waits in the runtime's prefill, and eager prefill time at short lengths (issue 14 §2, short contexts).

    python -m benchmarks.prefill_syncs --tokens 4096 8192 16384

The 8B-shaped random-weight stack of ``benchmarks/e2e_prefill.py`` (its pattern mix mapped from an artifact,
indexes estimated on the stack's q/k as in deployment), prefilled eagerly on SDPA and through the runtime. Each
row also counts the calls that made the host wait for the GPU during one sparse prefill
(``torch.cuda.set_sync_debug_mode``), grouped by the innermost sparsesearch frame (else the caller's).

Every such wait drains the GPU's queue before the host goes on. The host then cannot prepare the next launches
while the GPU works, and at short lengths that host time is comparable to the GPU work itself.

Needs a CUDA GPU with room for the 8B weights (16 GB).
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks.e2e_prefill import mapped_artifact, timed_ms
from benchmarks.rows import write_jsonl
from benchmarks.ttft import SHAPES, prefill_fn


def waits(fn) -> collections.Counter:
    """Call sites (innermost sparsesearch frame, else the warning's own) of the host waits during fn()."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack() if "/sparsesearch/" in f.filename]
        where = ours[-1] if ours else None
        sites[f"{where.filename.rsplit('/sparsesearch/', 1)[-1]}:{where.lineno} {where.name}" if where else f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sites


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsesearch.artifacts import load_artifact
    from sparsesearch.runtime import apply, remove

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped stack")
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/reference/smollm2-135m-4k"))
    parser.add_argument("--out", type=Path, default=None, help="write the rows to this .jsonl")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.prefill_syncs needs a CUDA GPU")
    torch.manual_seed(0)
    shape = dict(SHAPES["8b"], num_hidden_layers=args.layers)
    config = LlamaConfig(**shape, max_position_embeddings=max(args.tokens), attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    src = load_artifact(args.artifact)
    command = "python -m benchmarks.prefill_syncs " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for n in args.tokens:
        prefill = prefill_fn(model, n)
        t_dense = timed_ms(prefill)
        apply(model, mapped_artifact(src, args.layers, shape["num_key_value_heads"], n), min_tokens=1024)
        try:
            t_sparse = timed_ms(prefill)
            sites = waits(prefill)
        finally:
            remove(model)
        row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "8b", "layers": args.layers,
               "tokens": n, "prefill_dense_ms": round(t_dense, 2), "prefill_sparse_ms": round(t_sparse, 2),
               "speedup": round(t_dense / t_sparse, 3), "host_waits": sum(sites.values()), "wait_sites": dict(sites.most_common()),
               "command": command}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
