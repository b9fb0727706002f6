"""`probe-layers`: probe, choose the start layer, optionally validate it, write the artifact section.

Writing into an artifact that already has per-head patterns composes them (paper 002 Tables 4/6): the
heads table is kept, ``methods.trianglemix`` and ``layers.parquet`` are added, and the runtime runs
triangle attention from the start layer on and the searched patterns below it.

Hybrid models (Gemma 3): only the global layers are probed; the start layer is a global layer and
triangle runs on the global layers from it on (sliding layers keep the model's window, runtime/plan.py).
layers.parquet has a row for every layer, with ``sliding`` / ``sliding_window`` and NaN values on the
sliding ones.

Resume: each probe prompt's section statistics go to ``OUT.probe-layers.partial/`` (sparsesearch.workdir) as
soon as they are computed; with ``resume=True`` a rerun with the same model, prompts and section sizes skips
the prompts done, so a killed run loses at most the prompt in progress and ends with the same artifact (the
statistics round-trip exactly through JSON). The directory is removed once the artifact and plot are written.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pandas as pd

import torch

from ..workdir import WorkDir
from .probe import SECTIONS, ProbeResult, ProbeSettings, StartRule, aggregate, probe_input, probe_sample

INFERENCE_TRIANGLE = {"sink": 8, "window": 512, "last": 128}  # paper 002 inference defaults


@dataclass
class ProbeConfig:
    model: str = "smollm2-135m"
    settings: ProbeSettings = field(default_factory=ProbeSettings)
    threshold: float = 0.2
    validate: bool = False
    validate_step: int = 2
    eval_data: str = "text:shakespeare"  # like calibrate's --eval-data; retrieval specs add accuracy
    eval_samples: int = 2
    kl_tolerance: float = 0.05
    out: Path = Path("artifacts/smollm2-135m-trianglemix")
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    created: str | None = None
    resume: bool = False  # continue from OUT.probe-layers.partial/ (module docstring)


@dataclass
class ProbeOutcome:
    path: Path
    result: ProbeResult
    start_layer: int
    validation: list[dict] | None
    validated_start: int | None
    plot: Path | None
    seconds: float


def run_probe(cfg: ProbeConfig, stage: Callable[[str], None] = lambda s: None, tick: Callable[[int, int], None] = lambda i, n: None,
              *, checked: bool = False) -> ProbeOutcome:
    """Probe, choose, optionally validate, write (module docstring). checked: the caller ran ``preflight(cfg)``
    already (the CLI does, before its progress display)."""
    from ..data import load_calibration
    from ..models import load_model
    from .sections import SectionSpec

    started = time.perf_counter()
    if not checked:
        preflight(cfg)
    stage("loading model")
    model, tokenizer, info = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer files; the probe prompt needs one")
    s = cfg.settings
    spec = SectionSpec(sink=s.sink, window=s.window, last=s.last)
    stage("building probe prompts")
    samples = load_calibration(s.data, tokenizer, max_tokens=s.tokens, samples=s.samples, seed=s.seed)
    work = WorkDir.open(cfg.out, "probe-layers", _settings(cfg, info, samples, model), resume=cfg.resume)
    stage("probing")
    result = aggregate(*probe_samples(model, samples, spec, info, work, tick))
    rule = StartRule(cfg.threshold)
    start = rule.choose(result)
    validation = validated = None
    base = _existing(cfg.out, info)
    if cfg.validate:
        stage("validating start layers")
        validation = validate_starts(model, tokenizer, info, cfg, base)
        validated = smallest_within(validation, cfg.kl_tolerance)
    stage("writing artifact")
    path = _write(cfg, info, result, rule, start, validation, validated, base)
    plot = None
    try:
        from ..report.probe_plot import draw_probe

        plot = draw_probe(result, start, validated, info, cfg.out.with_name(cfg.out.name + ".png"), SECTIONS)
    except ImportError:
        plot = None
    work.remove()  # the artifact and its plot are written: nothing of the run is left beside them
    return ProbeOutcome(path, result, start, validation, validated, plot, time.perf_counter() - started)


def probe_samples(model, samples, spec, info, work: WorkDir, tick) -> tuple[list[dict], list[int]]:
    """Per prompt: the section statistics (probe_sample) and its length, each prompt a unit of ``work``:
    computed and saved unless done, then read back from its file either way, so a resumed run and an
    uninterrupted one aggregate the very same values."""
    device = next(model.parameters()).device
    per_sample, lengths = [], []
    for i, sample in enumerate(samples):
        name = f"sample-{i:05d}"
        if not work.done(name):
            ids, target = probe_input(sample)
            stats = probe_sample(model, ids, target, spec, device=device, skip=info.sliding_layers)
            work.save(name, {"length": int(ids.numel()), **{k: v.tolist() for k, v in stats.items()}})
        unit = work.load(name)
        per_sample.append({k: torch.tensor(unit[k], dtype=torch.float64) for k in ("grad", "abs", "att")})
        lengths.append(unit["length"])
        tick(i + 1, len(samples))
    return per_sample, lengths


def _settings(cfg: ProbeConfig, info, samples, model) -> dict:
    """What a prompt's statistics depend on (the work directory's fingerprint): the model (revision), the
    prompts themselves (their hash), the section sizes, the device type and dtype. Not the start-layer rule
    nor the validation, which come after the probes."""
    from ..data import sha256_of

    param = next(model.parameters())
    return {"model": info.revision or info.id, "data": sha256_of(samples), "settings": dataclasses.asdict(cfg.settings),
            "device": param.device.type, "dtype": str(param.dtype)}


def preflight(cfg: ProbeConfig) -> None:
    """Every check that needs no weights, before the model loads (sparsesearch.preflight): options, the
    prompt length against the model's context, the data specs, and an artifact already at --out (it is
    composed with, so it must load and fit the model)."""
    from .. import preflight as check

    if not 0 < cfg.threshold < 1:
        raise ValueError(f"--threshold must be in (0, 1), got {cfg.threshold}")
    if cfg.validate_step < 1:
        raise ValueError(f"--validate-step must be >= 1, got {cfg.validate_step}")
    if cfg.validate and cfg.eval_samples < 1:
        raise ValueError(f"--eval-samples must be >= 1 with --validate, got {cfg.eval_samples}")
    if cfg.kl_tolerance < 0:
        raise ValueError(f"--kl-tolerance must be >= 0, got {cfg.kl_tolerance}")
    if cfg.out.exists() and not cfg.out.is_dir():
        raise ValueError(f"--out {cfg.out} exists and is not a directory")
    check.data("--data", cfg.settings.data)
    check.data("--eval-data", cfg.eval_data if cfg.validate else None)
    info = check.model_info(cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=cfg.dtype, device=cfg.device)
    cfg.settings.check(info.max_position_embeddings)
    _existing(cfg.out, info)


def _existing(out: Path, info):
    """An artifact already at --out (validated against the model), to compose with; None if none."""
    if not (out / "manifest.json").is_file():
        return None
    from ..artifacts import load_artifact

    return load_artifact(out, model_info=info)


def _triangle_manifest(info, start: int | None, base, extra: dict | None = None) -> dict:
    from ..artifacts.manifest import new_manifest

    tri = {"start_layer": start, **INFERENCE_TRIANGLE, **(extra or {})}
    if base is not None:
        manifest = json.loads(json.dumps(base.manifest))
        manifest["methods"]["trianglemix"] = tri
        return manifest
    return new_manifest(info, head_index_space="kv", provenance={"kind": "calibrated", "source": "probe-layers"}, methods={"trianglemix": tri})


def validate_starts(model, tokenizer, info, cfg: ProbeConfig, base) -> list[dict]:
    """Sweep L_tri_start (every `validate_step` layers, plus 'none'): triangle attention (inference
    defaults) from layer L on, vs the artifact without it (the model's own attention when there is no
    artifact), which runs once; measured by the one fidelity path (sparsesearch/fidelity.py: attend +
    compare). Per row: ``kl`` (what kl_tolerance bounds: on retrieval prompts the next-token KL at the
    answer position; on natural text the teacher-forced mean over every position, since one position of
    running text is noise), the teacher-forced mean ``kl_mean``, and on retrieval prompts the accuracy and
    the reference's retrieval verdict (None on natural text)."""
    from ..data import is_retrieval_spec
    from ..fidelity import accuracy, attend, compare, held_out_samples

    retrieval = is_retrieval_spec(cfg.eval_data)
    heads = base.heads if base is not None else pd.DataFrame(columns=["layer"])
    samples, depths = held_out_samples(cfg.eval_data, tokenizer, samples=cfg.eval_samples, tokens=cfg.settings.tokens,
                                       seed=cfg.settings.seed + 1000)
    artifact = lambda start: SimpleNamespace(manifest=_triangle_manifest(info, start, base), heads=heads)
    reference = attend(model, tokenizer, samples, artifact(None) if base is not None else None, min_tokens=64)
    rows = [{"start_layer": None, "accuracy": accuracy(reference.generations) if retrieval else None, "kl": 0.0, "kl_mean": 0.0}]
    for start in info.global_layers[:: cfg.validate_step]:  # triangle starts only on global layers (all layers of a uniform model)
        report = compare(model, samples, reference, attend(model, tokenizer, samples, artifact(start), min_tokens=64), min_tokens=64, depths=depths)
        kl_mean = report["teacher_forced"]["kl_mean"]
        rows.append({"start_layer": start, "accuracy": report["sparse_accuracy"], "kl": report["next_token_kl"] if retrieval else kl_mean,
                     "kl_mean": kl_mean, "verdict": report["retrieval"]["verdict"] if retrieval else None})
    return rows


def smallest_within(rows: list[dict], kl_tolerance: float) -> int | None:
    """Smallest start layer whose accuracy matches the reference (natural text: no accuracy, KL alone) and
    whose KL is within tolerance, such that every deeper start in the sweep also qualifies."""
    ref = rows[0]["accuracy"]
    ok = [r for r in rows[1:] if (ref is None or r["accuracy"] >= ref) and r["kl"] <= kl_tolerance]
    good = {r["start_layer"] for r in ok}
    starts = [r["start_layer"] for r in rows[1:]]
    best = None
    for start in reversed(starts):
        if start not in good:
            break
        best = start
    return best


def _layers_table(result: ProbeResult, start: int, validation: list[dict] | None, info) -> pd.DataFrame:
    layers, heads = result.grad_mean.shape[:2]
    val = {r["start_layer"]: r for r in (validation or []) if r["start_layer"] is not None}
    records = []
    for layer in range(layers):
        window = info.window_of(layer)
        for head in range(heads):
            # A hybrid model's sliding layer is not probed (NaN values) and never runs triangle.
            rec = {"layer": layer, "head": head, "chosen_start": layer == start, "sliding": window is not None, "sliding_window": window}
            for i, sec in enumerate(SECTIONS):
                rec[f"grad_{sec}"] = float(result.grad_mean[layer, head, i])
                rec[f"grad_{sec}_se"] = float(result.grad_se[layer, head, i])
                rec[f"abs_grad_{sec}"] = float(result.abs_mean[layer, head, i])
                rec[f"abs_grad_{sec}_se"] = float(result.abs_se[layer, head, i])
                rec[f"att_{sec}"] = float(result.att_mean[layer, head, i])
                rec[f"att_{sec}_se"] = float(result.att_se[layer, head, i])
            v = val.get(layer)
            rec["val_accuracy"] = None if v is None or v["accuracy"] is None else float(v["accuracy"])
            rec["val_kl"] = None if v is None else float(v["kl"])
            records.append(rec)
    return pd.DataFrame.from_records(records)


def _write(cfg, info, result, rule, start, validation, validated, base) -> Path:
    from ..artifacts import write_artifact

    s = cfg.settings
    extra = {
        "table": "layers.parquet", "rule": rule.describe(), "rule_quantity": rule.quantity, "threshold": rule.threshold,
        "probe": {"samples": s.samples, "tokens": s.tokens, "sink": s.sink, "window": s.window, "last": s.last,
                  "seed": s.seed, "data": s.data, "lengths": result.tokens},
        "validation": None if validation is None else {"rows": validation, "kl_tolerance": cfg.kl_tolerance,
                                                         "eval_data": cfg.eval_data, "eval_samples": cfg.eval_samples,
                                                         "validated_start_layer": validated,
                                                         "probe_minus_validated": None if validated is None else start - validated},
    }
    manifest = _triangle_manifest(info, start, base, extra)
    if cfg.created:
        manifest["created"] = cfg.created
    tables = dict(base.tables) if base is not None else {"heads.parquet": []}
    tables["layers.parquet"] = _layers_table(result, start, validation, info)
    manifest.pop("files", None)
    manifest["files"] = {}
    return write_artifact(cfg.out, manifest, tables, overwrite=base is not None)
