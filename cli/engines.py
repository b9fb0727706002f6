"""Exports that serving engines read (qwen-1m, flashprefill, flashinfer, modelopt) and `sparsesearch check-export`, which checks such a
file (or a MInference config) against a model's config and the engine's rules before deploying it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ._shared import TrustOpt, model_info
from .common import BadInput, JsonOpt, err_console, exits_cleanly, print_json

ENGINE_FORMATS = ("qwen-1m", "flashprefill", "flashinfer", "modelopt")


def engine_out_free(out: Path, overwrite: bool) -> None:
    """An engine file is deployed as is: replacing one silently could swap a server's config under it."""
    if out.exists() and not overwrite:
        raise BadInput(f"--out {out} exists; pass --overwrite to replace it or choose another --out")


def export_engine(art, fmt: str, out: Path, *, tokens: int | None = None) -> tuple[Path, dict]:
    """Write ``art`` as ``fmt`` at ``out``; (path, what to tell the user besides: the DCA block, the flag line,
    the plan's lossy heads, what ModelOpt's reader drops)."""
    if fmt == "flashinfer":
        return _export_flashinfer(art, out, tokens)
    if fmt == "modelopt":
        from sparsesearch.export.modelopt import write_modelopt

        return write_modelopt(art, out), {"note": "merge the block into the model's config.json as sparse_attention_config; "
                                                  "it carries no per-head pattern (see docs/deploying.md)"}
    if fmt == "qwen-1m":
        from sparsesearch.export.qwen1m import architecture_note, dca_block, write_qwen1m

        path = write_qwen1m(art, out)
        return path, {"dual_chunk_attention_config": dca_block(), "note": architecture_note(art)}
    from sparsesearch.export.flashprefill import flag_line, write_flashprefill

    path = write_flashprefill(art, out)
    return path, {"flag": flag_line(art)}


def _export_flashinfer(art, out: Path, tokens: int | None) -> tuple[Path, dict]:
    """The plan at ``--tokens``, refused before any build when the length is missing, past the model's context or
    too large for memory."""
    from sparsesearch.export.flashinfer import plan_bytes, write_flashinfer
    from sparsesearch.memory import fits_memory

    if tokens is None or tokens < 1:
        raise BadInput(f"--format flashinfer needs --tokens N >= 1 (the length the plan is built for), got {tokens}")
    context = art.manifest["model"].get("max_position_embeddings")
    if context is not None and tokens > context:
        raise BadInput(f"--tokens {tokens} exceeds the context of model '{art.manifest['model']['id']}' ({context} tokens)")
    fits_memory(f"--format flashinfer at {tokens} tokens", plan_bytes(art, tokens))
    path, plan = write_flashinfer(art, out, tokens)
    lossy = [f"layer {layer} KV head {head}" for layer, heads in enumerate(plan["heads"])
             for head, entry in enumerate(heads) if entry["lossy_blocks"]]
    note = (f"{len(lossy)} KV heads (first: {lossy[0]}) have partial blocks whose window/sink mask causal=True does not "
            f"give; see lossy_blocks in the plan") if lossy else None
    return path, {"block_sizes": [plan["R"], plan["C"]], "tokens": tokens, "lossy_heads": len(lossy), "note": note}


def print_engine_notes(extra: dict) -> None:
    """The lines a user needs to deploy the file: what to merge by hand, or the flag to pass."""
    import json

    if "flag" in extra:
        err_console.print(f"server flag: {extra['flag']}", highlight=False)
        return
    if "dual_chunk_attention_config" not in extra:  # flashinfer, modelopt: at most one note
        if extra.get("note"):
            err_console.print(f"note: {extra['note']}", highlight=False, soft_wrap=True)
        return
    block = json.dumps(extra["dual_chunk_attention_config"], sort_keys=True)
    err_console.print(f"put it beside the model's config.json as sparse_attention_config.json, and merge {block} into "
                      f"that config's dual_chunk_attention_config by hand (see docs/deploying.md)", highlight=False, soft_wrap=True)
    if extra.get("note"):
        err_console.print(f"note: {extra['note']}", highlight=False, soft_wrap=True)


@exits_cleanly
def check_export(
    file: Annotated[Path, typer.Argument(help="Exported file to check.", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="minference, qwen-1m, flashprefill, flashinfer or modelopt.", show_default=False)],
    model: Annotated[str, typer.Option("--model", help="Model id, path or alias the file is for.", show_default=False)],
    tp: Annotated[Optional[int], typer.Option("--tp", help="qwen-1m, flashprefill, flashinfer: tensor-parallel size the server will run with.")] = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Check an exported file against the model's config and its engine's rules: one line per problem or note.

    Exit 0 when there is no problem (notes say where the engine silently runs something else), 2 otherwise;
    a file that is not the format at all is one error line, exit 2.

    Example: sparsesearch check-export sparse_attention_config.json --format qwen-1m --model Qwen/Qwen2.5-7B-Instruct-1M --tp 4
    """
    from sparsesearch.export.check import FORMATS, check_file

    if fmt not in FORMATS:
        raise BadInput(f"--format must be one of {', '.join(FORMATS)} for a check, got {fmt!r}")
    if tp is not None and tp < 1:
        raise BadInput(f"--tp must be >= 1, got {tp}")
    info = model_info(model, trust_remote_code)
    findings = check_file(file, fmt, info, tp=tp)
    problems = [f for f in findings if f.level == "problem"]
    if json_out:
        print_json({"file": str(file), "format": fmt, "model": info.id, "ok": not problems,
                    "findings": [{"level": f.level, "text": f.text} for f in findings]})
    else:
        for finding in findings:
            err_console.print(finding.line(), highlight=False, soft_wrap=True, markup=False)
        verdict = f"{len(problems)} problem(s)" if problems else "ok"
        err_console.print(f"{file.name} as {fmt} for {info.id}: {verdict}, {len(findings) - len(problems)} note(s)", highlight=False)
    if problems:
        raise typer.Exit(code=2)
