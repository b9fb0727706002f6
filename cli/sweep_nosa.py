"""`sparsesearch sweep-nosa`: the NOSA k_q/k sweep (paper 004 App. E.5.3) on any model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import DeviceOpt, JsonOpt, RunProgress, err_console, exits_cleanly, fold_cells, out_console, print_json


def _ints(option: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None


def _floats(option: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated numbers, got {text!r}") from None


def _check_budgets(settings) -> None:
    """A budget selects tokens of the prefill plus the continuation: one larger than both together would select
    everything there is (dense attention, no selection to measure)."""
    if settings.context <= 0 or settings.decode_steps <= 0:
        return  # preflight names those
    seen = settings.context + settings.decode_steps
    for budget in settings.budgets:
        if budget > seen:
            raise ValueError(f"--budget {budget} exceeds the {seen} tokens a step can attend (--context {settings.context} "
                             f"+ --decode-steps {settings.decode_steps})")


@exits_cleanly
def sweep_nosa(
    model: Annotated[str, typer.Option(help="smollm2-135m, gemma3-270m, a local HF directory, a hub id in the local cache, or a .gguf file.")] = "smollm2-135m",
    budget: Annotated[str, typer.Option(help="Budgets k in tokens (k / block-size blocks), comma-separated.")] = "1024,2048,4096",
    kq_ratio: Annotated[str, typer.Option(help="Query-aware shares k_q/k, comma-separated.")] = "0,0.125,0.25,0.375,0.5",
    block_size: Annotated[str, typer.Option(help="Block sizes in tokens (multiples of the pooling stride 16), comma-separated.")] = "64",
    proxy: Annotated[str, typer.Option(help="Query-agnostic scores: trained, snapkv, h2o, tova, vnorm, persistence, random.")] = "snapkv",
    context: Annotated[int, typer.Option(help="Prompt tokens before the teacher-forced continuation.")] = 4096,
    decode_steps: Annotated[int, typer.Option(help="Teacher-forced decode steps measured.")] = 256,
    data: Annotated[str, typer.Option(help="Held-out text: a synthetic set or a .jsonl/.parquet file with a text column.")] = "synthetic:passkey",
    kl_tolerance: Annotated[float, typer.Option(help="Recommendation: fastest configuration with next-token KL <= this.")] = 0.02,
    seed: Annotated[int, typer.Option(help="Seed of the held-out text and the random proxy.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Artifact directory (default artifacts/<model>-nosa); an artifact there is composed with.")] = None,
    into: Annotated[Path | None, typer.Option(help="Existing artifact of the same model to add the nosa section to.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")] = False,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Sweep NOSA's budget, k_q/k, block size and query-agnostic score; record the recommended configuration.

    Example: sparsesearch sweep-nosa --model smollm2-135m --budget 512,1024,1536 --kq-ratio 0,0.25,0.5 --context 2048 --decode-steps 64
    """
    from sparsesearch.nosa.sweep import SweepSettings, preflight, run_sweep

    settings = SweepSettings(
        model=model, budgets=_ints("--budget", budget), kq_ratios=_floats("--kq-ratio", kq_ratio),
        blocks=_ints("--block-size", block_size), proxies=tuple(p.strip() for p in proxy.split(",") if p.strip()),
        context=context, decode_steps=decode_steps, data=data, seed=seed, kl_tolerance=kl_tolerance, out=out, into=into,
        device=device, dtype=dtype, trust_remote_code=trust_remote_code,
    )
    from sparsesearch import preflight as check

    target = settings.target  # --into or --out: read, composed with and replaced whole; the inputs must stay apart
    check.output_path("--into" if into is not None else "--out", target, reads={"--data": data}, model=model,
                      beside=[target.with_name(target.name + ".png"), target.parent / f".{target.name}.nosa-partial"])
    _check_budgets(settings)
    preflight(settings)  # bad input is one line before any progress output, nothing written
    if "trained" in settings.proxies:  # the config tells whether the model can carry the head: no 40-90 s load first
        check.eviction_head_possible("--proxy", model, trust_remote_code=trust_remote_code)
    with RunProgress(transient=json_out) as progress:
        outcome = run_sweep(settings, stage=progress.stage, tick=progress.tick)
    for note in outcome.notes:  # e.g. a context shorter than --context: said, not silently measured
        err_console.print(note, highlight=False, soft_wrap=True)
    summary = {"artifact": str(outcome.path), "plot": str(outcome.plot) if outcome.plot else None, "context": outcome.context, "context_requested": context,
               "decode_steps": decode_steps, "seconds": round(outcome.seconds, 1), "model_load_seconds": round(outcome.model_load_seconds, 1),
               "resumed_configs": outcome.resumed, "recommended": outcome.recommended, "configs": outcome.summaries}
    if json_out:
        print_json(summary)
        return
    table = Table(title=f"sweep-nosa → {outcome.path}  (context {outcome.context}, {decode_steps} steps)")
    for col in ("config", "KL", "recall", "γ mean", "γ≥bound", "viol.", "unstable", "hit", "H2D KiB/tok", "tok/s*"):
        table.add_column(col, justify="right")
    for x in outcome.summaries:
        mark = "◀ " if outcome.recommended and x["config"] == outcome.recommended["config"] else ""
        gmin = "—" if x["gamma_min_stable"] is None else f"{x['gamma_min_stable']:.2f}≥{x['bound']:.2f}"
        table.add_row(mark + x["config"], f"{x['kl']:.4f}", f"{x['recall']:.3f}", f"{x['gamma_mean']:.3f}", gmin,
                      f"[red]{x['violations']}[/red]" if x["violations"] else "0", str(x["unstable_rows"]), f"{x['hit_rate']:.3f}",
                      f"{x['h2d_bytes_per_token'] / 1024:.1f}", f"{x['modelled_tokens_per_s']:.0f}")
    out_console.print(fold_cells(table))
    out_console.print("γ≥bound: smallest γ at stable steps vs (k - k_q)/k; unstable: (layer, head, step) rows at block boundaries, "
                      "reported apart; tok/s*: modelled (sparsesearch/nosa/throughput.py)")
    out_console.print(f"{outcome.seconds:.0f} s (model load {outcome.model_load_seconds:.0f} s, {outcome.resumed} configurations resumed) · "
                      f"recommended: {outcome.recommended['config'] if outcome.recommended else None} · plot: {summary['plot']}")
