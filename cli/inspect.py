"""`sparsesearch inspect`: what an artifact holds — model, provenance, pattern mix per layer, density, scores."""

from __future__ import annotations

from rich.table import Table

from ._shared import ArtifactArg
from .common import JsonOpt, exits_cleanly, fold_cells, out_console, print_json, short_label


def _num(value, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


@exits_cleanly
def inspect(artifact: ArtifactArg, json_out: JsonOpt = False) -> None:
    """Summarise an artifact: model, provenance, methods, per-layer pattern counts, mean density and scores.

    Example: sparsesearch inspect runs/llama-3.1-8b --json
    """
    from sparsesearch.artifacts import load_artifact
    from sparsesearch.artifacts.summary import summarize

    summary = summarize(load_artifact(artifact))
    if json_out:
        print_json(summary)
        return
    model, prov = summary["model"], summary["provenance"]
    out_console.print(
        f"[bold]{summary['path']}[/bold]  schema v{summary['schema_version']}, created {summary['created']} by "
        f"{summary['producer']['name']} {summary['producer']['version']}"
        + (f" ({summary['producer']['git'][:12]})" if summary["producer"]["git"] else ""),
        highlight=False,
    )
    out_console.print(
        f"model {model['id']} ({model['architecture']}, {model['num_layers']} layers, {model['num_heads']}/{model['num_kv_heads']} "
        f"heads, d={model['head_dim']}, {model['dtype']}), rows per {summary['head_index_space']} head",
        highlight=False,
    )
    hybrid = bool(model["sliding_layers"])
    if hybrid:
        out_console.print(
            f"hybrid: {len(model['sliding_layers'])} sliding-window layers (window {model['sliding_window']}) run the model's own window "
            f"(rows: ashape sink 0, local {model['sliding_window']}; not searched); searched global layers: "
            f"{[layer['layer'] for layer in summary['layers'] if layer['attention'] == 'global']}",
            highlight=False,
        )
    source = f", source {prov['source']}" if prov["source"] else ""
    out_console.print(f"provenance {prov['kind']}{source}; methods: {', '.join(summary['methods']) or 'none'}", highlight=False)
    tri = summary["methods"].get("trianglemix")
    if tri and tri.get("start_layer") is not None:
        out_console.print(
            f"TriangleMix: {'global ' if hybrid else ''}layers {tri['start_layer']} and deeper run triangle(sink {tri['sink']}, window {tri['window']}, "
            f"last {tri['last']}) in every head, whatever their rows say",
            highlight=False,
        )
    if summary["metrics"]:
        parts = [f"{name} {_num(s['mean'])} (min {_num(s['min'])}, max {_num(s['max'])})" for name, s in summary["metrics"].items() if s]
        if parts:
            out_console.print("mean " + "; ".join(parts), highlight=False)
            out_console.print(metric_units(summary), highlight=False, style="dim", soft_wrap=True)
    for line in fidelity_lines(summary):
        out_console.print(line, highlight=False, soft_wrap=True)
    patterns = list(summary["patterns"])
    regions = sum(n for pair, n in summary["modality_pairs"].items() if pair != "all->all")
    title = f"pattern mix per layer ({summary['rows'] - regions} global rows" + (f", plus {regions} modality-region rows)" if regions else ")")
    table = Table(title=title)
    table.add_column("layer", justify="right")
    if hybrid:
        table.add_column("attention")
    for name in patterns:
        table.add_column(short_label(name), justify="right")
    boundaries = any(layer["boundaries"] for layer in summary["layers"])
    if boundaries:
        table.add_column("boundary")
    tied = bool(summary["ties"])
    if tied:
        table.add_column("tied", justify="right")  # picks that won on cost between equal objectives of two kinds
    table.add_column("density", justify="right")
    table.add_column("score", justify="right")
    legend = ", ".join(f"{short_label(p)} = {p}" for p in patterns if short_label(p) != p)
    table.caption = f"heads per pattern{f' ({legend})' if legend else ''}; density, score: layer means"
    for layer in summary["layers"]:
        kinds = [", ".join(f"{k}×{n}" for k, n in layer["boundaries"].items()) or "-"] if boundaries else []
        attention = [f"window {layer['window']}" if layer["attention"] == "sliding" else "global"] if hybrid else []
        ties = [str(layer["ties"])] if tied else []
        table.add_row(
            str(layer["layer"]), *attention, *(str(layer["patterns"].get(p, 0)) for p in patterns), *kinds, *ties,
            _num(layer["mean_density"]), _num(layer["mean_score"]),
        )
    out_console.print(fold_cells(table))
    _print_reasons(summary["reasons"])
    _print_ties(summary["ties"])
    _print_stability(summary.get("stability"))


def metric_units(summary: dict) -> str:
    """What the per-head metrics measure, and in which unit: latency_ms is the search's cost of the head's
    kernel at the calibration length, timed on a GPU or modelled from FLOPs on a CPU (heads.parquet says
    neither, the manifest does)."""
    mm = summary["methods"].get("mminference") or {}
    length = f" at {mm['max_tokens']} tokens" if mm.get("max_tokens") else ""
    how = {"measured": "timed on the calibrating GPU", "analytic": "modelled from FLOPs (a CPU run)"}.get(mm.get("cost_model"), "as recorded")
    return ("units: density = share of the causal attention entries computed; recall = share of the attention mass kept; "
            "output_error = relative L2 error of the head's attention output vs dense; "
            f"latency_ms = milliseconds per head of its kernel{length}, {how}; score = the search's objective")


def fidelity_lines(summary: dict) -> list[str]:
    """The artifact's recorded fidelity against dense (calibrate's held-out check: teacher-forced KL and
    perplexity), or a line saying none was recorded and how to measure it."""
    record = (summary["methods"].get("mminference") or {}).get("fidelity")
    if not record:
        return ["fidelity: none recorded (sparsesearch evaluate ARTIFACT measures KL and perplexity against dense)"]
    from sparsesearch.fidelity import describe

    lines = []
    for report in [record, *record.get("also", [])]:
        lines += [f"fidelity on {line}" if line.startswith(report["eval_data"]) else f"  {line}" for line in describe(report)]
    return lines


REASONS_SHOWN = 20  # table rows of reasons, and of ties; --json lists every one


def _print_reasons(reasons: list[dict]) -> None:
    """Heads whose pick is not their best admissible sparse candidate, and why (heads.parquet ``reason``)."""
    if not reasons:
        return
    table = Table(title=f"picks that are not the head's best admissible sparse candidate ({len(reasons)})")
    for name in ("layer", "head", "region", "pattern", "reason"):
        table.add_column(name, justify="right" if name in ("layer", "head") else "left")
    for r in reasons[:REASONS_SHOWN]:
        region = f"{r['q_modality']}->{r['k_modality']}"
        table.add_row(str(r["layer"]), str(r["head"]), region, r["pattern"], r["reason"])
    out_console.print(fold_cells(table))
    if len(reasons) > REASONS_SHOWN:
        out_console.print(f"... and {len(reasons) - REASONS_SHOWN} more (--json lists every one)", highlight=False)


def _print_ties(ties: list[dict]) -> None:
    """Picks whose objective tied a candidate of another kind (heads.parquet ``tie``): the pattern won on
    cost, so the kind is a coin toss between the two, not a preference the data showed."""
    if not ties:
        return
    table = Table(title=f"picks that tied another kind and won on cost ({len(ties)})")
    for name in ("layer", "head", "region", "pattern", "tied with", "output error"):
        table.add_column(name, justify="right" if name in ("layer", "head", "output error") else "left")
    for r in ties[:REASONS_SHOWN]:
        table.add_row(str(r["layer"]), str(r["head"]), f"{r['q_modality']}->{r['k_modality']}", r["pattern"], r["tie"],
                      _num(r["output_error"], ".4f"))
    out_console.print(table)
    if len(ties) > REASONS_SHOWN:
        out_console.print(f"... and {len(ties) - REASONS_SHOWN} more (--json lists every one)", highlight=False)


def _print_stability(stability: dict | None) -> None:
    """Heads whose pick changed between calibration samples (search/stability.py): each sample's own pick and
    the chosen candidate's error per sample. Silent for single-sample artifacts (nothing to compare)."""
    if not stability:
        return
    spread = stability.get("max_error_spread")
    out_console.print(f"stability over {stability['samples']} calibration samples: {stability['unstable_count']} of "
                      f"{stability['heads']} heads unstable (they took the lowest worst-case error)"
                      + ("" if spread is None else f"; largest error spread of a pick {spread:.3g}"), highlight=False)
    unstable = stability.get("unstable") or []
    if not unstable:
        return
    table = Table(title=f"unstable heads ({len(unstable)})")
    for name in ("layer", "head", "pick per sample", "error per sample"):
        table.add_column(name, justify="right" if name in ("layer", "head") else "left")
    for s in unstable[:REASONS_SHOWN]:
        errors = " / ".join("-" if e is None else f"{e:.3g}" for e in s["errors"])
        table.add_row(str(s["layer"]), str(s["head"]), " / ".join(s["picks"]), errors)
    out_console.print(fold_cells(table))
    if len(unstable) > REASONS_SHOWN:
        out_console.print(f"... and {len(unstable) - REASONS_SHOWN} more (--json lists every one)", highlight=False)
