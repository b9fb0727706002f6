"""`sparsesearch calibrate`: the per-head pattern search (MMInference Alg. 4) -> an artifact."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from .common import DeviceOpt, JsonOpt, RunProgress, err_console, exits_cleanly, fold_cells, out_console, print_json


@exits_cleanly
def calibrate(
    model: Annotated[str, typer.Option(help="smollm2-135m, gemma3-270m, a local HF directory, a hub id in the local cache, or a .gguf file.")] = "smollm2-135m",
    data: Annotated[str, typer.Option(help="jsonl/parquet file, a saved HF dataset dir, or synthetic:kv-retrieval|passkey|frames|mixed.")] = "synthetic:kv-retrieval",
    search_space: Annotated[Optional[str], typer.Option(help="Bundled name or a JSON file (default: mminference, paper 000 Table 3).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Calibration length in tokens.")] = 4096,
    samples: Annotated[int, typer.Option(help="Calibration samples (scores are averaged).")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic data and sample order.")] = 0,
    out: Annotated[Path, typer.Option(help="Artifact directory to write (a PNG map is written beside it).")] = Path("artifacts/smollm2-135m"),
    head_space: Annotated[str, typer.Option(help="kv: one pattern per KV head (GQA-native); query: per query head.")] = "kv",
    objective: Annotated[str, typer.Option(help="output_error (relative L2 of the attention output) or mass_recall.")] = "output_error",
    eval_data: Annotated[str, typer.Option(help="Held-out data for the fidelity report: one spec or several, comma-separated (the first is the one a target is verified on; '' to skip).")] = "text:shakespeare",
    eval_samples: Annotated[int, typer.Option(help="Held-out samples for the fidelity report.")] = 1,
    eval_tokens: Annotated[Optional[int], typer.Option(help="Held-out length in tokens (default: --max-tokens).")] = None,
    min_tokens: Annotated[Optional[int], typer.Option(help="Runtime: prompts shorter than this run dense (default: measured on this device, SDPA vs index + sparse kernel).")] = None,
    target_kl: Annotated[Optional[list[float]], typer.Option(help="Quality target: choose per-head budgets across layers for the least cost whose model KL vs dense on calibration-data prompts (--tune-samples) is <= this (measured with the runtime). Repeat it for a sweep: one search, one artifact per value in --out/kl<value>/.")] = None,
    max_output_error: Annotated[Optional[float], typer.Option(help="Quality target: each head its cheapest pattern with relative attention-output error <= this; others stay dense. The default when no target is given: 0.02 on text data (lossless: held-out KL 0.0013 on SmolLM2 at 4K).")] = None,
    space_budget: Annotated[bool, typer.Option("--space-budget", help="No quality target: each head its least-error candidate within the search space's budget (the paper's setting; lossy on short prompts: KL 0.055 on SmolLM2 at 4K).")] = False,
    latency_budget: Annotated[Optional[float], typer.Option(help="Cost target: least total head error with total cost <= this fraction of dense cost (0-1, the search's cost model).")] = None,
    tune_samples: Annotated[int, typer.Option(help="--target-kl: calibration-data prompts (after the searched ones, never held-out) the KL is measured on.")] = 2,
    retrieval_guard: Annotated[int, typer.Option(help="--target-kl: passkey keys the chosen point must keep: prompts at --max-tokens are read until dense retrieves this many keys (every digit its most likely token, teacher-forced; at most 4x as many prompts), and the point moves up the path (or keeps the layers that lose them dense) until none is lost. 0: off.")] = 4,
    allow_miss: Annotated[bool, typer.Option("--allow-miss", help="With a target that cannot be met: write the best reachable artifact, marked missed, instead of exiting 2.")] = False,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed run from OUT.partial/ (or --search-dir).")] = False,
    search_dir: Annotated[Optional[Path], typer.Option(help="Keep the per-layer search here (default OUT.partial/, removed when done): later runs at another quality target with --resume and the same directory allocate from it without searching again.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an artifact already at --out.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")] = False,
    device: DeviceOpt = "auto",
    gpus: Annotated[int, typer.Option(help="Search workers, one process per GPU (cuda:0..N-1): the capture hands each layer to the next free one. 1: searched in-process.")] = 1,
    device_map: Annotated[Optional[str], typer.Option(help="Split the model over the host's GPUs for the capture (a model one GPU cannot hold): auto, balanced, balanced_low_0, sequential, or a JSON file of {module: GPU index}.")] = None,
    max_memory: Annotated[Optional[str], typer.Option(help="With --device-map: memory per GPU for the weights, e.g. '0=20GiB,1=20GiB'.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Search the sparse pattern of every layer and head and write it as an artifact.

    Multi-modal data (synthetic:mixed|frames, a VLM's inputs) also searches every modality region and
    picks each head's boundary type (none/K/Q/2D); text-only data searches the global pattern alone.

    Example: sparsesearch calibrate --model smollm2-135m --max-tokens 4096 --out artifacts/smollm2-135m

    Past one GPU: --device-map balanced splits the model for the capture, --gpus N spreads the per-layer searches.
    """
    from sparsesearch.calibrate import DEFAULT_MAX_OUTPUT_ERROR, CalibrateConfig, calibrate as run, preflight
    from sparsesearch.models.split import parse_max_memory, read_device_map

    targets = target_kl or []
    cfg = CalibrateConfig(model=model, data=data, search_space=search_space, max_tokens=max_tokens, samples=samples,
                          seed=seed, out=out, device=device, dtype=dtype, head_space=head_space, objective=objective,
                          resume=resume, search_dir=search_dir, overwrite=overwrite, eval_data=eval_data or None, eval_samples=eval_samples, eval_tokens=eval_tokens, min_tokens=min_tokens,
                          trust_remote_code=trust_remote_code, target_kl=targets[0] if targets else None, max_output_error=max_output_error,
                          latency_budget=latency_budget, allow_miss=allow_miss, tune_samples=tune_samples, retrieval_guard=retrieval_guard, gpus=gpus,
                          device_map=read_device_map(device_map), max_memory=parse_max_memory(max_memory),
                          default_max_output_error=None if space_budget else DEFAULT_MAX_OUTPUT_ERROR)
    if space_budget and (targets or max_output_error is not None or latency_budget is not None):
        raise ValueError("--space-budget is the search without a quality target; drop it or the target")
    from sparsesearch import preflight as check

    # Shared guards first: an --out that would land on an input, a file that cannot be parsed, a length past the
    # model's context (refused as that, not as data too short for it), sample ids that cannot fit in memory.
    check.output_path("--out", out, reads={"--data": data, "--search-space": search_space, "--eval-data": (eval_data or "").split(",")},
                      model=model, beside=[out.with_name(out.name + end) for end in (".partial", ".png", ".budget.png")])
    check.json_file("--search-space", search_space)
    check.sizes_fit(model, {"--max-tokens": max_tokens, "--eval-tokens": eval_tokens}, trust_remote_code=trust_remote_code, dtype=dtype,
                    device=device, memory={f"--samples {samples} x --max-tokens {max_tokens} token ids": 8 * max(samples, 0) * max(max_tokens, 0)})
    if len(targets) > 1:
        _sweep(cfg, targets, json_out)
        return
    space = preflight(cfg)  # bad input is one line before any progress output
    with RunProgress(transient=json_out) as progress:
        result = run(cfg, _hooks(progress), space=space)
    for note in result.notes:  # a resumed run says so, with what it kept
        err_console.print(note, highlight=False)
    density, summary = _summary(result, max_tokens)
    if json_out:
        print_json(summary)
        return
    _render(result, summary, density)


def _hooks(progress: RunProgress):
    """calibrate's callbacks on the display: stage lines, and a layer tick counting the current sample's layers
    (the stage line names the sample)."""
    from sparsesearch.calibrate import Progress

    return Progress(stage=progress.stage, layer=lambda sample, layer, total: progress.tick(layer + 1, total))


def _sweep(cfg, targets: list[float], json_out: bool) -> None:
    """--target-kl given more than once: one search, one artifact per value (calibrate.calibrate_sweep), a
    summary each (--json: their list) and one line per target."""
    from sparsesearch.calibrate import calibrate_sweep, sweep_configs

    sweep_configs(cfg, targets)  # a bad value is one line before any progress output
    with RunProgress(transient=json_out) as progress:
        results = calibrate_sweep(cfg, targets, _hooks(progress))
    summaries = [_summary(r, cfg.max_tokens)[1] for r in results]
    if json_out:
        print_json(summaries)
        return
    table = Table(title=f"calibrate --target-kl sweep → {cfg.out}")
    for name in ("target KL", "met", "calibration KL", "cost / dense", "sparse heads", "mean density", "artifact"):
        table.add_column(name, justify="left" if name == "artifact" else "right")
    for summary in summaries:
        target = summary["target"]
        cal = target["calibration"]
        table.add_row(f"{target['value']:g}", "yes" if target["met"] else "no", "-" if cal["achieved"] is None else f"{cal['achieved']:.3g}",
                      f"{cal['cost_fraction']:.1%}", str(cal["sparse_heads"]), f"{summary['mean_density']:.1%}", Path(summary["artifact"]).name)
    out_console.print(fold_cells(table))


def _summary(result, max_tokens: int) -> tuple[dict, dict]:
    """(effective density per head, the summary --json prints) of one calibrate result."""
    from sparsesearch.artifacts.summary import effective_densities

    density = effective_densities(result.manifest, result.rows)
    summary = {
        "artifact": str(result.path), "map_png": str(result.map_png) if result.map_png else None,
        "patterns": dict(Counter(r["pattern"] for r in _global(result.rows))),
        "boundaries": dict(Counter(r["boundary"] for r in _global(result.rows))),
        "mean_density": round(sum(density.values()) / max(1, len(density)), 4),
        "timings_s": {k: round(v, 2) for k, v in result.timings.items()}, "fidelity": result.fidelity,
        "dense_cutoff": result.manifest["methods"]["mminference"].get("dense_cutoff"),
        "target": _target_summary(result.manifest["methods"]["mminference"].get("target")),
        "budget_png": str(result.curve_png) if result.curve_png else None, "tokens": max_tokens,
    }
    return density, summary


DENSE_ROWS_SHOWN = 8  # rows of the "heads kept dense" table on screen


def _global(rows: list[dict]) -> list[dict]:
    """The rows every head runs without modality ids: all rows x all keys."""
    from sparsesearch.artifacts.columns import is_global

    return [r for r in rows if is_global(r)]


def _target_summary(target: dict | None) -> dict | None:
    """The target record without its curve (the artifact keeps that)."""
    if target is None:
        return None
    return {k: v for k, v in target.items() if k != "curve"}


def guard_line(guard: dict) -> str:
    """One line for people from a target's retrieval_guard record (sparsesearch/search/allocate.py)."""
    # records before Run 38 counted greedy answers (dense_correct); since, keys dense retrieves teacher-forced
    said = f"dense retrieves {guard['dense_retrieves']}" if "dense_retrieves" in guard else f"dense answers {guard['dense_correct']}"
    head = f"retrieval guard ({guard['prompts']} passkey prompts, {said}): "
    if guard.get("held") is None:
        return head + guard.get("why", "not applied")
    if not guard["held"]:
        return head + "NOT held: the densest sparse allocation still loses answers"
    if guard.get("by") == "protect":
        layers = ", ".join(str(layer) for layer in guard["protect"]["layers"])
        return head + f"held by keeping layer(s) {layers} dense: {guard['kl_choice_cost']:.1%} to {guard['cost']:.1%} of dense cost"
    if guard["cost"] > guard["kl_choice_cost"]:
        return head + f"held by moving from {guard['kl_choice_cost']:.1%} to {guard['cost']:.1%} of dense cost"
    return head + "held at the KL target's own choice"


def _render_target(target: dict) -> None:
    cal, held = target["calibration"], target.get("held_out") or {}
    status = "met" if target["met"] else f"MISSED ({target['missed']})"
    achieved = "-" if cal["achieved"] is None else f"{cal['achieved']:.3g}"
    line = (f"target {target['kind']} {target['value']:g}: {status}; calibration {achieved}, cost {cal['cost_fraction']:.1%} of dense, "
            f"mean density {cal['mean_density']:.1%} of searched heads, {cal['sparse_heads']} sparse heads")
    if held.get("achieved") is not None:
        line += f"; held-out {held['achieved']:.3g} ({'met' if held['met'] else 'NOT met'})"
    out_console.print(line, highlight=False)
    model = target.get("kl_model")
    if model:
        top = sorted((l for l in model["layers"] if l["kl"] is not None), key=lambda l: -l["kl"])[:5]
        out_console.print(f"KL model (one layer sparse at {model['probe']['cost_fraction']:.0%} of dense cost): layer KL sum "
                          f"{model['sum_of_layer_kl']:.3g}; largest: " + ", ".join(f"layer {l['layer']} {l['kl']:.2g}" for l in top), highlight=False)
    guard = target.get("retrieval_guard")
    if guard:
        out_console.print(guard_line(guard), highlight=False)
    if target["dense_heads"]:
        dense = target["dense_heads"]
        table = Table(title=f"heads kept dense ({len(dense)})")
        table.add_column("layer", justify="right")
        table.add_column("head", justify="right")
        table.add_column("why")
        for d in dense[:DENSE_ROWS_SHOWN]:
            table.add_row(str(d["layer"]), str(d["head"]), d["reason"])
        if len(dense) > DENSE_ROWS_SHOWN:  # every reason is in the artifact; a screen of them says no more
            table.add_row("…", "…", f"{len(dense) - DENSE_ROWS_SHOWN} more: every reason is in the manifest (methods.mminference.target.dense_heads) and in --json")
        out_console.print(table)


def _render(result, summary, density) -> None:
    table = Table(title=f"calibrate → {summary['artifact']}")
    table.add_column("layer", justify="right")
    table.add_column("patterns")
    table.add_column("boundary")
    table.add_column("density", justify="right")
    table.add_column("output error", justify="right")
    fid = (result.fidelity or {}).get("layer_output_error", {})
    table.add_column("held-out error", justify="right")
    layers = sorted({r["layer"] for r in result.rows})
    sliding = result.manifest["methods"]["mminference"].get("sliding_layers") or {}
    for layer in layers:
        rows = [r for r in _global(result.rows) if r["layer"] == layer]
        mix = ", ".join(f"{p}×{n}" for p, n in sorted(Counter(r["pattern"] for r in rows).items()))
        if layer in sliding.get("layers", ()):  # a hybrid model's own window, not a searched choice
            mix = f"model's sliding window {sliding['window']}"
        kinds = ", ".join(f"{b}×{n}" for b, n in sorted(Counter(r["boundary"] for r in rows).items()))
        dens = sum(density[(layer, r["head"])] for r in rows) / len(rows)
        err = result.manifest["methods"]["mminference"]["calibration_layer_output_error"].get(str(layer))
        held = fid.get(str(layer))
        table.add_row(str(layer), mix, kinds, f"{dens:.1%}", "-" if err is None else f"{err:.3f}", "-" if held is None else f"{held:.3f}")
    out_console.print(fold_cells(table))
    if result.fidelity:
        from sparsesearch.fidelity import describe

        for report in [result.fidelity, *result.fidelity.get("also", [])]:
            for line in describe(report):
                out_console.print(f"held-out {line}" if line.startswith(report["eval_data"]) else line)
    if summary["target"]:
        _render_target(summary["target"])
    for line in what_it_buys(summary):
        out_console.print(line, highlight=False)
    files = "".join(f"  {name}: {summary[key]}" for name, key in (("map", "map_png"), ("budget curve", "budget_png")) if summary[key])
    out_console.print(f"timings (s): {summary['timings_s']}{files}", highlight=False)


def what_it_buys(summary: dict) -> list[str]:
    """Plain lines on what the artifact saves and where: the attention it computes (and, under a target, its
    cost) as a fraction of dense, and the prompt length from which the runtime runs it on this device."""
    target = summary.get("target") or {}
    cost = (target.get("calibration") or {}).get("cost_fraction")
    lines = [f"attention computed: {summary['mean_density']:.1%} of dense (mean over heads)"
             + ("" if cost is None else f"; cost {cost:.1%} of dense under the search's cost model")]
    if target.get("kind") == "max_output_error" and target.get("calibration"):
        sparse = target["calibration"]["sparse_heads"]
        total = sparse + len(target.get("dense_heads") or [])
        line = f"{sparse} of {total} searched heads run sparse, each within output error {target['value']:g} of dense; {total - sparse} stay dense"
        if 2 * sparse < total:
            line += (f": at {summary.get('tokens')} tokens this model needs near-dense attention to stay lossless, so the "
                     f"artifact saves little here; it pays off on longer prompts (calibrate at the length you serve)")
        lines.append(line)
    cut = summary.get("dense_cutoff") or {}
    if cut.get("min_tokens") is not None:
        how = "measured on this device" if cut.get("source") == "measured" else cut.get("source", "")
        lines.append(f"the runtime runs dense below {cut['min_tokens']} tokens and this artifact from there on ({how})")
    elif cut:
        lines.append(f"on this device sparse attention was never faster than dense up to {cut.get('measured_up_to')} tokens, so "
                     f"the runtime runs dense up to there: the artifact pays off on a GPU or at longer prompts (--min-tokens overrides)")
    return lines
