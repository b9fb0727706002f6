"""`sparsesearch pareto`: searched artifacts against one-size baselines, quality vs attention cost.

model + held-out windows -> one dense reference (fidelity.held_out_reference) -> per point (every given
artifact, every baseline family at every budget, pareto/baselines.py):
- cost: the post-RoPE q/k/v of every layer of each window (one capture forward per window), run through the
  plan the runtime builds from the point's artifact (pareto/cost.py: GPU timed against SDPA, CPU the cost
  model), summed over layers and windows, over the same sum for dense;
- quality: the point through the sparse runtime on the same windows against the one dense run
  (fidelity.evaluate_against: teacher-forced KL and perplexity over every position, retrieval counts where
  the data has answers), every length sparse (min_tokens 1: the patterns' quality, not the cut-off's);
- keys: passkey prompts at the same length, read until dense holds ``--keys`` keys (at most keycheck.DRAWS x
  that many prompts, needle depths spread by ``key_depth``), each key's digits read teacher-forced the way
  calibration's retrieval guard reads them (sparsesearch/keycheck.py: held by dense when every digit is
  dense's most likely token, lost when a digit falls below GUARD_KEEPS of its dense probability). Average KL
  cannot see a lost needle (one answer among thousands of positions), and the searched artifacts were held to
  their keys while the baselines were not: without this column a baseline that buys its KL by dropping the
  middle of the context looks as good as it measures.
Then the verdict per baseline point (pareto/dominance.py) and the files: rows (Parquet), each point's cost per
layer (Parquet), report (JSON), a PNG of KL vs cost with one line per family.

Resume: each point's quality, and its key reading, is a unit of ``OUT.pareto.partial/`` (sparsesearch/workdir.py:
fingerprinted by the run's settings, named by the point's own rows; the key unit also by ``--keys``), so a
killed run re-measures only the points it had not finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .baselines import DEFAULT_BUDGETS, FAMILIES, Point, baseline_points, check_budgets, check_families

STREAM_ORDER_DATA = "text:shakespeare"  # the calibration part (never the held-out plays) ranks duo's heads
KEY_DATA = "synthetic:passkey"  # the retrieval guard's data (tuning.GUARD_DATA), read from its held-out seeds
DEFAULT_KEYS = 4  # as many keys as calibrate's --retrieval-guard holds by default


@dataclass
class ParetoConfig:
    model: str = "smollm2-135m"
    artifacts: list[Path] = field(default_factory=list)
    baselines: list[str] = field(default_factory=lambda: list(FAMILIES))
    budgets: list[float] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    data: str = "text:shakespeare"
    samples: int = 1
    tokens: int = 4096
    seed: int = 0
    calibration_data: str = STREAM_ORDER_DATA
    triangle_start: int | None = None
    keys: int = DEFAULT_KEYS
    out: Path | None = None
    overwrite: bool = False
    resume: bool = False
    device: str = "auto"
    dtype: str = "auto"


@dataclass
class Progress:
    """Callbacks a front end may set: stage names, and per-point ticks (done, total, label)."""

    stage: Callable[[str], None] = lambda name: None
    point: Callable[[int, int, str], None] = lambda done, total, label: None


def preflight(cfg: ParetoConfig):
    """Every check the arguments, the paths and the model's config allow, before any weights load (one
    ValueError line each). Returns (model info, loaded artifacts)."""
    from .. import preflight as check
    from ..artifacts import load_artifact
    from ..fidelity import check_options

    check_families(cfg.baselines)
    check_budgets(cfg.budgets)
    check_keys(cfg.keys)
    if not cfg.artifacts and not cfg.baselines:
        raise ValueError("nothing to compare: give --artifact or at least one --baselines family")
    info = check.model_info(cfg.model, dtype=cfg.dtype, device=cfg.device)
    check.tokens_fit("--tokens", cfg.tokens, info)
    check_options(samples=cfg.samples, tokens=cfg.tokens, min_tokens=1)
    check.data("--data", cfg.data, tokens=cfg.tokens, held_out=True)
    if "duo" in cfg.baselines:
        check.data("--calibration-data", cfg.calibration_data, tokens=cfg.tokens)
    if cfg.triangle_start is not None and cfg.triangle_start not in info.global_layers:
        raise ValueError(f"--triangle-start {cfg.triangle_start} is not a global layer of '{info.id}' (global layers: "
                         f"{list(info.global_layers)[0]}..{list(info.global_layers)[-1]})")
    if cfg.out is not None:
        _check_out(cfg.out, cfg.overwrite)
    return info, [(Path(p), load_artifact(p, model_info=info)) for p in cfg.artifacts]


def check_keys(keys: int) -> None:
    """--keys: how many keys dense must hold, 0 for no key check (ValueError, one line)."""
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 0:
        raise ValueError(f"--keys must be a whole number >= 0 (passkey keys dense must hold; 0 turns the key check off), got {keys!r}")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if (out / "pareto.json").is_file() and not overwrite:
        raise FileExistsError(f"--out {out} already holds a Pareto report; pass --overwrite to replace it or choose another --out")
    if (out / "manifest.json").is_file():
        raise ValueError(f"--out {out} is an artifact directory; a Pareto report goes in a directory of its own")


def artifact_point(path: Path, art) -> Point:
    """A given artifact as a searched point (its TriangleMix section and sliding rows included)."""
    rows = art.head_rows()
    return Point("searched", path.name, None, f"artifact {path}", art.manifest, rows, searched=True)


def probed_start(cfg: ParetoConfig, artifacts) -> int | None:
    """--triangle-start, else the start layer a given artifact's probe chose."""
    if cfg.triangle_start is not None:
        return cfg.triangle_start
    for _, art in artifacts:
        tri = (art.manifest.get("methods") or {}).get("trianglemix") or {}
        if tri.get("start_layer") is not None:
            return int(tri["start_layer"])
    return None


def stream_order(model, tokenizer, info, cfg: ParetoConfig) -> list[tuple[int, int]]:
    """(layer, KV head) of the global layers, lowest streaming (A-shape sink 64 / local 256) output error
    first, on one calibration window: DuoAttention's head split without its training."""
    import torch

    from ..data import load_calibration
    from ..models import capture_qkv
    from ..search.cost import AnalyticCost
    from ..search.layer import Timings, dense_reference, score_candidate
    from ..search.space import Candidate
    from .baselines import BLOCK, STREAM

    sample = load_calibration(cfg.calibration_data, tokenizer, max_tokens=cfg.tokens, samples=1, seed=cfg.seed)[0]
    errors: dict[tuple[int, int], float] = {}

    def on_layer(layer, cap) -> None:
        scale = cap.scale if cap.scale is not None else cap.q.shape[-1] ** -0.5
        ref_out, ref_lse = dense_reference(cap.q, cap.k, cap.v, "kv", BLOCK, scale)
        scored = score_candidate(Candidate("ashape", {"sink": STREAM.sink, "local": STREAM.local}), STREAM, cap.q, cap.k, cap.v,
                                 ref_out, ref_lse, "kv", BLOCK, BLOCK, scale, AnalyticCost(), Timings())
        for head, err in enumerate(scored.error.tolist()):
            errors[(layer, head)] = err

    device = next(model.parameters()).device
    with torch.no_grad():
        capture_qkv(model, sample.input_ids[None].to(device), layers=list(info.global_layers), on_layer=on_layer,
                    to_cpu=device.type != "cuda", info=info)
    return sorted(errors, key=lambda key: (errors[key], key))


def measure_costs(model, info, points: list[Point], reference) -> tuple[list[dict], list[dict]]:
    """Per point {cost_fraction, searchable_cost_fraction, attention_density, cost_model, attention_ms,
    dense_attention_ms} over every layer of every reference window, and the per-layer table behind them (one
    row per point and layer, summed over the windows: ``layer_rows``)."""
    import pandas as pd
    import torch

    from ..fidelity import sequence_ids
    from ..models import capture_qkv
    from ..runtime.plan import build_plan
    from ..runtime.run import Runner
    from .cost import layer_cost

    plans = [build_plan(p.manifest, pd.DataFrame(p.rows), info, min_tokens=1) for p in points]
    runners = [Runner(plan) for plan in plans]
    by_layer: list[dict[int, list]] = [{} for _ in points]  # layer -> [sparse ms, dense ms, density sum, windows]
    device = next(model.parameters()).device

    def on_layer(layer, cap) -> None:
        for plan, runner, acc in zip(plans, runners, by_layer):
            sparse, dense, density = layer_cost(runner, plan.layer(layer), cap.q, cap.k, cap.v, cap.scale, plan.head_space)
            sums = acc.setdefault(layer, [0.0, 0.0, 0.0, 0])
            sums[0] += sparse
            sums[1] += dense
            sums[2] += density
            sums[3] += 1

    with torch.no_grad():
        for sample in reference.samples:
            capture_qkv(model, sequence_ids(sample)[None].to(device), on_layer=on_layer, to_cpu=device.type != "cuda", info=info)
    kind = "measured kernel time" if device.type == "cuda" else "analytic"
    costs = [_point_cost(plan, layers, kind) for plan, layers in zip(plans, by_layer)]
    return costs, layer_rows(points, plans, by_layer)


def _point_cost(plan, layers: dict[int, list], kind: str) -> dict:
    """One point's cost record from its per-layer sums. searchable_cost_fraction leaves out a hybrid model's
    sliding-window layers: they run the model's own window on both sides, so they dilute cost_fraction by a
    constant the search cannot change, while the search's own predicted fraction (predicted_cost_fraction)
    covers only the layers it allocates."""
    total = [sum(v[i] for v in layers.values()) for i in range(4)]
    searchable = [v for layer, v in layers.items() if plan.layer(layer).kind != "window"]
    s_sparse, s_dense = sum(v[0] for v in searchable), sum(v[1] for v in searchable)
    return {"cost_fraction": round(total[0] / total[1], 6),
            "searchable_cost_fraction": round(s_sparse / s_dense, 6) if s_dense > 0 else None,
            "attention_density": round(total[2] / max(1, total[3]), 6), "cost_model": kind,
            "attention_ms": round(total[0], 4), "dense_attention_ms": round(total[1], 4)}


def layer_rows(points: list[Point], plans, by_layer: list[dict[int, list]]) -> list[dict]:
    """The per-layer cost table: where each point's attention time goes (pareto_layers.parquet)."""
    return [{"family": point.family, "label": point.label, "layer": layer, "kind": plan.layer(layer).kind,
             "attention_ms": round(v[0], 4), "dense_attention_ms": round(v[1], 4), "attention_density": round(v[2] / max(1, v[3]), 6)}
            for point, plan, layers in zip(points, plans, by_layer) for layer, v in sorted(layers.items())]


def predicted_cost(point: Point) -> float | None:
    """The cost fraction a searched artifact's own allocation predicted for its searched layers (its target
    record), None for a baseline or an artifact without one."""
    target = ((point.manifest.get("methods") or {}).get("mminference") or {}).get("target") or {}
    value = (target.get("calibration") or {}).get("cost_fraction")
    return None if value is None else float(value)


def _settings(cfg: ParetoConfig, info) -> dict:
    """What a point's quality depends on besides the point itself: the work directory's fingerprint."""
    return {"model": info.revision or info.id, "data": cfg.data, "samples": cfg.samples, "tokens": cfg.tokens, "seed": cfg.seed}


def _point_key(point: Point) -> str:
    """A unit name for what the point runs (its rows and methods), not its label."""
    from ..workdir import fingerprint

    return fingerprint({"rows": point.rows, "methods": point.manifest.get("methods")})[:24]


def quality(model, tokenizer, point: Point, reference, work, key: str) -> dict:
    """``evaluate_against`` for the point (every length sparse), read from / kept in ``work`` (a
    workdir.WorkDir, or None without --out) as unit ``key``."""
    from ..fidelity import evaluate_against

    if work is not None and work.done(key):
        return work.load(key)
    result = evaluate_against(model, tokenizer, point.manifest, point.rows, reference, min_tokens=1)
    if work is not None:
        work.save(key, result)
    return result


def key_depth(j: int) -> float:
    """The needle depth of key prompt j: the base-2 van der Corput sequence (1/2, 1/4, 3/4, 1/8, 5/8, 3/8, ...),
    so the prompts read when the reading stops are spread over the context, start to end."""
    depth, scale, k = 0.0, 0.5, j + 1
    while k:
        depth, k, scale = depth + scale * (k & 1), k >> 1, scale / 2
    return depth


def key_prompt(cfg: ParetoConfig, tokenizer, j: int):
    """Key prompt j: a passkey prompt of ``cfg.tokens`` tokens from the synthetic stream's held-out part (seed
    cfg.seed + 10_000 + j, data.held_out) with its needle at ``key_depth(j)``. Held out, because calibration's
    guard reads seeds cfg.seed .. of the stream and the searched artifacts were chosen to hold exactly those
    keys: read there, the searched points would be judged on the prompts they were fitted to and the baselines
    on prompts nobody fitted."""
    from ..data import held_out

    return held_out(KEY_DATA, tokenizer, max_tokens=cfg.tokens, seed=cfg.seed + j, depth=key_depth(j))


def dense_side(model, tokenizer, cfg: ParetoConfig):
    """(keycheck.DenseKeys of the key prompts read until dense holds ``cfg.keys`` keys, at most cfg.keys x
    keycheck.DRAWS of them; the report's record of them), or (None, None) with --keys 0."""
    from ..data.calibration import HELD_OUT_OFFSET
    from ..keycheck import DRAWS, KEEPS, dense_keys_until

    if not cfg.keys:
        return None, None
    keys = dense_keys_until(model, tokenizer, lambda j: key_prompt(cfg, tokenizer, j), cfg.keys)
    read = len(keys.samples)
    record = {"data": KEY_DATA, "part": "held-out", "wanted": cfg.keys, "prompts": read,
              "tokens": max(len(s.input_ids) for s in keys.samples),
              "seeds": [cfg.seed + HELD_OUT_OFFSET, cfg.seed + HELD_OUT_OFFSET + read - 1],
              "depths": [round(key_depth(j), 4) for j in range(read)], "dense_retrieves": len(keys.held),
              "held_depths": [round(key_depth(j), 4) for j in keys.held],
              "rule": f"held by dense: every key digit dense's most likely token; lost: a digit below {KEEPS} x its dense p "
                      f"(teacher-forced, as calibrate's retrieval guard); prompts read until dense holds {cfg.keys} or "
                      f"{cfg.keys * DRAWS} were read",
              "why": "held-out seeds: calibration's guard held the searched artifacts to the calibration seeds' keys"}
    return keys, record


def key_reading(model, point: Point, keys, work, key: str) -> dict:
    """{keys_lost, key_worst_ratio} of the point (keycheck.read_keys through the same runtime as its quality, every
    length sparse), read from / kept in ``work`` as unit ``key``; both None when the check is off or dense holds
    no key (nothing to lose: no claim either way)."""
    from ..fidelity import as_artifact
    from ..keycheck import read_keys

    if keys is None or not keys.held:
        return {"keys_lost": None, "key_worst_ratio": None}
    if work is not None and work.done(key):
        return work.load(key)
    check = read_keys(model, keys, as_artifact(point.manifest, point.rows), min_tokens=1)
    result = {"keys_lost": check.misses, "key_worst_ratio": round(check.worst, 6)}
    if work is not None:
        work.save(key, result)
    return result


def point_row(point: Point, cost: dict, fid: dict, keys: dict | None = None, *, checked: int = 0, held: int = 0) -> dict:
    """The Parquet/JSON row of one measured point. keys: ``key_reading``'s result; checked: the passkey prompts
    read (0: --keys 0); held: those whose key dense holds."""
    tf = fid.get("teacher_forced") or {}
    ret = fid.get("retrieval") or {}
    keys = keys or {}
    return {
        "family": point.family, "label": point.label, "searched": point.searched, "budget": point.budget,
        "setting": point.setting, **cost, "predicted_cost_fraction": predicted_cost(point), "kl": tf.get("kl_mean"), "ppl_dense": tf.get("ppl_dense"),
        "ppl_sparse": tf.get("ppl_sparse"), "next_token_kl": fid.get("next_token_kl"), "tokens": tf.get("tokens"),
        "dense_correct": ret.get("dense_correct"), "sparse_correct": ret.get("sparse_correct"), "retrieval_n": ret.get("n"),
        "retrieval_verdict": ret.get("verdict"), "keys_checked": checked, "keys_held_dense": held,
        "keys_lost": keys.get("keys_lost"), "key_worst_ratio": keys.get("key_worst_ratio"),
    }


def pareto(cfg: ParetoConfig, progress: Progress | None = None, *, checked=None) -> dict:
    """Run the comparison (module docstring). checked: what ``preflight(cfg)`` returned when the caller ran
    it already. Returns the report: settings, rows, verdicts, and the files written."""
    from ..fidelity import held_out_reference
    from ..models import load_model
    from ..workdir import WorkDir
    from .dominance import searched_frontier, summary, verdicts

    progress = progress or Progress()
    info, artifacts = checked or preflight(cfg)
    progress.stage("loading model")
    model, tokenizer, info = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    started = time.perf_counter()
    progress.stage(f"dense reference on {cfg.samples} held-out window(s) of {cfg.tokens} tokens")
    reference = held_out_reference(model, tokenizer, data=cfg.data, samples=cfg.samples, tokens=cfg.tokens, seed=cfg.seed)
    order = None
    if "duo" in cfg.baselines:
        progress.stage("ranking heads by streaming error (duo baseline)")
        order = stream_order(model, tokenizer, info, cfg)
    if cfg.keys:
        progress.stage(f"passkey keys: dense on held-out prompts of {cfg.tokens} tokens until it holds {cfg.keys}")
    keys, keys_record = dense_side(model, tokenizer, cfg)
    checked, held = (0, 0) if keys is None else (len(keys.samples), len(keys.held))
    points = [artifact_point(p, a) for p, a in artifacts]
    points += baseline_points(info, cfg.tokens, cfg.baselines, cfg.budgets, triangle_probed=probed_start(cfg, artifacts), stream_order=order)
    progress.stage(f"attention cost of {len(points)} points")
    costs, layers = measure_costs(model, info, points, reference)
    work = None if cfg.out is None else WorkDir.open(cfg.out, "pareto", _settings(cfg, info), resume=cfg.resume)
    rows = []
    for i, (point, cost) in enumerate(zip(points, costs)):
        progress.point(i, len(points), point.label)
        fid = quality(model, tokenizer, point, reference, work, _point_key(point))
        read = key_reading(model, point, keys, work, f"{_point_key(point)}-keys{cfg.keys}")
        rows.append(point_row(point, cost, fid, read, checked=checked, held=held))
    report = {
        "model": info.id, "data": cfg.data, "samples": cfg.samples, "tokens": cfg.tokens, "seed": cfg.seed,
        "device": str(next(model.parameters()).device), "cost_model": costs[0]["cost_model"] if costs else None,
        "seconds": round(time.perf_counter() - started, 1), "keys": keys_record, "rows": rows, "verdicts": verdicts(rows),
        "searched_frontier": searched_frontier(rows),
    }
    report["summary"] = summary(report["verdicts"], rows)
    if cfg.out is not None:
        progress.stage("writing report")
        report["files"] = write_report(cfg.out, report, info, layers)
        work.remove()
    return report


def write_report(out: Path, report: dict, info, layers: list[dict] | None = None) -> dict:
    """pareto.parquet (rows), pareto_layers.parquet (each point's cost per layer), pareto.json (the report),
    pareto.png (KL vs cost), each whole or not at all."""
    import pandas as pd

    from ..files import atomic_path, write_json_atomic

    out.mkdir(parents=True, exist_ok=True)
    files = {"rows": str(out / "pareto.parquet"), "report": str(out / "pareto.json")}
    with atomic_path(out / "pareto.parquet") as tmp:
        pd.DataFrame(report["rows"]).to_parquet(tmp, index=False)
    if layers:
        files["layers"] = str(out / "pareto_layers.parquet")
        with atomic_path(out / "pareto_layers.parquet") as tmp:
            pd.DataFrame(layers).to_parquet(tmp, index=False)
    try:
        from ..report.pareto_plot import draw_pareto

        files["plot"] = str(draw_pareto(report, info, out / "pareto.png"))
    except ImportError:  # matplotlib missing: the numbers stand without their picture
        pass
    write_json_atomic(out / "pareto.json", {**report, "files": files}, indent=1, sort_keys=True)
    return files
