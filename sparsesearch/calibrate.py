"""`calibrate`: MMInference's modality-aware, kernel-aware per-head search, end to end.

model + calibration samples -> one forward per sample with QKV capture; inside each layer's callback the
layer is searched (search.layer) and its scores are written to ``OUT.partial/`` at once -> choice per head
(mean objective over samples) -> artifact (manifest + heads.parquet) -> fidelity on a held-out sample with
the sparse runtime vs dense -> the artifact is written atomically, with a PNG map beside it.

Hybrid models (Gemma 3): only the global (full-attention) layers are captured and searched; each sliding
layer gets the model's own window as its rows (columns.window_row: ashape sink 0, local = sliding_window,
density computed at the calibration length, nothing measured) and ``methods.mminference.sliding_layers``
says so. Skipping the search there is the point: 15 of Gemma 3 270M's 18 layers cost nothing.

More than one GPU (``gpus`` > 1): the capture feeds each layer's q/k/v to one search worker per GPU
(search/spread.py) instead of searching inside the forward; the workers write the same per-layer files, so the
artifact is the same. ``device_map`` / ``max_memory`` split a model one GPU cannot hold for the capture
(models/split.py). Scaling to more GPUs and hosts: docs/mminference.md.

Resume: ``OUT.partial/state.json`` fingerprints the run (model revision, data hash, search space hash,
settings); per (sample, layer) score files are skipped on ``resume=True``, so a killed run loses at most
the layer in progress and ends with the same artifact (scores round-trip exactly through JSON).
``search_dir`` keeps those files in a directory of the caller's instead (kept after the run): the quality
target is not part of the fingerprint, so runs at other targets with ``resume=True`` allocate from the same
search without repeating it (a --target-kl sweep costs one search, not one per target).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .artifacts.columns import WINDOW_BLOCK, window_params, window_row
from .artifacts.summary import effective_densities
from .models.split import check_gpus, check_split, gpu_count
from .search.cost import MeasuredCost, cost_model_for
from .search.spread import Spread
from .patterns.dense import DenseParams
from .search.layer import OBJECTIVES, Timings, artifact_row, head_rows, mean_scored, score_candidate, score_layer
from .patterns.boundary import BOUNDARIES
from .search.boundary import TOLERANCE, ScopeResult, choose_boundary, search_modal_layer
from .search.space import MODALITY_NAMES, Candidate, load_space
from .search.allocate import TargetRequest, allocate_target
from .search.targets import check_target
from .search.workfiles import GLOBAL, boundary_path, layer_done, scope_files, scope_path, scores_from_json, scores_to_json, write_state
from .tuning import VERIFY_MIN_TOKENS, TuningMemo, fidelity_kl, retrieval_guard, tuning_kl, tuning_record

# The command line's default target (issue P11 §3): every head its cheapest candidate whose attention output is
# within 2% (relative L2) of dense on the calibration sample, the others dense. On SmolLM2 at 4K it measured
# held-out teacher-forced KL 0.0013 (perplexity +0.5%) where the space's budget search gave 0.055 (+7.8%); a 5%
# cap gave 0.0073 (+1.8%). RESULTS Run 32 (CPU).
DEFAULT_MAX_OUTPUT_ERROR = 0.02
DENSE_CANDIDATE = Candidate("dense", {})


@dataclass
class CalibrateConfig:
    model: str = "smollm2-135m"
    data: str = "synthetic:kv-retrieval"
    search_space: str | None = None
    max_tokens: int = 4096
    samples: int = 1
    seed: int = 0
    out: Path = Path("artifacts/smollm2-135m")
    device: str = "auto"
    dtype: str = "auto"
    head_space: str = "kv"
    objective: str = "output_error"
    resume: bool = False
    overwrite: bool = False
    eval_data: str | None = "text:shakespeare"  # comma-separated held-out sources, see eval_specs
    eval_samples: int = 1
    eval_tokens: int | None = None  # held-out length (None: max_tokens)
    min_tokens: int | None = None  # runtime dense cut-off; None: measured on this device (search/cutoff.py)
    # Quality targets (search/targets.py), at most one: model KL on the calibration distribution, a per-head
    # output-error cap, or a cost budget as a fraction of dense cost. allow_miss: write the best reachable
    # allocation (marked missed) instead of refusing an unreachable target.
    target_kl: float | None = None
    max_output_error: float | None = None
    latency_budget: float | None = None
    allow_miss: bool = False
    tune_samples: int = 2  # --target-kl: calibration-stream prompts the KL is measured on (after the searched ones)
    retrieval_guard: int = 4  # --target-kl: passkey prompts whose answers the chosen point must keep (tuning.py); 0: off
    search_dir: Path | None = None  # the per-layer search files, kept (None: OUT.partial/, removed when done)
    trust_remote_code: bool = False
    created: str | None = None  # fixed creation time (tests, reproducible bytes)
    gpus: int = 1  # search workers, one per GPU (search/spread.py); 1: searched in-process, inside the forward
    device_map: str | dict | None = None  # the model split for the capture (models/split.py); None: on one device
    max_memory: dict | None = None  # {GPU index | "cpu": "20GiB"} bounding the device_map split
    search_devices: tuple[str, ...] | None = None  # the workers' devices when not cuda:0..gpus-1 (tests: CPU workers)
    # the cap applied as --max-output-error when no target is given and the calibration data is text (the CLI's
    # default, DEFAULT_MAX_OUTPUT_ERROR); multi-modal data, whose boundary search the targets do not cover,
    # and None keep the search space's budget
    default_max_output_error: float | None = None
    defaulted: bool = False  # set by calibrate when the default cap is the target (the record says "default")


@dataclass
class Progress:
    """Callbacks a front end may set: stage names, and per-layer ticks."""

    stage: Callable[[str], None] = lambda name: None
    layer: Callable[[int, int, int], None] = lambda sample, layer, total: None


@dataclass
class CalibrationResult:
    path: Path
    manifest: dict
    rows: list[dict]
    timings: dict
    fidelity: dict | None
    map_png: Path | None = None
    notes: list[str] = field(default_factory=list)
    curve_png: Path | None = None


def check_config(cfg: CalibrateConfig) -> None:
    if cfg.max_tokens < 64:
        raise ValueError(f"--max-tokens must be >= 64, got {cfg.max_tokens}")
    if cfg.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {cfg.samples}")
    if cfg.head_space not in ("query", "kv"):
        raise ValueError(f"--head-space must be 'query' or 'kv', got {cfg.head_space!r}")
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.eval_tokens is not None and cfg.eval_tokens < 64:
        raise ValueError(f"--eval-tokens must be >= 64, got {cfg.eval_tokens}")
    if cfg.eval_samples < 0:
        raise ValueError(f"--eval-samples must be >= 0, got {cfg.eval_samples}")
    if cfg.tune_samples < 1:
        raise ValueError(f"--tune-samples must be >= 1, got {cfg.tune_samples}")
    if cfg.retrieval_guard < 0:
        raise ValueError(f"--retrieval-guard must be >= 0, got {cfg.retrieval_guard}")
    if cfg.min_tokens is not None and cfg.min_tokens < 1:
        raise ValueError(f"--min-tokens must be >= 1, got {cfg.min_tokens}")
    given = {kind: value for kind, value in _targets(cfg).items() if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one quality target, got {' and '.join('--' + k.replace('_', '-') for k in given)}")
    for kind, value in given.items():
        check_target(kind, value)
    if cfg.allow_miss and not given:
        raise ValueError("--allow-miss needs a target (--target-kl, --max-output-error or --latency-budget)")
    check_gpus(cfg.gpus)


def search_devices(cfg: CalibrateConfig) -> list[str]:
    """The search workers' devices; [] when the search runs in-process (one GPU, or the CPU)."""
    if cfg.search_devices is not None:
        return list(cfg.search_devices)
    return [f"cuda:{i}" for i in range(cfg.gpus)] if cfg.gpus > 1 else []


def _targets(cfg: CalibrateConfig) -> dict[str, float | None]:
    return {"target_kl": cfg.target_kl, "max_output_error": cfg.max_output_error, "latency_budget": cfg.latency_budget}


def target_of(cfg: CalibrateConfig) -> tuple[str, float] | None:
    """(kind, value) of the one quality target set, or None."""
    return next(((k, v) for k, v in _targets(cfg).items() if v is not None), None)


def preflight(cfg: CalibrateConfig):
    """Every check that needs no weights (sparsesearch.preflight), before the model loads; returns the
    search space. The output directory is checked here, not after the search: a refusal at the end would
    waste the whole run."""
    from . import preflight as check

    check_config(cfg)
    check_search_dir(cfg)
    space = load_space(cfg.search_space)
    check.out_dir("--out", cfg.out, overwrite=cfg.overwrite)
    # The context first: a length past it is refused as that, not as data too short to hold it.
    info = check.model_info(cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=cfg.dtype, device=cfg.device)
    check.tokens_fit("--max-tokens", cfg.max_tokens, info)
    check.tokens_fit("--eval-tokens", cfg.eval_tokens, info)
    if cfg.device_map is not None or cfg.max_memory is not None:
        from .models.load import _choose_dtype, check_load_options
        from .models.resolve import resolve

        resolved = resolve(cfg.model, trust_remote_code=cfg.trust_remote_code)
        check_split(resolved, cfg.device_map, cfg.max_memory, _choose_dtype(cfg.dtype, check_load_options(cfg.dtype, cfg.device), resolved))
    check.data("--data", cfg.data, tokens=cfg.max_tokens)
    for spec in eval_specs(cfg.eval_data) if cfg.eval_samples else []:
        check.data("--eval-data", spec, tokens=cfg.eval_tokens or cfg.max_tokens, held_out=True)
    return space


def _prunes(cfg: CalibrateConfig) -> bool:
    """Whether the layer search skips candidates over the space's budget: not under a quality target, which
    chooses across budgets (search/layer.score_layer)."""
    return cfg.target_kl is None and cfg.max_output_error is None


def _fingerprint(cfg: CalibrateConfig, info, data_sha: str, space_sha: str, device: str) -> str:
    settings = {
        "model": info.revision or info.id, "data": data_sha, "space": space_sha, "max_tokens": cfg.max_tokens,
        "samples": cfg.samples, "seed": cfg.seed, "head_space": cfg.head_space, "device": device.split(":")[0],
    }
    if not _prunes(cfg):  # the layer scores then include candidates over the budget: not those of a pruned search
        settings["prune"] = False
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def work_dir(cfg: CalibrateConfig) -> Path:
    """Where the per-layer search files go: --search-dir, else OUT.partial/."""
    return cfg.search_dir if cfg.search_dir is not None else cfg.out.with_name(cfg.out.name + ".partial")


def check_search_dir(cfg: CalibrateConfig) -> None:
    """ValueError (exit 2, before the model loads) for a --search-dir that is not ours to fill or clear: a file,
    the artifact's own directory, or a directory holding anything but a calibrate search (state.json)."""
    path = cfg.search_dir
    if path is None:
        return
    if path.resolve() == cfg.out.resolve() or cfg.out.resolve() in path.resolve().parents:
        raise ValueError(f"--search-dir {path} is --out or inside it; give a directory of its own")
    if path.exists() and not path.is_dir():
        raise ValueError(f"--search-dir {path} is a file")
    if path.is_dir() and any(path.iterdir()) and not (path / "state.json").is_file():
        raise ValueError(f"--search-dir {path} holds files that are not a calibrate search (no state.json); give an empty or new directory")


def _prepare_workdir(cfg: CalibrateConfig, fingerprint: str) -> tuple[Path, str]:
    """The search directory with state.json; returns (dir, created). Without resume any old search state is
    dropped (``check_search_dir`` made sure a given directory holds nothing else)."""
    work = work_dir(cfg)
    state_path = work / "state.json"
    if cfg.resume and state_path.is_file():
        state = json.loads(state_path.read_text())
        if state.get("fingerprint") != fingerprint:
            raise ValueError(f"--resume: {work} was started with other settings (model, data, search space or options); drop --resume to start over")
        return work, state["created"]
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    from .artifacts.manifest import utc_now

    created = cfg.created or utc_now()
    write_state(state_path, {"fingerprint": fingerprint, "created": created})
    return work, created


def _modalities_present(sample) -> list[str]:
    ids = sorted(set(int(m) for m in sample.modality.unique()))
    return [MODALITY_NAMES[i] for i in ids]


def search_layer(cfg: CalibrateConfig, work: Path, si: int, layer: int, q, k, v, scale: float | None, present: list[str],
                 frame_stride, modality, space, costs) -> None:
    """Search one captured layer of sample ``si`` and write its files (a text sample: one global scope; a
    multi-modal one: every region of Alg. 4 and the boundary scores). q [1, Hq, N, D], k/v [1, Hkv, N, D] on
    the device the search runs on; modality [N] long or None."""
    if len(present) < 2:
        scored, budget, t = score_layer(q, k, v, space, costs, head_space=cfg.head_space, modality=present[0],
                                        frame_stride=frame_stride, scale=scale, prune=_prunes(cfg))
        dense = dense_cost(q, k, v, space, costs, cfg.head_space, scale)
        mix, split = (price(q, k, v, costs, cfg.head_space, scale) for price in (mix_cost, split_cost))
        write_state(scope_path(work, si, layer, GLOBAL), scores_to_json(scored, budget, t, dense, mix, split))
        return
    cached = {scope: ScopeResult(*scores_from_json(json.loads(path.read_text())))
              for scope, path in scope_files(work, si, layer).items()}
    save = lambda scope, res: write_state(scope_path(work, si, layer, scope), scores_to_json(res.scored, res.budget, res.timings))
    _, scores = search_modal_layer(q, k, v, modality.to(q.device), MODALITY_NAMES, space, costs, head_space=cfg.head_space,
                                   objective=cfg.objective, frame_stride=frame_stride, scale=scale, cached=cached, on_scope=save)
    write_state(boundary_path(work, si, layer), scores)


@dataclass
class _WorkerState:
    """A search worker's (search/spread.py): the space and its own cost model on its device."""

    space: object
    costs: object
    device: str

    def close(self) -> dict:
        """Flush measured times into the shared cost cache (merged under its lock) and count the launches."""
        if self.costs.kind != "measured":
            return {}
        self.costs.flush()
        return {"timed": self.costs.timed, "priced_from_table": self.costs.priced}


def _worker_setup(device: str, space) -> _WorkerState:
    return _WorkerState(space, cost_model_for(device), device)


def _worker_search(state: _WorkerState, cfg, work, si, layer, q, k, v, scale, present, frame_stride, modality) -> None:
    d = state.device
    search_layer(cfg, work, si, layer, q.to(d), k.to(d), v.to(d), scale, present, frame_stride, modality, state.space, state.costs)


def _layer_searcher(cfg, work, si, sample, present, todo, space, costs, device, info, progress, spread=None):
    """The capture callback of one sample: each layer in ``todo`` searched as its QKV arrive (search_layer),
    or, with a ``spread`` of workers, handed to them (the CPU copies) while the forward goes on."""
    frame_stride = sample.meta.get("frame_stride")
    modality = sample.modality if len(present) > 1 else None

    def on_layer(layer, cap) -> None:
        if cap.layer not in todo:
            return
        if spread is not None:
            spread.submit((si, cap.layer), cfg, work, si, cap.layer, cap.q.cpu(), cap.k.cpu(), cap.v.cpu(), cap.scale, present, frame_stride, modality)
            spread.poll()
            return
        search_layer(cfg, work, si, cap.layer, cap.q.to(device), cap.k.to(device), cap.v.to(device), cap.scale, present,
                     frame_stride, modality, space, costs)
        progress.layer(si, cap.layer, info.num_layers)

    return on_layer


def dense_cost(q, k, v, space, costs, head_space: str, scale: float | None) -> torch.Tensor:
    """Per head of the head space, the cost model's price of dense attention (float64 [H], ms): the point
    of error 0 on every head's curve that the quality targets trade against (search/targets.py).

    Measured on a GPU, that is the runtime's dense path, torch SDPA (``MeasuredCost.dense_ms``). It was our kernel
    on an all-causal index, which no dense head runs through: at head_dim 256 it runs at 0.6-0.7 of SDPA's rate, so
    every sparse candidate looked about 1.5x cheaper against dense than the runtime makes it, and Gemma 3's searched
    artifacts sparsified layers 5 and 11 at 60% density for no saving (Run 34). The analytic model prices
    computed entries alike on every path, so on a CPU dense is scored as a candidate."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(costs, MeasuredCost):
        return costs.dense_ms(q, k, v, head_space, scale)
    dense = score_candidate(DENSE_CANDIDATE, DenseParams(), q, k, v, None, None, head_space, space.block_m,
                            space.block_n, scale, costs, Timings())
    return dense.cost_ms


def mix_cost(q, k, v, costs, head_space: str, scale: float | None) -> float:
    """What the layer pays (ms) on top of its heads' prices when it mixes sparse and dense heads: measured on a
    GPU (``MeasuredCost.mix_ms``: 0.25-0.55 ms at Gemma 3's shape, 16K-32K, H200, before the runtime's dense
    heads stopped gathering K/V per query head); 0 under the analytic model, which prices computed entries
    only, so a CPU's allocations are what they were."""
    if not isinstance(costs, MeasuredCost):
        return 0.0
    return costs.mix_ms(q, k, v, head_space, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def split_cost(q, k, v, costs, head_space: str, scale: float | None) -> float:
    """What the layer pays (ms) for each sparse launch past its first (heads on different candidates run apart):
    measured on a GPU (``MeasuredCost.split_ms``); 0 under the analytic model, which has no launches."""
    if not isinstance(costs, MeasuredCost):
        return 0.0
    return costs.split_ms(q, k, v, head_space, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def _assemble_layer(work: Path, layer: int, n_samples: int, space, objective: str, total: Timings,
                    stability: dict | None = None) -> tuple[list[dict], float, dict | None]:
    """Rows of one layer from the per-sample files: per scope the candidates' scores averaged over the
    samples that have it, each head's pick; per head the boundary type chosen on the mean boundary scores
    (every row of a head carries it). Returns (rows, the chosen approximation's mean error, report).
    With several samples of text (the global scope alone), each head's pick is also checked per sample
    (search/stability.py): an unstable head takes the safer choice, and ``stability[layer]`` gets the account."""
    scopes: dict[str, list[Path]] = {}
    for si in range(n_samples):
        for scope, path in scope_files(work, si, layer).items():
            scopes.setdefault(scope, []).append(path)
    chosen_rows = {}
    for scope, paths in scopes.items():
        loaded = [scores_from_json(json.loads(p.read_text())) for p in paths]
        for _, _, t in loaded:
            total.add(t)
        scored = mean_scored([sc for sc, _, _ in loaded])
        budget = torch.stack([b for _, b, _ in loaded]).mean(0)
        chosen_rows[scope] = head_rows(scored, budget, objective)
        if scope == GLOBAL and len(loaded) > 1 and stability is not None and len(scopes) == 1:
            chosen_rows[scope] = _stable_rows(layer, chosen_rows[scope], loaded, budget, objective, stability)
    reports = [json.loads(p.read_text()) for si in range(n_samples) if (p := boundary_path(work, si, layer)).is_file()]
    heads = len(chosen_rows[GLOBAL])
    if not reports:
        kinds, report = ["none"] * heads, None
        error = sum(r["output_error"] for r in chosen_rows[GLOBAL]) / heads
    else:
        mean = lambda key, t: [sum(r["types"][t][key][h] for r in reports) / len(reports) for h in range(heads)]
        types = {t: {key: mean(key, t) for key in ("error", "recall", "cost_ms", "density")} for t in reports[0]["types"]}
        budget = [sum(r["budget_ms"][h] for r in reports) / len(reports) for h in range(heads)]
        kinds = choose_boundary(types, budget, objective)
        report = {"chosen": kinds, "budget_ms": [round(b, 9) for b in budget],
                  **{t: {key: [round(x, 6 if key != "cost_ms" else 9) for x in vals] for key, vals in d.items()} for t, d in types.items()}}
        error = sum(types[kind]["error"][h] for h, kind in enumerate(kinds)) / heads
    rows = []
    for scope, chosen in sorted(chosen_rows.items(), key=lambda kv: (kv[0] != GLOBAL, kv[0])):
        rows.extend(artifact_row(layer, scope, r, space, kinds[r["head"]]) for r in chosen)
    return rows, error, report


def _stable_rows(layer: int, chosen: list[dict], loaded, budget, objective: str, stability: dict) -> list[dict]:
    """``chosen`` with unstable heads on their safer choice (search/stability.py); the account goes to stability."""
    from .search.stability import head_stability, safer_rows

    per_sample = [sc for sc, _, _ in loaded]
    stability[layer] = head_stability(per_sample, [b for _, b, _ in loaded], objective, chosen)
    return safer_rows(chosen, per_sample, budget, objective, stability[layer])


def _boundary_summary(rows: list[dict], report: dict, space) -> dict | str:
    """The manifest's account of the inter-modality step."""
    if not report:
        return "not needed: the calibration data is single-modality, so Alg. 4 reduces to the intra-modality search (every head boundary none)"
    counts = {}
    for layer in report.values():
        for kind in layer["chosen"]:
            counts[kind] = counts.get(kind, 0) + 1
    return {
        "types": list(space.boundaries), "tolerance": TOLERANCE, "order": list(BOUNDARIES), "chosen": counts,
        "region_path": "every region ran on our kernels over gathered copies of its rows and keys (the region frame row_pos for cross, row and key regions), costed like any candidate",
        "scores": report,
    }


def calibrate(cfg: CalibrateConfig, progress: Progress | None = None, *, space=None) -> CalibrationResult:
    """Run the whole job (see the module docstring). space: what ``preflight(cfg)`` returned when the caller
    ran it already (the CLI does, before its progress display); otherwise the checks run here."""
    progress = progress or Progress()
    space = space or preflight(cfg)
    with _spread(cfg, space, progress) as spread:
        return _calibrate(cfg, progress, space, spread)


def _spread(cfg: CalibrateConfig, space, progress: Progress):
    """The search workers (search/spread.py), started before the model loads so that their start-up overlaps
    it; a null context when the search runs in-process."""
    workers = search_devices(cfg)
    if not workers:
        return contextlib.nullcontext()
    return Spread(workers, _worker_setup, (space,), _worker_search)


def sweep_out(out: Path, value: float) -> Path:
    """Where ``calibrate_sweep`` writes the artifact of --target-kl ``value`` inside its --out directory."""
    return out / f"kl{value:g}"


def sweep_configs(cfg: CalibrateConfig, values: list[float]) -> list[CalibrateConfig]:
    """One config per --target-kl value of a sweep: its artifact at ``sweep_out``, every one on the same kept
    search (cfg.search_dir, else OUT.partial/), the later ones resuming it. ValueError for a repeated or bad value."""
    if len(values) < 2 or len(set(values)) != len(values):
        raise ValueError(f"--target-kl: a sweep takes two or more different values, got {', '.join(f'{v:g}' for v in values)}")
    if cfg.out.exists() and not cfg.out.is_dir():
        raise ValueError(f"--out {cfg.out} is a file; a --target-kl sweep writes a directory of artifacts (kl<value>/ each)")
    for value in values:
        check_target("target_kl", value)
    search = work_dir(cfg)
    return [dataclasses.replace(cfg, target_kl=v, out=sweep_out(cfg.out, v), search_dir=search, resume=cfg.resume or i > 0)
            for i, v in enumerate(values)]


def calibrate_sweep(cfg: CalibrateConfig, values: list[float], progress: Progress | None = None) -> list[CalibrationResult]:
    """One artifact per --target-kl value (``sweep_configs``) from one model load and one search: the first value
    searches, the others only allocate from the kept search (as --search-dir with --resume would, without a
    process and a model load each). The search is removed at the end unless cfg.search_dir keeps it."""
    progress = progress or Progress()
    cfgs = sweep_configs(cfg, values)
    spaces = [preflight(c) for c in cfgs]  # every artifact's bad input before the model loads
    cfg.out.mkdir(parents=True, exist_ok=True)
    results = []
    memo = TuningMemo()  # the targets' shared dense run and KL measurements (the per-layer probes above all)
    with _spread(cfgs[0], spaces[0], progress) as spread:
        loaded = _load(cfgs[0], progress)
        for i, (c, space) in enumerate(zip(cfgs, spaces)):
            named = Progress(stage=lambda stage, v=c.target_kl: progress.stage(f"--target-kl {v:g}: {stage}"), layer=progress.layer)
            results.append(_calibrate(c, named, space, spread if i == 0 else None, loaded, memo))
    if cfg.search_dir is None:
        shutil.rmtree(cfgs[0].search_dir, ignore_errors=True)
    return results


def _load(cfg: CalibrateConfig, progress: Progress):
    """(model, tokenizer, info) of cfg.model, refused when there is nothing to calibrate on."""
    from .models import load_model

    progress.stage("loading model")
    model, tokenizer, info = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                                        device_map=cfg.device_map, max_memory=cfg.max_memory)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer files; calibration data needs one")
    if not info.global_layers:
        raise ValueError(f"model {cfg.model!r}: every layer is sliding-window attention (window {info.sliding_window}); nothing to search")
    return model, tokenizer, info


def _calibrate(cfg: CalibrateConfig, progress: Progress, space, spread: Spread | None, loaded=None,
               memo: TuningMemo | None = None) -> CalibrationResult:
    """calibrate() once the workers (if any) are starting. loaded: (model, tokenizer, info) of an earlier
    ``_load`` (a sweep's), else loaded here; memo: a sweep's shared tuning measurements (tuning.TuningMemo)."""
    from .artifacts import write_artifact
    from .artifacts.manifest import default_modalities, new_manifest
    from .data import load_calibration, sha256_of
    from .models import capture_qkv

    model, tokenizer, info = loaded or _load(cfg, progress)
    device = str(next(model.parameters()).device)
    progress.stage("loading calibration data")
    samples = load_calibration(cfg.data, tokenizer, max_tokens=cfg.max_tokens, samples=cfg.samples, seed=cfg.seed)
    if target_of(cfg) and any(len(_modalities_present(x)) > 1 for x in samples):
        raise ValueError("quality targets allocate the global pattern of text calibration data; multi-modal data "
                         "(boundary search over modality regions) is not supported with --target-kl/--max-output-error/--latency-budget")
    cfg = _with_default_target(cfg, samples)
    data_sha = sha256_of(samples)
    resumed = cfg.resume and (work_dir(cfg) / "state.json").is_file()
    work, created = _prepare_workdir(cfg, _fingerprint(cfg, info, data_sha, space.sha256, device))
    notes = [resumed_note(work)] if resumed else []
    if notes:
        progress.stage(notes[0])
    # in-process only: workers price with their own models and merge into the user cache, read after them
    costs = cost_model_for(device) if spread is None else None
    total = Timings()
    workers = f" on {len(spread.procs)} workers" if spread is not None else ""
    if spread is not None:
        spread.on_done = lambda key, dev, seconds: progress.layer(key[0], key[1], info.num_layers)
        progress.stage(f"waiting for{workers} to start")
        spread.wait_ready()
    started = time.perf_counter()  # the search, not the workers' start-up (it overlapped the load)
    for si, sample in enumerate(samples):
        present = _modalities_present(sample)
        todo = {layer for layer in info.global_layers if not layer_done(work, si, layer, len(present) > 1)}
        if not todo:
            continue
        on_layer = _layer_searcher(cfg, work, si, sample, present, todo, space, costs, device, info, progress, spread)
        progress.stage(f"searching sample {si + 1}/{len(samples)}{workers}")
        inputs = {"input_ids": sample.input_ids[None].to(device), **sample.inputs}  # + pixel tensors of a VLM prompt
        capture_qkv(model, inputs, layers=sorted(todo), on_layer=on_layer, to_cpu=spread is not None or not device.startswith("cuda"), info=info)
    reports = spread.finish() if spread else []
    search_s = time.perf_counter() - started
    if spread is not None:
        costs = cost_model_for(device)  # the cache the workers merged their measurements into
    launches = {}
    if costs.kind == "measured":  # the user cache now holds every time measured; a copy goes beside the artifact
        costs.flush()
        if reports:  # the launches were the workers'
            costs.timed = sum(r.closed.get("timed", 0) for r in reports)
            costs.priced = sum(r.closed.get("priced_from_table", 0) for r in reports)
        costs.save_to(cfg.out.with_name(cfg.out.name + ".costs.json"))
        launches = {"cost_launches": {"timed": costs.timed, "priced_from_table": costs.priced}}
    if reports:
        launches["search_workers"] = [{"device": r.device, "layers": r.tasks, "busy_s": round(r.busy_s, 2),
                                       "peak_memory_gib": round(r.peak_bytes / 2**30, 3)} for r in reports]
    if cfg.device_map is not None:
        launches["device_map"] = {"asked": cfg.device_map if isinstance(cfg.device_map, str) else "file",
                                  "max_memory": cfg.max_memory, "placed": _placement(model)}

    rows, layer_errors, boundary_report, layer_stability = [], {}, {}, {}
    lengths = [int(s.input_ids.numel()) for s in samples]
    rows.extend(sliding_rows(info, cfg.head_space, round(sum(lengths) / len(lengths))))
    for layer in info.global_layers:
        layer_rows, error, report = _assemble_layer(work, layer, len(samples), space, cfg.objective, total,
                                                    None if target_of(cfg) else layer_stability)
        rows.extend(layer_rows)
        layer_errors[layer] = error
        if report:
            boundary_report[str(layer)] = report

    methods = {"mminference": {
        "table": "heads.parquet",
        **{
            "objective": cfg.objective, "head_space": cfg.head_space, "cost_model": costs.kind,
            "boundary_search": _boundary_summary(rows, boundary_report, space),
            "kernels": {
                "global_and_intra_regions": "our block-sparse kernels (Triton on a GPU, the index-driven torch backend on a CPU)",
                "grid": "runs its un-permuted block cover (every key block a line touches) until the permutation kernels land; costs count that cover",
                "cross_row_key_regions": "the same kernels with the region frame (row_pos) over gathered copies of the region's rows and keys; in-place permuted loads are a later issue",
            },
            "max_tokens": cfg.max_tokens, "samples": cfg.samples,
            "timings_s": {"search": round(search_s, 2), **{k: round(v, 2) for k, v in dataclasses.asdict(total).items()}},
            **launches,
            "calibration_layer_output_error": {str(k): round(v, 6) for k, v in layer_errors.items()},
        },
    }}
    if layer_stability:
        from .search.stability import record

        methods["mminference"]["stability"] = record(layer_stability, len(samples))
    if info.sliding_layers:
        methods["mminference"]["sliding_layers"] = {
            "layers": list(info.sliding_layers), "window": info.sliding_window,
            "rows": "the model's own sliding window (ashape sink 0, local = window), not searched; density computed at the mean calibration length",
        }
    # Modalities: the model's own, plus any the calibration data marks itself (synthetic:frames on a text
    # model is "video" without a video token); heads rows may name them.
    modalities = default_modalities(info)
    for sample in samples:
        for name in _modalities_present(sample):
            modalities["names"].setdefault(name, MODALITY_NAMES.index(name))
    manifest = new_manifest(
        info, head_index_space=cfg.head_space, modalities=modalities, provenance={"kind": "calibrated", "source": cfg.data},
        methods=methods, calibration={"source": cfg.data, "sha256": data_sha, "lengths": lengths, "seed": cfg.seed},
        search_space={"name": space.name, "sha256": space.sha256}, created=created,
    )
    mm = manifest["methods"]["mminference"]
    target = None
    if target_of(cfg):
        kind, value = target_of(cfg)
        progress.stage(f"allocating budgets for --{kind.replace('_', '-')}")
        sliding = [r for r in rows if r["layer"] in set(info.sliding_layers or ())]

        kl_of = tuning_kl(cfg, model, tokenizer, manifest, sliding, progress, memo)
        started = time.perf_counter()
        guard = None
        if kind == "target_kl" and cfg.retrieval_guard:
            progress.stage(f"retrieval guard: {cfg.retrieval_guard} passkey prompts, dense")
            guard = retrieval_guard(cfg, model, tokenizer, manifest, sliding, progress, memo)
        request = TargetRequest(kind, value, cfg.allow_miss, "default" if cfg.defaulted else "given", cfg.data,
                                tuning_record(cfg) if kind == "target_kl" else None)
        global_rows, target = allocate_target(request, work, len(samples), list(info.global_layers), space, kl_of, guard)
        target["seconds"] = round(time.perf_counter() - started, 1)
        rows = sliding + global_rows
        mm["objective"] = f"target {target['kind']}"
        mm["calibration_layer_output_error"] = {
            str(layer): round(sum(r["output_error"] for r in global_rows if r["layer"] == layer) / max(1, sum(r["layer"] == layer for r in global_rows)), 6)
            for layer in info.global_layers}
        mm["target"] = target
    progress.stage("measuring the dense cut-off")
    mm["dense_cutoff"] = _dense_cutoff(cfg, rows, info, model)
    fidelity = None
    if eval_specs(cfg.eval_data) and cfg.eval_samples:
        progress.stage("fidelity on held-out data")
        fidelity = held_out_fidelity(cfg, model, tokenizer, manifest, rows)
        mm["fidelity"] = fidelity
        if target is not None:
            target["held_out"] = held_out_check(target, fidelity)
    progress.stage("writing artifact")
    path = write_artifact(cfg.out, manifest, {"heads.parquet": rows}, overwrite=cfg.overwrite)
    manifest = json.loads((path / "manifest.json").read_text())  # as written: with the files' hashes
    png = None
    try:
        from .report.heads_map import draw_heads_map

        png = draw_heads_map(rows, info, cfg.out.with_name(cfg.out.name + ".png"), effective_densities(manifest, rows))
    except ImportError:  # matplotlib missing: the artifact stands without its picture
        png = None
    curve_png = None
    if target is not None:
        try:
            from .report.budget_plot import draw_budget_curve

            curve_png = draw_budget_curve(manifest["methods"]["mminference"]["target"], info, cfg.out.with_name(cfg.out.name + ".budget.png"))
        except ImportError:  # matplotlib missing
            curve_png = None
    if cfg.search_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    timings = {"search_s": search_s, **dataclasses.asdict(total)}
    return CalibrationResult(path, manifest, rows, timings, fidelity, png, notes=notes, curve_png=curve_png)


def _with_default_target(cfg: CalibrateConfig, samples: list) -> CalibrateConfig:
    """cfg with its default cap as --max-output-error when no target was given and every sample is text."""
    if cfg.default_max_output_error is None or target_of(cfg) or any(len(_modalities_present(x)) > 1 for x in samples):
        return cfg
    # a default never refuses: when no head can meet it the artifact is dense, and says why per head
    return dataclasses.replace(cfg, max_output_error=cfg.default_max_output_error, allow_miss=True, defaulted=True)


def _placement(model) -> dict:
    """Where accelerate put the model: {device: modules of hf_device_map on it}, and this process's peak memory per GPU."""
    placed = Counter(str(dev) for dev in (getattr(model, "hf_device_map", None) or {}).values())
    peaks = {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / 2**30, 3) for i in range(gpu_count())}
    return {"modules": dict(placed), "main_process_peak_memory_gib": peaks}


def resumed_note(work: Path) -> str:
    """What a resumed run says it kept: the (sample, layer) score files already in OUT.partial/, which it
    does not search again."""
    kept = len({tuple(path.name.split("_", 2)[:2]) for path in work.glob("s*_l*_*.json")})  # s{si}_l{layer}_{region}.json
    return f"resumed from {work}: {kept} (sample, layer) score(s) kept, searched only what is missing"


def eval_specs(eval_data: str | None) -> list[str]:
    """The held-out sources of ``--eval-data``: comma-separated data specs, blanks dropped ('' or None: none).
    The default pairs natural text (teacher-forced KL over every position: can fail on any model) with
    passkey prompts (retrieval counts, with a verdict where dense does not retrieve)."""
    return [spec.strip() for spec in (eval_data or "").split(",") if spec.strip()]


def held_out_fidelity(cfg: CalibrateConfig, model, tokenizer, manifest: dict, rows: list[dict]) -> dict:
    """The manifest's fidelity record: ``evaluate_fidelity`` on the first --eval-data source (the record a
    target is verified on), and on each further source a report of the same shape, listed under ``also``."""
    from .fidelity import evaluate_fidelity

    reports = [evaluate_fidelity(model, tokenizer, manifest, rows, data=spec, samples=cfg.eval_samples,
                                 tokens=cfg.eval_tokens or cfg.max_tokens, seed=cfg.seed, min_tokens=VERIFY_MIN_TOKENS)
               for spec in eval_specs(cfg.eval_data)]
    return reports[0] if len(reports) == 1 else {**reports[0], "also": reports[1:]}


def _dense_cutoff(cfg: CalibrateConfig, rows: list[dict], info, model) -> dict:
    """The manifest's dense cut-off: measured on this device (search/cutoff.py) unless --min-tokens gives it."""
    from .search.cutoff import measure_cutoff

    if cfg.min_tokens is not None:
        return {"min_tokens": cfg.min_tokens, "source": "--min-tokens (not measured)"}
    param = next(model.parameters())
    return {**measure_cutoff(rows, info, head_space=cfg.head_space, max_tokens=cfg.max_tokens, dtype=param.dtype, device=param.device),
            "source": "measured"}


def held_out_check(target: dict, fidelity: dict) -> dict:
    """The target checked on the held-out fidelity run: its KL (and which KL it is), and for a KL or an
    output-error target whether the held-out value meets it (output error: the largest layer error the
    runtime audit measured, a bound below the per-head maximum the cap holds)."""
    key, kl = fidelity_kl(fidelity)
    layer_errors = list(fidelity.get("layer_output_error", {}).values())
    out = {"data": fidelity.get("eval_data"), "samples": fidelity.get("samples"), "kl_metric": key, "kl": kl,
           "max_layer_output_error": max(layer_errors) if layer_errors else None}
    if target["kind"] == "target_kl":
        out["achieved"], out["met"] = kl, kl <= target["value"]
    elif target["kind"] == "max_output_error" and layer_errors:
        out["achieved"], out["met"] = max(layer_errors), max(layer_errors) <= target["value"]
    return out


def sliding_rows(info, head_space: str, tokens: int) -> list[dict]:
    """The rows of a hybrid model's sliding layers: per head the model's window, with the density our
    kernel computes for it at ``tokens`` (block granularity, as every searched row's density)."""
    if not info.sliding_layers:
        return []
    from .patterns import ashape

    density = ashape.density(window_params(info.sliding_window), tokens, block_m=WINDOW_BLOCK, block_n=WINDOW_BLOCK)
    heads = info.num_kv_heads if head_space == "kv" else info.num_heads
    return [window_row(layer, head, info.sliding_window, density=round(density, 6))
            for layer in info.sliding_layers for head in range(heads)]
