"""`sparsesearch evaluate`: fidelity of an artifact's sparse runtime against dense on held-out prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import DeviceOpt, JsonOpt, RunProgress, exits_cleanly, out_console, print_json


@exits_cleanly
def evaluate(
    artifacts: Annotated[list[Path], typer.Argument(help="Artifact directories (manifest.json + *.parquet); several are compared with one dense run.", show_default=False)],
    model: Annotated[str, typer.Option(help="The model the artifacts were made for (alias, directory, hub id, .gguf).")] = "smollm2-135m",
    data: Annotated[str, typer.Option(help="Held-out data: text:shakespeare (held-out plays) or a .txt/.md file (its second half), synthetic:passkey, synthetic:kv-retrieval, or a file/dataset dir.")] = "text:shakespeare",
    samples: Annotated[int, typer.Option(help="Prompts.")] = 5,
    tokens: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 2048,
    seed: Annotated[int, typer.Option(help="Seed of the held-out prompts.")] = 0,
    min_tokens: Annotated[int, typer.Option(help="Runtime: prompts shorter than this run dense.")] = 1024,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Teacher-forced KL and perplexity over every position, retrieval counts (or why they say nothing) and, on
    retrieval data, the keys dense holds and the artifact keeps read teacher-forced (sparsesearch/keycheck.py),
    next-token KL, greedy agreement and per-layer attention error, sparse vs dense. Several artifacts share
    one dense run on the same prompts (a target sweep's passkey check costs one reference, not one each);
    --json then prints a list of reports, each with its "artifact".

    Example: sparsesearch evaluate artifacts/smollm2-135m --data text:shakespeare --samples 4 --tokens 4096
    """
    from sparsesearch import preflight as check
    from sparsesearch.artifacts import load_artifact
    from sparsesearch.data import is_retrieval_spec
    from sparsesearch.fidelity import as_artifact, check_options, describe, evaluate_against, held_out_reference
    from sparsesearch.keycheck import dense_keys, keys_report
    from sparsesearch.models import load_model

    # Everything the arguments, the artifacts and the model's config can tell, before the weights load.
    resolved = check.model_info(model, dtype=dtype, device=device)
    check.tokens_fit("--tokens", tokens, resolved)
    check_options(samples=samples, tokens=tokens, min_tokens=min_tokens)
    check.data("--data", data, tokens=tokens, held_out=True)
    arts = [load_artifact(a, model_info=resolved) for a in artifacts]
    for art in arts:
        recommended = ((art.manifest.get("methods") or {}).get("nosa") or {}).get("recommended") or {}
        if recommended.get("proxy") == "trained":  # the runtime would refuse it only after the weights load
            check.eviction_head_possible("the artifact's methods.nosa proxy", model)
    with RunProgress(transient=json_out) as progress:
        progress.stage("loading model")
        m, tokenizer, info = load_model(model, dtype=dtype, device=device)
        progress.stage(PASSES["dense"])
        reference = held_out_reference(m, tokenizer, data=data, samples=samples, tokens=tokens, seed=seed,
                                       on_prompt=progress.tick)
        keys = None
        if is_retrieval_spec(data):  # the answers read teacher-forced too: greedy counts judge the format as well
            progress.stage("passkey keys, dense, teacher-forced")
            keys = dense_keys(m, tokenizer, reference.samples)
        results = []
        for path, art in zip(artifacts, arts):
            progress.stage(PASSES["sparse"] + (f" ({path.name})" if len(arts) > 1 else ""))
            result = evaluate_against(m, tokenizer, art.manifest, art.head_rows(), reference, min_tokens=min_tokens,
                                      on_prompt=progress.tick)
            if keys is not None:
                progress.stage(f"passkey keys, sparse ({path.name})")
                result["keys"] = keys_report(m, keys, as_artifact(art.manifest, art.head_rows()), min_tokens=min_tokens)
            results.append(result)
    if json_out:
        print_json(results[0] if len(results) == 1 else [{"artifact": str(p), **r} for p, r in zip(artifacts, results)])
        return
    for path, result in zip(artifacts, results):
        if len(results) > 1:
            out_console.print(f"[bold]{path}[/bold]")
        for line in describe(result):
            out_console.print(line)
        errs = result["layer_output_error"]
        if errs:
            worst = max(errs, key=errs.get)
            out_console.print(f"attention output error per layer: mean {sum(errs.values()) / len(errs):.3f}, worst layer {worst} ({errs[worst]:.3f})")


PASSES = {"dense": "dense reference, prompts", "sparse": "sparse runtime, prompts"}
