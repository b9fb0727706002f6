"""`sparsesearch export`: write an artifact in another tool's format (one file at --out)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._shared import ArtifactArg
from .common import BadInput, DeviceOpt, JsonOpt, err_console, exits_cleanly, print_json
from .engines import ENGINE_FORMATS, engine_out_free, export_engine, print_engine_notes

FORMATS = ("minference", "flex", "duo", "json", "qwen-1m", "flashprefill", "flashinfer", "modelopt")


@exits_cleanly
def export(
    artifact: ArtifactArg,
    fmt: Annotated[str, typer.Option("--format", help="minference (MInference JSON), flex (FlexAttention block lists, .safetensors), duo (DuoAttention TSV), json, qwen-1m (sparse_attention_config.json for the dual-chunk engines) flashprefill (its dense-prefix flag line), flashinfer (BSR plans per KV head, .safetensors) or modelopt (a sparse_attention_config block); see docs/deploying.md.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="File to write (never a directory); replaced atomically.", show_default=False)],
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="flex, flashinfer: sequence length the block lists are built for (static patterns); qwen-1m --convert: held-out prompt length (default 2048).")] = None,
    block: Annotated[int, typer.Option("--block", help="flex: FlexAttention tile size (16, 32, 64 or 128); which keys are admitted follows the artifact's own block sizes.")] = 128,
    qk: Annotated[Optional[Path], typer.Option("--qk", help="flex: .safetensors with q.{layer} [B,Hq,N,D] and k.{layer} [B,Hkv,N,D] for dynamic patterns.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="flex: a held-out data spec (e.g. text:shakespeare); its --tokens-long prompt runs through --model and the dynamic heads' block lists are built from its own q/k.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="flex with --prompt, qwen-1m with --convert: the model the artifact was made for.")] = None,
    global_only: Annotated[bool, typer.Option("--global-only", help="Export only the global (all x all) rows of a multi-modal calibration: boundary heads as their global pattern, what the runtime runs without modality ids.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="qwen-1m, flashprefill, flashinfer, modelopt: replace an existing --out.")] = False,
    convert: Annotated[bool, typer.Option("--convert", help="qwen-1m: write heads of other kinds (A-shape, triangle, block top-k) in their closest vertical_and_slash form, once measured: the artifact and the converted file run through --model on held-out text, and the file is written only if KL(dense||converted) exceeds KL(dense||artifact) by at most --max-kl-increase (else exit 2).")] = False,
    eval_data: Annotated[str, typer.Option("--eval-data", help="qwen-1m --convert: held-out data the conversion is measured on.")] = "text:shakespeare",
    samples: Annotated[int, typer.Option("--samples", help="qwen-1m --convert: held-out prompts.")] = 2,
    max_kl_increase: Annotated[Optional[float], typer.Option("--max-kl-increase", help="qwen-1m --convert: most the mean teacher-forced KL against dense may grow by the conversion, in nats per position (default 0.01).")] = None,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Export an artifact to MInference JSON, FlexAttention block lists, DuoAttention TSV or plain JSON.

    flex writes per-layer kv_num_blocks / kv_indices / full_kv_* (+ mask tables) as layers.{L}.{name};
    sparsesearch.export.flex.block_mask_from_tensors(load_flex(FILE)[L]) turns one layer into a BlockMask.

    Example: sparsesearch export runs/llama-3.1-8b --format minference --out llama_minference.json
    """
    from sparsesearch import preflight as check
    from sparsesearch.artifacts import load_artifact, sha256_file

    if fmt not in FORMATS:
        raise BadInput(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if convert:
        _check_convert(fmt, model, samples, max_kl_increase)
    from sparsesearch.export._common import check_output_file

    check_output_file(out)
    # An export is one new file: never one of the artifact's (nor inside its directory), never the --qk input.
    reads = {"artifact": artifact, "--qk": qk, "--prompt": prompt, "--eval-data": eval_data if convert else None}
    check.output_path("--out", out, reads=reads, model=model)
    if fmt in ENGINE_FORMATS:
        engine_out_free(out, overwrite)
    tokens = (2048 if tokens is None else tokens) if convert else tokens
    info = _measured_model(model, tokens, eval_data, device) if convert else None
    art = load_artifact(artifact, model_info=info)  # with --convert: the artifact fits the model (one line if not)
    if global_only and "heads.parquet" in art.tables:
        from sparsesearch.export._common import global_only as keep_global

        art = keep_global(art)
    if convert:
        path, extra = _export_converted(art, out, info, model, tokens=tokens, eval_data=eval_data, samples=samples,
                                        max_kl_increase=max_kl_increase, device=device)
    elif fmt == "minference":
        from sparsesearch.export.minference import write_minference

        path = write_minference(art, out)
    elif fmt == "duo":
        from sparsesearch.export.duo import write_duo

        path = write_duo(art, out)
    elif fmt == "json":
        from sparsesearch.export.json_dump import write_json

        path = write_json(art, out)
    elif fmt in ENGINE_FORMATS:
        path, extra = export_engine(art, fmt, out, tokens=tokens)
    elif prompt is not None:
        path = _export_flex_prompt(art, out, tokens, block, prompt, model, qk)
    else:
        path = _export_flex(art, out, tokens, block, qk)
    digest = sha256_file(path)
    if json_out:
        print_json({"format": fmt, "out": str(path), "sha256": digest, **(extra if fmt in ENGINE_FORMATS else {})})
    else:
        if convert:
            _print_conversion(extra["conversion"])
        err_console.print(f"wrote {fmt} export of {art.path} to {path}", highlight=False)
        if fmt in ENGINE_FORMATS:
            print_engine_notes(extra)


def _check_convert(fmt: str, model: Optional[str], samples: int, max_kl_increase: Optional[float]) -> None:
    """--convert's options, before any file is read: it writes the qwen-1m file only, and only once measured."""
    import math

    if fmt != "qwen-1m":
        raise BadInput(f"--convert is for --format qwen-1m (it writes heads as vertical_and_slash), got --format {fmt}")
    if model is None:
        raise BadInput("--format qwen-1m --convert needs --model (the model the artifact was made for): a converted "
                       "file is written only once its KL is measured through the model")
    if samples < 1:
        raise BadInput(f"--samples must be >= 1, got {samples}")
    if max_kl_increase is not None and not (math.isfinite(max_kl_increase) and max_kl_increase >= 0):
        raise BadInput(f"--max-kl-increase must be a finite number >= 0, got {max_kl_increase}")


def _measured_model(model: str, tokens: int, eval_data: str, device: str):
    """The --convert model's facts from its config, with the prompt length and the held-out data checked
    against it, before the weights load."""
    from sparsesearch import preflight as check

    info = check.model_info(model, device=device)
    check.tokens_fit("--tokens", tokens, info)
    check.data("--eval-data", eval_data, tokens=tokens, held_out=True)
    return info


def _export_converted(art, out: Path, info, model: str, *, tokens: int, eval_data: str, samples: int,
                      max_kl_increase: Optional[float], device: str) -> tuple[Path, dict]:
    """qwen-1m with the closest vertical-slash form of every head lacking an exact entry (export.convert): converted
    and read back before the weights load (a refused head is one line), measured, then written whole, or refused
    when the KL grows by more than --max-kl-increase; (path, what to tell the user, the measurement included)."""
    from sparsesearch.export._common import write_file_atomic
    from sparsesearch.export.convert import DEFAULT_MAX_KL_INCREASE, convert_qwen1m, measure, refusal, reimport
    from sparsesearch.export.qwen1m import architecture_note, dca_block
    from sparsesearch.models import load_model

    converted = convert_qwen1m(art)
    back = reimport(converted.text, info)
    limit = DEFAULT_MAX_KL_INCREASE if max_kl_increase is None else max_kl_increase
    with err_console.status(f"loading {model}") as status:
        loaded, tokenizer, _ = load_model(model, device=device)
        result = measure(loaded, tokenizer, art, back, data=eval_data, samples=samples, tokens=tokens,
                         on_prompt=lambda name, done, total: status.update(f"measuring on {eval_data}: {name} run {done}/{total}"))
    reason = refusal(result, limit)
    if reason is not None:
        raise BadInput(reason)
    path = write_file_atomic(out, converted.text.encode())
    heads = info.num_layers * info.num_heads
    conversion = {"converted_heads": converted.kinds, "query_heads": heads, **result, "max_kl_increase": limit}
    return path, {"dual_chunk_attention_config": dca_block(), "note": architecture_note(art), "conversion": conversion}


def _print_conversion(conversion: dict) -> None:
    """Two lines: which heads were converted, and the KL numbers that let the file be written."""
    kinds = ", ".join(f"{name} {count}" for name, count in conversion["converted_heads"].items()) or "none needed it"
    done = sum(conversion["converted_heads"].values())
    err_console.print(f"converted {done} of {conversion['query_heads']} query heads to vertical_and_slash: {kinds}", highlight=False)
    err_console.print(
        f"measured on {conversion['eval_data']}, {conversion['samples']} prompt(s) of up to {conversion['tokens']} tokens: "
        f"KL(dense||artifact) {conversion['kl_artifact']:.6f}, KL(dense||converted) {conversion['kl_converted']:.6f}, "
        f"increase {conversion['kl_increase']:.6f} <= {conversion['max_kl_increase']:g}", highlight=False, soft_wrap=True)


def _export_flex(art, out: Path, tokens: Optional[int], block: int, qk: Optional[Path]) -> Path:
    from sparsesearch.export.flex import flex_tensors, write_flex

    if (tokens is None) == (qk is None):
        raise BadInput("--format flex needs exactly one of --tokens N (static patterns) or --qk FILE (any pattern)")
    if tokens is not None and tokens < 1:
        raise BadInput(f"--tokens must be >= 1, got {tokens}")
    layers = art.manifest["model"]["num_layers"]
    inputs = _load_qk(qk, layers) if qk is not None else None
    if inputs is None:  # --qk tensors were captured from the model: their length fits it and they are in memory
        _check_size(art, tokens, block)
    per_layer = {}
    with err_console.status("building block lists") as status:
        for layer in range(layers):
            status.update(f"building block lists: layer {layer + 1}/{layers}")
            if inputs is not None:
                q, k = inputs[layer]
                per_layer[layer] = flex_tensors(art, layer, q=q, k=k, block=block)
            else:
                per_layer[layer] = flex_tensors(art, layer, q_len=tokens, block=block)
    meta = {"artifact": art.path.name, "heads_sha256": art.manifest["files"].get("heads.parquet", "")}
    return write_flex(per_layer, out, metadata=meta)


def _export_flex_prompt(art, out: Path, tokens: Optional[int], block: int, prompt: str, model: Optional[str], qk: Optional[Path]) -> Path:
    """flex block lists of every head, dynamic ones included, on one held-out prompt of --prompt run through
    --model: everything the arguments and the model's config can tell is checked before the weights load."""
    from sparsesearch import preflight as check
    from sparsesearch.artifacts import load_artifact
    from sparsesearch.data import held_out
    from sparsesearch.export.flex import captured_flex, write_flex
    from sparsesearch.models import load_model

    if qk is not None or model is None or tokens is None:
        raise BadInput("--format flex --prompt needs --model and --tokens, and no --qk")
    info = check.model_info(model)
    check.tokens_fit("--tokens", tokens, info)
    check.data("--prompt", prompt, tokens=tokens, held_out=True)
    load_artifact(art.path, model_info=info)  # the artifact fits this model (one line if not)
    _check_size(art, tokens, block)
    with err_console.status(f"loading {model}"):
        loaded, tokenizer, info = load_model(model)
    sample = held_out(prompt, tokenizer, max_tokens=tokens)
    with err_console.status(f"running the {len(sample)}-token prompt and building every layer's block lists"):
        per_layer = captured_flex(art, loaded, sample, block=block, info=info)
    meta = {"artifact": art.path.name, "heads_sha256": art.manifest["files"].get("heads.parquet", ""),
            "prompt": f"{prompt} ({len(sample)} tokens, held-out part)"}
    return write_flex(per_layer, out, metadata=meta)


def _check_size(art, tokens: int, block: int) -> None:
    """The length fits the artifact's model (its recorded context) and its block lists fit in memory, before
    any is built: --tokens 1000000000 would otherwise ask torch for petabytes and fail in a traceback."""
    from sparsesearch.export.flex import flex_bytes
    from sparsesearch.memory import fits_memory

    context = art.manifest["model"].get("max_position_embeddings")
    if context is not None and tokens > context:
        raise BadInput(f"--tokens {tokens} exceeds the context of model '{art.manifest['model']['id']}' ({context} tokens)")
    fits_memory(f"--format flex at {tokens} tokens", flex_bytes(art, tokens, block=block))


def _load_qk(path: Path, layers: int) -> list:
    if not path.is_file():
        raise BadInput(f"--qk {path}: no such file")
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors has its own error types for damaged files
        raise BadInput(f"--qk {path.name}: cannot read safetensors ({' '.join(str(exc).split())})") from None
    out = []
    for layer in range(layers):
        for name in (f"q.{layer}", f"k.{layer}"):
            if name not in tensors:
                raise BadInput(f"--qk {path.name} has no tensor {name!r} (need q.{{layer}} and k.{{layer}} for every layer)")
        out.append((tensors[f"q.{layer}"], tensors[f"k.{layer}"]))
    return out
