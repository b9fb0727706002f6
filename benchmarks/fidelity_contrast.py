"""Fidelity of several sparse settings against one dense reference, through the one fidelity path.

    python -m benchmarks.fidelity_contrast --model smollm2-135m --data text:shakespeare --samples 4 --tokens 4096 \
        --candidate artifact:artifacts/reference/smollm2-135m-4k --candidate triangle:0 --candidate ashape:64:512
    python -m benchmarks.fidelity_contrast --model gemma3-270m --data synthetic:passkey --samples 20 --tokens 4096 \
        --candidate triangle:first --candidate ashape:64:512
    # on a GPU (gguf wheel carried), retrieval at 4K, 8K and 16K, 20 spread depths each:
    for n in 4096 8192 16384; do for d in synthetic:passkey synthetic:kv-retrieval; do
      python -m benchmarks.fidelity_contrast --model gemma3-270m --data $d --samples 20 --tokens $n \
        --candidate triangle:first --candidate ashape:64:512 --out benchmarks/results/fidelity_gemma3_h200.jsonl; done; done

The model loads once and the dense reference runs once (sparsesearch/fidelity.py: attend); each candidate
is compared with it (fidelity.compare: teacher-forced KL and perplexity over every position, next-token
KL after the prompt, retrieval counts with a verdict). Candidates:

- ``artifact:PATH`` -- a written artifact (what ``sparsesearch evaluate`` measures);
- ``triangle:L`` -- TriangleMix inference defaults (sink 8, window 512, last 128) on every global layer from
  L on (``first``: the first global layer), nothing below it;
- ``ashape:SINK:LOCAL`` -- A-shape (sink + local window) in every head of every global layer.

One JSON row per candidate goes to --out (appended), with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch


def candidate(spec: str, info):
    """(name, artifact-like object with manifest and heads) for one --candidate value."""
    from sparsesearch.artifacts import load_artifact
    from sparsesearch.artifacts.columns import ALL_MODALITIES, row_from_params
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.patterns.ashape import AShapeParams
    from sparsesearch.probe.run import _triangle_manifest

    kind, _, rest = spec.partition(":")
    if kind == "artifact":
        art = load_artifact(Path(rest), model_info=info)
        return SimpleNamespace(manifest=art.manifest, heads=pd.DataFrame(art.head_rows()))
    if kind == "triangle":
        start = info.global_layers[0] if rest == "first" else int(rest)
        return SimpleNamespace(manifest=_triangle_manifest(info, start, None), heads=pd.DataFrame(columns=["layer"]))
    if kind == "ashape":
        sink, local = (int(v) for v in rest.split(":"))
        rows = [{"layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES, "boundary": "none",
                 "pattern": "ashape", **row_from_params(AShapeParams(sink=sink, local=local)), "block_m": 64, "block_n": 64,
                 "density": None, "recall": None, "output_error": None, "latency_ms": None, "score": None}
                for layer in info.global_layers for head in range(info.num_kv_heads)]
        manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "manual", "source": f"fidelity_contrast {spec}"})
        return SimpleNamespace(manifest=manifest, heads=pd.DataFrame(rows))
    raise SystemExit(f"--candidate {spec!r}: use artifact:PATH, triangle:L|first or ashape:SINK:LOCAL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="text:shakespeare")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--min-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--candidate", action="append", required=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fidelity_contrast.jsonl"))
    args = parser.parse_args()

    from sparsesearch.fidelity import attend, check_options, compare, held_out_samples
    from sparsesearch.models import load_model

    check_options(samples=args.samples, tokens=args.tokens, min_tokens=args.min_tokens)
    command = "python -m benchmarks.fidelity_contrast " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.perf_counter()
    model, tokenizer, info = load_model(args.model, device=args.device)
    device = str(next(model.parameters()).device)
    machine = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    loaded = time.perf_counter()
    prompts, depths = held_out_samples(args.data, tokenizer, samples=args.samples, tokens=args.tokens, seed=args.seed)
    dense = attend(model, tokenizer, prompts)
    dense_s = time.perf_counter() - loaded
    print(f"loaded in {loaded - started:.0f} s; dense reference {dense_s:.0f} s", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.candidate:
        t0 = time.perf_counter()
        sparse = attend(model, tokenizer, prompts, candidate(spec, info), min_tokens=args.min_tokens)
        report = compare(model, prompts, dense, sparse, min_tokens=args.min_tokens, depths=depths)
        row = {"model": args.model, "data": args.data, "samples": args.samples, "tokens": args.tokens,
               "min_tokens": args.min_tokens, "candidate": spec, **report, "dense_s": round(dense_s, 1),
               "candidate_s": round(time.perf_counter() - t0, 1), "device": machine, "dtype": info.dtype, "command": command}
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        tf, ret = report["teacher_forced"], report["retrieval"]
        print(f"{spec}: KL {tf['kl_mean']:.4f} (>= {tf['tail_from']}: {tf['kl_tail_mean']:.4f}), ppl {tf['ppl_dense']:.3f} -> {tf['ppl_sparse']:.3f}, "
              f"next-token KL {report['next_token_kl']:.4f}"
              + ("" if ret is None else f", retrieval dense {ret['dense_correct']}/{ret['n']} sparse {ret['sparse_correct']}/{ret['n']} ({ret['verdict']})"),
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
