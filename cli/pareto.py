"""`sparsesearch pareto`: searched artifacts against one-size baselines on the same held-out windows."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from .common import DeviceOpt, JsonOpt, RunProgress, exits_cleanly, out_console, print_json


def _floats(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@exits_cleanly
def pareto(
    artifact: Annotated[Optional[list[Path]], typer.Option("--artifact", help="A searched artifact to place on the curve (repeat for a budget sweep).")] = None,
    model: Annotated[str, typer.Option(help="The model (alias, directory, hub id, .gguf); every artifact must be made for it.")] = "smollm2-135m",
    baselines: Annotated[str, typer.Option(help="One-size families, comma-separated ('' for none): streaming (A-shape, StreamingLLM), minference (vertical-slash on every head), topk (block top-k), trianglemix (TriangleMix alone), duo (streaming and dense heads, DuoAttention-style), dense.")] = "streaming,minference,topk,trianglemix,duo,dense",
    budgets: Annotated[str, typer.Option(help="Each family's budgets as fractions of dense attention cost, in (0, 1].")] = "0.3,0.5,0.7",
    data: Annotated[str, typer.Option(help="Held-out data every point is measured on (text:shakespeare: the held-out plays; synthetic:passkey adds retrieval counts).")] = "text:shakespeare",
    samples: Annotated[int, typer.Option(help="Held-out windows.")] = 1,
    tokens: Annotated[int, typer.Option(help="Window length in tokens.")] = 4096,
    seed: Annotated[int, typer.Option(help="Seed of the held-out windows.")] = 0,
    triangle_start: Annotated[Optional[int], typer.Option(help="Probed TriangleMix start layer (default: an artifact's own, if any).")] = None,
    keys: Annotated[int, typer.Option(help="Passkey keys dense must hold: held-out prompts (--tokens long, needles spread over the context) are read until dense holds this many, at most 4x as many prompts; every point's keys are then read teacher-forced, as calibrate's retrieval guard reads them, and a baseline that loses a key dense holds, where the searched curve holds them all, is judged 'loses keys'. One sparse forward per held key and point. 0: off.")] = 4,
    out: Annotated[Optional[Path], typer.Option(help="Directory for pareto.parquet, pareto_layers.parquet, pareto.json and pareto.png.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points a killed run finished (OUT.pareto.partial/).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a report already at --out.")] = False,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Quality (teacher-forced KL, perplexity, retrieval) against attention cost for searched artifacts
    and one-size baselines, through the same runtime and kernels, on the same held-out windows; says per
    baseline point whether the searched curve beats it (KL <= 0.7x at equal cost, or cost <= 0.8x at equal KL),
    or whether it loses a passkey key dense holds that the searched curve keeps (--keys).

    Example: sparsesearch pareto --artifact artifacts/smollm2-135m --tokens 4096 --out artifacts/pareto-smollm2
    """
    from sparsesearch.pareto import ParetoConfig, pareto as run, preflight

    cfg = ParetoConfig(model=model, artifacts=list(artifact or []), baselines=_names(baselines), budgets=_floats(budgets, "--budgets"),
                       data=data, samples=samples, tokens=tokens, seed=seed, triangle_start=triangle_start, keys=keys, out=out,
                       overwrite=overwrite, resume=resume, device=device, dtype=dtype)
    if out is not None:  # a report directory of its own: never an --artifact, the data or the model's files
        from sparsesearch import preflight as check
        from sparsesearch.workdir import partial_path

        check.output_path("--out", out, reads={"--artifact": list(artifact or []), "--data": data}, model=model,
                          beside=[partial_path(out, "pareto")])
    checked = preflight(cfg)  # bad input: one line, before any weights load
    with RunProgress(transient=json_out) as display:
        report = run(cfg, _progress(display), checked=checked)
    if json_out:
        print_json(report)
        return
    _render(report)


def _progress(display: RunProgress):
    """The library's stage and per-point callbacks on the shared display (counts and an ETA, plain lines in a log)."""
    from sparsesearch.pareto import Progress

    return Progress(stage=display.stage, point=lambda done, total, label: display.tick(done, total, note=label))


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _note(v: dict | None) -> str:
    """A verdict cell: the verdict, the KL rule's own where "loses keys" replaced it, and the KL ratio."""
    if v is None:
        return ""
    by_kl = f"; KL {v['kl_verdict']}" if v["verdict"] != v.get("kl_verdict", v["verdict"]) else ""
    return v["verdict"] + by_kl + ("" if v["kl_ratio"] is None else f" ({v['kl_ratio']:.2f}x KL)")


def _render(report: dict) -> None:
    table = Table(title=f"{report['model']}: {report['samples']} x {report['tokens']} tokens of {report['data']}")
    # A hybrid model's sliding layers cost the same on both sides: its searchable layers' own fraction is shown too.
    hybrid = any(r.get("searchable_cost_fraction") not in (None, r["cost_fraction"]) for r in report["rows"])
    read = any(r.get("keys_lost") is not None for r in report["rows"])  # the key check ran and dense holds a key
    columns = [("family", "left"), ("point", "left"), ("cost", "right")] + [("searchable layers", "right")] * hybrid
    columns += [("KL", "right"), ("ppl", "right")] + [("keys lost", "right")] * read + [("verdict", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold")
    verdict = {(v["family"], v["label"]): v for v in report["verdicts"]}
    for r in sorted(report["rows"], key=lambda r: (r["family"] != "searched", r["family"], r["cost_fraction"])):
        searchable = [_fmt(r.get("searchable_cost_fraction"), ".1%")] * hybrid
        lost = [f"{_fmt(r.get('keys_lost'), 'd')}/{r.get('keys_held_dense')}"] * read
        table.add_row(r["family"], r["label"], _fmt(r["cost_fraction"], ".1%"), *searchable, _fmt(r["kl"], ".4f"), _fmt(r["ppl_sparse"], ".2f"),
                      *lost, _note(verdict.get((r["family"], r["label"]))))
    out_console.print(table)
    dense = next((r["ppl_dense"] for r in report["rows"] if r["ppl_dense"] is not None), None)
    out_console.print(report["summary"], highlight=False)
    keys = report.get("keys")
    if keys:
        out_console.print(f"passkey keys: dense holds {keys['dense_retrieves']} of {keys['prompts']} held-out prompts of {keys['tokens']} tokens; "
                          f"{keys['rule']}", highlight=False)
    out_console.print(f"cost: {report['cost_model']} attention time as a fraction of dense; dense perplexity {_fmt(dense, '.2f')}; "
                      f"{report['seconds']:.0f} s", highlight=False)
    for name, path in (report.get("files") or {}).items():
        out_console.print(f"{name}: {path}", highlight=False)
