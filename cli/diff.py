"""`sparsesearch diff`: per (layer, head, modality pair) differences between two artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import JsonOpt, exits_cleanly, out_console, print_json

SHOWN = 50


@exits_cleanly
def diff(
    a: Annotated[Path, typer.Argument(help="First artifact directory.", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second artifact directory.", show_default=False)],
    json_out: JsonOpt = False,
) -> None:
    """Compare two artifacts row by row: rows only in one, and pattern / parameter / density changes.
    Exit code 0 whatever the differences (2 only for bad input).

    Example: sparsesearch diff runs/search-a runs/search-b --json
    """
    from sparsesearch.artifacts import load_artifact
    from sparsesearch.artifacts.diff import diff_artifacts

    result = diff_artifacts(load_artifact(a), load_artifact(b))
    if json_out:
        print_json({"a": str(a), "b": str(b), **result})
        return
    for key, (va, vb) in result["model_changes"].items():
        out_console.print(f"model {key}: {va} -> {vb}", highlight=False)
    out_console.print(
        f"{result['same_rows']} rows equal, {len(result['changed'])} changed, {len(result['only_a'])} only in A, "
        f"{len(result['only_b'])} only in B ({result['head_index_space']} heads)",
        highlight=False,
    )
    if not (result["changed"] or result["only_a"] or result["only_b"]):
        return
    table = Table(title="differences (A -> B)")
    for col in ("layer", "head", "modalities", "change"):
        table.add_column(col, justify="right" if col in ("layer", "head") else "left")
    entries = [(r, "only in A") for r in result["only_a"]] + [(r, "only in B") for r in result["only_b"]]
    for r in result["changed"]:
        parts = [f"{k} {va} -> {vb}" for k, (va, vb) in r["fields"].items()]
        if r["density"] is not None:
            parts.append(f"density {r['density'][0]} -> {r['density'][1]}")
        entries.append((r, "; ".join(parts)))
    entries.sort(key=lambda e: (e[0]["layer"], e[0]["head"], e[0]["q_modality"], e[0]["k_modality"]))
    for r, text in entries[:SHOWN]:
        table.add_row(str(r["layer"]), str(r["head"]), f"{r['q_modality']}->{r['k_modality']}", text)
    out_console.print(table)
    if len(entries) > SHOWN:
        out_console.print(f"... {len(entries) - SHOWN} more (use --json for all)", highlight=False)
