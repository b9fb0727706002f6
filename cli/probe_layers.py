"""`sparsesearch probe-layers`: TriangleMix gradient probing and the triangle start layer."""

from __future__ import annotations

import math

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import DeviceOpt, JsonOpt, RunProgress, exits_cleanly, fold_cells, out_console, print_json


# The paper probes 100 prompts, a very long run on a CPU; 8 (README's example) finish in minutes on the bundled
# SmolLM2 at 2K tokens. --samples 100 gives the paper's probe.
DEFAULT_SAMPLES = 8


@exits_cleanly
def probe_layers(
    model: Annotated[str, typer.Option(help="smollm2-135m, gemma3-270m, a local HF directory, a hub id in the local cache, or a .gguf file.")] = "smollm2-135m",
    samples: Annotated[int, typer.Option(help="Probe prompts (paper: 100, a long CPU run; the default finishes in minutes on the bundled model).")] = DEFAULT_SAMPLES,
    tokens: Annotated[int, typer.Option(help="Prompt length in tokens (paper: about 2K).")] = 2048,
    sink: Annotated[int, typer.Option(help="Streaming section: sink tokens (paper: 64).")] = 64,
    window: Annotated[int, typer.Option(help="Streaming section: local window (paper: 128).")] = 128,
    last: Annotated[int, typer.Option(help="Last Q-K section: last query rows (paper: 128).")] = 128,
    threshold: Annotated[float, typer.Option(help="Start-layer rule: middle |dy/dθ| stays <= threshold x peak.")] = 0.2,
    validate: Annotated[bool, typer.Option("--validate", help="Sweep the start layer and measure KL vs the model (and retrieval on retrieval prompts).")] = False,
    validate_step: Annotated[int, typer.Option(help="Start layers swept every N layers (paper: 2).")] = 2,
    eval_data: Annotated[str, typer.Option(help="Validation prompts: natural text (teacher-forced KL over every position, like calibrate) or synthetic:passkey (retrieval + next-token KL; SmolLM2 cannot do UUID retrieval).")] = "text:shakespeare",
    eval_samples: Annotated[int, typer.Option(help="Validation prompts per start layer.")] = 2,
    kl_tolerance: Annotated[float, typer.Option(help="Validation: a start layer qualifies at KL <= this (natural text: teacher-forced mean; retrieval: next-token).")] = 0.05,
    seed: Annotated[int, typer.Option(help="Seed of the UUIDs and prompts.")] = 0,
    out: Annotated[Path, typer.Option(help="Artifact directory; an existing artifact there is composed with.")] = Path("artifacts/smollm2-135m-trianglemix"),
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue a killed run from OUT.probe-layers.partial/ (the prompts probed already).")] = False,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Probe where the Middle Q-K section stops mattering (paper 002 §2.3) and record the start layer.

    Example: sparsesearch probe-layers --model smollm2-135m --samples 8 --validate
    """
    from sparsesearch import preflight as check
    from sparsesearch.probe.probe import ProbeSettings
    from sparsesearch.probe.run import ProbeConfig, preflight, run_probe
    from sparsesearch.workdir import partial_path

    # --out is the target (an artifact there is composed with and replaced whole); the inputs must stay apart.
    check.output_path("--out", out, reads={"--eval-data": eval_data if validate else None}, model=model,
                      beside=[out.with_name(out.name + ".png"), partial_path(out, "probe-layers")])

    settings = ProbeSettings(samples=samples, tokens=tokens, sink=sink, window=window, last=last, seed=seed)
    cfg = ProbeConfig(model=model, settings=settings, threshold=threshold, validate=validate, validate_step=validate_step,
                      eval_data=eval_data, eval_samples=eval_samples, kl_tolerance=kl_tolerance, out=out, device=device,
                      dtype=dtype, trust_remote_code=trust_remote_code, resume=resume)
    preflight(cfg)  # bad input is one line before any progress output
    with RunProgress(transient=json_out) as progress:
        outcome = run_probe(cfg, stage=progress.stage, tick=progress.tick, checked=True)
    r = outcome.result
    middle = r.layer_curve("abs", "middle")
    # A hybrid model's sliding layers are not probed (NaN): null in JSON, "window" in the table.
    curve = lambda values: [None if math.isnan(float(x)) else round(float(x), 8) for x in values]
    summary = {
        "artifact": str(outcome.path), "plot": str(outcome.plot) if outcome.plot else None,
        "start_layer": outcome.start_layer, "validated_start_layer": outcome.validated_start,
        "samples": r.samples, "seconds": round(outcome.seconds, 1),
        "middle_abs_grad_per_layer": curve(middle),
        "middle_grad_per_layer": curve(r.layer_curve("grad", "middle")),
        "validation": outcome.validation,
    }
    if json_out:
        print_json(summary)
        return
    table = Table(title=f"probe-layers → {outcome.path}  (start layer {outcome.start_layer})")
    for col in ("layer", "Grad middle", "|Grad| middle", "|Grad| stream", "|Grad| last", "Att middle"):
        table.add_column(col, justify="right")
    for layer in range(len(middle)):
        mark = " ◀" if layer == outcome.start_layer else ""
        if summary["middle_abs_grad_per_layer"][layer] is None:
            table.add_row(f"{layer}{mark}", "sliding window: not probed", "", "", "", "")
            continue
        table.add_row(f"{layer}{mark}", f"{float(r.layer_curve('grad', 'middle')[layer]):+.2e}", f"{float(middle[layer]):.2e}",
                      f"{float(r.layer_curve('abs', 'stream')[layer]):.2e}", f"{float(r.layer_curve('abs', 'last')[layer]):.2e}",
                      f"{float(r.layer_curve('att', 'middle')[layer]):.2e}")
    out_console.print(fold_cells(table))
    if outcome.validation:
        vt = Table(title=f"validation (triangle sink 8 / window 512 / last 128): smallest good start = {outcome.validated_start}")
        for col in ("start layer", "accuracy", "KL (held to tolerance)", "teacher-forced KL"):
            vt.add_column(col, justify="right")
        for row in outcome.validation:
            acc = "-" if row["accuracy"] is None else f"{row['accuracy']:.0%}"
            vt.add_row("dense" if row["start_layer"] is None else str(row["start_layer"]), acc, f"{row['kl']:.4f}", f"{row['kl_mean']:.4f}")
        verdicts = {row["verdict"] for row in outcome.validation[1:] if row.get("verdict") not in (None, "informative")}
        if verdicts:  # the reference itself does not retrieve: the accuracy column cannot tell starts apart
            vt.caption = f"retrieval {verdicts.pop()}; the start rests on KL alone"
        elif outcome.validation[0]["accuracy"] is None:
            vt.caption = "natural text: no retrieval; the start rests on teacher-forced KL over every position"
        out_console.print(vt)
    out_console.print(f"{outcome.seconds:.0f} s · plot: {summary['plot']}")
