"""`sparsesearch spava run`: SPAVA prefill (paper 001) on torch.distributed, with the exact baseline in the same launch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from .common import JsonOpt, RunProgress, err_console, exits_cleanly, out_console, print_json

app = typer.Typer(help="SPAVA: sequence-parallel approximate prefill (paper 001) on torch.distributed: run, sweep.", no_args_is_help=True)

ModelOpt = Annotated[str, typer.Option(help="smollm2-135m, gemma3-270m, a local HF directory, a hub id in the local cache, or a .gguf file.")]
NprocOpt = Annotated[int, typer.Option(help="Processes (ranks); one GPU each with NCCL.")]
QueryOpt = Annotated[int, typer.Option(help="Query block: the prompt's last N tokens.")]
DataOpt = Annotated[str, typer.Option(help="text (natural prose, perplexity), synthetic:passkey / synthetic:kv-retrieval (retrieval), synthetic:frames, or a data file.")]
BackendOpt = Annotated[str, typer.Option(help="auto (nccl with GPUs, gloo without), gloo or nccl.")]
TimeoutOpt = Annotated[float, typer.Option(help="Seconds any collective may wait: a dead rank ends the run instead of hanging it.")]
BandwidthOpt = Annotated[float, typer.Option(help="Link bandwidth (GB/s) of the modelled latency at W = 2/4/8.")]


def ints(text: str, what: str) -> list[int | None]:
    """'128,256,default' -> [128, 256, None]; one line on anything else."""
    try:
        return [None if t.strip() == "default" else int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers or 'default', got {text!r}") from None


def run_launch(cfg, title: str) -> dict:
    """Launch with a status line; a failed rank is one red line and exit 1."""
    from sparsesearch.spava.launch import launch, preflight

    preflight(cfg)  # bad input: one line, exit 2, before anything starts
    total = len(cfg.tokens) * len(cfg.anchors) * len(cfg.passings)
    try:
        with RunProgress(transient=True) as progress:
            progress.stage(f"{title}: {cfg.nproc} processes, {cfg.model}, loading, exact ring, then SPAVA; configurations")
            progress.tick(0, total)
            return launch(cfg, tick=progress.tick)
    except RuntimeError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None


def seconds(value: float | None) -> str:
    """A modelled latency cell: '-' where the W does not fit the context."""
    return "-" if value is None else f"{value:.2f}"


def generation_cells(r: dict) -> tuple[str, ...]:
    """The --generate columns of one row: agreement with dense, which decode ran, its per-token cost against
    one-GPU dense decode's."""
    if "generated" not in r:
        return ("-",) * 6
    per_token = lambda v, fmt: "-" if v is None else fmt(v)
    ms = lambda v: f"{v * 1e3:.2f}"
    return ("yes" if r["first_token_agreement"] else "no", f"{r['generated_prefix']} / {len(r['generated'])}", r["decode"],
            f"{per_token(r['decode_s_per_token'], ms)} / {per_token(r.get('decode_s_per_token_dense'), ms)}", per_token(r["decode_bytes_per_token"], lambda v: f"{v / 1e3:.1f}"),
            f"{r['decode_setup_bytes'] / 1e6:.1f}")


def rows_table(result: dict, title: str) -> Table:
    table = Table(title=f"{title} · exact: {result['exact_engine']}")
    generated = any("generated" in r for r in result["rows"])
    prompts = len({r.get("sample", 0) for r in result["rows"]}) > 1  # --samples N: one row per prompt, say which
    cols = ("tokens",) + (("prompt",) if prompts else ()) + ("l_a", "l_p", "KL", "logit err", "ppl / exact", "retrieved", "s / exact s", "MB sent / exact",
            "model W=2 s", "W=4 s", "W=8 s") + (("1st token = dense", "tokens = dense", "decode", "ms / token / 1-GPU dense", "KB / token / rank", "setup MB") if generated else ())
    for c in cols:
        table.add_column(c, justify="right")
    for r in result["rows"]:
        retrieved = f"{r['retrieved']:d} / {r['retrieved_exact']:d}" if "retrieved" in r else "-"
        gen = generation_cells(r)
        table.add_row(str(r["tokens"]), *((str(r.get("sample", 0)),) if prompts else ()), str(r["anchor"]), str(r["passing"]), f"{r['kl']:.2e}", f"{r['logit_rel_error']:.2e}",
                      f"{r['ppl']:.2f} / {r['ppl_exact']:.2f}", retrieved, f"{r['seconds']:.2f} / {r['seconds_exact']:.2f}",
                      f"{r['bytes_sent'] / 1e6:.1f} / {r['bytes_sent_exact'] / 1e6:.1f}", *(seconds(r[f"modelled_s_w{w}"]) for w in (2, 4, 8)), *(gen if generated else ()))
    return table


@app.command("run")
@exits_cleanly
def run(
    model: ModelOpt = "smollm2-135m",
    nproc: NprocOpt = 2,
    tokens: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 2048,
    anchor: Annotated[str, typer.Option(help="l_a, a multiple of 128, or 'default' (n/64 rounded up).")] = "default",
    passing: Annotated[str, typer.Option(help="l_p per virtual host, a multiple of 128, or 'default' (n/128 rounded up).")] = "default",
    query: QueryOpt = 64,
    data: DataOpt = "text",
    backend: BackendOpt = "auto",
    timeout: TimeoutOpt = 300.0,
    bandwidth: BandwidthOpt = 100.0,
    generate: Annotated[int, typer.Option(help="Then decode N greedy tokens after the prefill; compared with dense generation.")] = 0,
    decode: Annotated[str, typer.Option(help="With --generate: distributed (the paper's: each rank attends the K/V it holds, outputs merged by lse per layer) or gather (the cache gathered to rank 0, decoded there).")] = "distributed",
    json_out: JsonOpt = False,
) -> None:
    """One SPAVA prefill against exact sequence parallelism, same launch, same process group.

    Example: sparsesearch spava run --model smollm2-135m --nproc 2 --tokens 2048 --generate 16 --decode distributed
    """
    from sparsesearch.spava.run import SpavaConfig

    cfg = SpavaConfig(model=model, nproc=nproc, tokens=[tokens], anchors=ints(anchor, "--anchor")[:1],
                      passings=ints(passing, "--passing")[:1], query=query, data=data, backend=backend, timeout_s=timeout,
                      bandwidth_gbs=bandwidth, generate=generate, decode=decode)
    result = run_launch(cfg, "spava run")
    if json_out:
        print_json(result)
        return
    out_console.print(rows_table(result, f"SPAVA {model}, {nproc} processes"))
    for r in result["rows"]:
        if "generated" in r:
            err_console.print(f"SPAVA prefill, {r['decode']} decode, {len(r['generated'])} tokens: {r['generated_text']!r}", highlight=False, soft_wrap=True)
            err_console.print(f"dense generation: {r['generated_text_dense']!r}", highlight=False, soft_wrap=True)
