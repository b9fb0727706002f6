"""`sparsesearch sweep-spava`: a grid of SPAVA's l_a x l_p against exact, written into an artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import JsonOpt, err_console, exits_cleanly, out_console, print_json
from .spava import BackendOpt, BandwidthOpt, DataOpt, ModelOpt, NprocOpt, QueryOpt, TimeoutOpt, ints, rows_table, run_launch


@exits_cleanly
def sweep_spava(
    model: ModelOpt = "smollm2-135m",
    nproc: NprocOpt = 2,
    anchor: Annotated[str, typer.Option(help="Comma-separated l_a values (multiples of 128; 'default' = n/64 rounded up).")] = "128,256",
    passing: Annotated[str, typer.Option(help="Comma-separated l_p values (multiples of 128; 'default' = n/128 rounded up).")] = "128,256",
    tokens: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "2048",
    samples: Annotated[int, typer.Option(help="Prompts per length (seeds 0, 1, ...): KL averaged, retrieval counted over them.")] = 1,
    query: QueryOpt = 64,
    data: DataOpt = "text",
    kl_tolerance: Annotated[float, typer.Option(help="A configuration qualifies at next-token KL <= this (and retrieval no worse than exact).")] = 0.01,
    bandwidth: BandwidthOpt = 100.0,
    backend: BackendOpt = "auto",
    timeout: TimeoutOpt = 300.0,
    out: Annotated[Path, typer.Option(help="Artifact directory written (spava.parquet + manifest), PNG beside it.")] = Path("artifacts/smollm2-135m-spava"),
    into: Annotated[Path | None, typer.Option(help="An existing artifact to add the spava section to (its other sections kept).")] = None,
    rank_times: Annotated[Path | None, typer.Option(help="Rows of benchmarks/spava_rank.py --simulate-world: model latency at W = 2/4/8 from them at --bandwidth (nothing is launched).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed sweep from OUT.sweep-spava.partial/ (the configurations measured already).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Sweep l_a x l_p against exact: KL, perplexity, retrieval, bytes, measured and modelled latency.

    Example: sparsesearch sweep-spava --model smollm2-135m --nproc 2 --tokens 2048 --anchor 128,256 --passing 128,256
    With measured rank times: sparsesearch sweep-spava --rank-times benchmarks/results/spava_rank_sim.jsonl --bandwidth 100
    """
    from sparsesearch import preflight as check

    if rank_times is not None:
        check.json_file("--rank-times", rank_times)  # one line for a malformed file, however malformed
        return _model_rank_times(rank_times, bandwidth, json_out)
    target = into or out  # read, composed with and replaced whole; the inputs must stay apart from it
    from sparsesearch.workdir import partial_path

    check.output_path("--into" if into is not None else "--out", target, reads={"--data": data}, model=model,
                      beside=[target.with_name(target.name + "-spava.png"), partial_path(target, "sweep-spava")])
    from sparsesearch.spava.run import SpavaConfig
    from sparsesearch.spava.sweep import draw_sweep, open_work, write_sweep

    if into is not None and not (into / "manifest.json").is_file():
        raise ValueError(f"--into {into}: no artifact there (manifest.json missing)")
    target = into or out
    if into is None and (out / "manifest.json").is_file():
        from sparsesearch.artifacts import load_artifact

        load_artifact(out)  # a broken artifact at --out is refused before the launch
    lengths = [n for n in ints(tokens, "--tokens") if n is not None]
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    cfg = SpavaConfig(model=model, nproc=nproc, tokens=lengths, anchors=ints(anchor, "--anchor"), passings=ints(passing, "--passing"),
                      query=query, data=data, backend=backend, timeout_s=timeout, bandwidth_gbs=bandwidth, samples=samples)
    work = open_work(cfg, target, resume=resume)
    result = run_launch(cfg, "sweep-spava")
    path, rec = write_sweep(result, cfg, target, kl_tolerance=kl_tolerance, compose=(target / "manifest.json").is_file())
    png = draw_sweep(result["rows"], target.with_name(target.name + "-spava.png"))
    work.remove()  # the artifact and its plot are written: nothing of the sweep is left beside them
    if json_out:
        print_json({"artifact": str(path), "plot": str(png), "recommended": rec, **result})
        return
    out_console.print(rows_table(result, f"sweep-spava {model}, {nproc} processes"))
    for r in rec:
        found = f", retrieved {r['retrieved']} / {r['prompts']} (exact {r['retrieved_exact']})" if "retrieved" in r else ""
        err_console.print(f"{r['tokens']} tokens: recommended l_a={r['anchor']} l_p={r['passing']} (mean KL {r['kl']:.2e} over "
                          f"{r['prompts']} prompt{'s' if r['prompts'] > 1 else ''}{found}{'' if r['qualified'] else ', none within tolerance'})")
    err_console.print(f"artifact: {path} · plot: {png}")


def _model_rank_times(path: Path, bandwidth: float, json_out: bool) -> None:
    """latency = max over ranks (measured compute + communication no compute hides), per configuration."""
    from rich.table import Table

    from sparsesearch.spava.sweep import load_rank_times, rank_time_model

    rows = rank_time_model(load_rank_times(path), bandwidth)
    if json_out:
        print_json({"rank_times": str(path), "bandwidth_gbs": bandwidth, "rows": rows})
        return
    table = Table(title=f"modelled latency per layer from {path} at {bandwidth:g} GB/s")
    for c in ("tokens", "W", "method", "l_a", "l_p", "compute ms", "comm ms", "exposed ms", "latency ms", "SDPA ms", "vs SDPA", "vs ring"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(str(r["tokens"]), str(r["W"]), r["method"], str(r["l_a"] or "-"), str(r["l_p"] or "-"), f"{r['compute_ms']:.3f}",
                      f"{r['comm_ms']:.3f}", f"{r['exposed_ms']:.3f}", f"{r['latency_ms']:.3f}", f"{r['sdpa_ms']:.3f}",
                      f"{r['speedup_vs_sdpa']:.2f}x", "-" if r["speedup_vs_ring"] is None else f"{r['speedup_vs_ring']:.2f}x")
    out_console.print(table)
