"""The quality target's allocation stage of calibrate: the searched layers' per-head (cost, error) curves
read back from the work directory (search/workfiles.py), one choice per head across layers for the target
(search/targets.py: the output-error cap, the latency budget, or --target-kl's KL model and bisection, then
its retrieval guard), as heads rows plus the manifest's target record.

The model runs stay with the caller: ``kl_of(rows)`` and the guard's ``misses_of(rows)`` measure an
allocation's rows through the runtime (sparsesearch/tuning.py), so this stage is plain data in and out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..patterns.dense import DenseParams
from .frontier import frontier_kl_path
from .layer import Scored, artifact_row, mean_scored
from .targets import (
    DENSE, Allocation, HeadCurve, budget_allocation, cap_allocation, dense_layers, hold_guard, kl_sensitivity,
    lagrangian_path, only_layer, probe_allocation, protect_layers, search_target,
)
from .workfiles import GLOBAL, scope_path, scores_from_json


@dataclass(frozen=True)
class TargetRequest:
    """What calibrate asks of the allocation: the target (kind in targets.KINDS, value), whether a miss is
    written (marked) rather than refused, where the target came from ("given" or "default"), the calibration
    data named in the record, and --target-kl's account of its tuning prompts (tuning.tuning_record)."""

    kind: str
    value: float
    allow_miss: bool = False
    source: str = "given"
    data: str = ""
    kl_prompts: dict | None = None


KL_RESOLUTION = 0.005  # the KL bisection stops when its bracket spans <= 0.5% of dense cost
PROBE_COST = 0.3  # --target-kl: layer KL sensitivities are measured at the error path's point nearest 30% of dense cost
CURVE_POINTS = 48  # budget-curve points kept in the manifest (every measured one, the rest thinned evenly)


def layer_curves(work: Path, layer: int, n_samples: int) -> tuple[list[Scored], list[HeadCurve]]:
    """A searched layer's global scores averaged over the samples, and per head its (cost, error) curve with
    the dense point (search/targets.py)."""
    data = [json.loads(p.read_text()) for si in range(n_samples) if (p := scope_path(work, si, layer, GLOBAL)).is_file()]
    if any("dense_cost_ms" not in d for d in data):
        raise ValueError(f"layer {layer}: the saved scores predate quality targets (no dense cost); drop --resume to search again")
    scored = mean_scored([scores_from_json(d)[0] for d in data])
    dense = torch.tensor([d["dense_cost_ms"] for d in data], dtype=torch.float64).mean(0)
    # a layer's mixing and launch prices (search/targets.py); searches kept from before they were measured have none: 0
    mix, split = (sum(float(d.get(name, 0.0)) for d in data) / max(1, len(data)) for name in ("mix_cost_ms", "split_cost_ms"))
    curves = [HeadCurve(layer, h, tuple(float(s.cost_ms[h]) for s in scored), tuple(float(s.error[h]) for s in scored),
                        float(dense[h]), tuple(s.candidate.key for s in scored), mix, split) for h in range(dense.numel())]
    return scored, curves


def allocation_rows(alloc: Allocation, curves: list[HeadCurve], scored: dict[int, list[Scored]], space) -> list[dict]:
    """heads rows of an allocation: each head's chosen candidate, or a dense row (density 1, error 0)."""
    rows = []
    for c, i in zip(curves, alloc.choices):
        if i == DENSE:
            r = {"head": c.head, "pattern": "dense", "params": DenseParams(), "density": 1.0, "recall": 1.0,
                 "output_error": 0.0, "latency_ms": c.dense_cost, "score": 0.0, "reason": alloc.reasons.get((c.layer, c.head))}
        else:
            s, h = scored[c.layer][i], c.head
            r = {"head": h, "pattern": s.candidate.pattern, "params": s.params[h], "density": float(s.density[h]),
                 "recall": float(s.recall[h]), "output_error": float(s.error[h]), "latency_ms": float(s.cost_ms[h]), "score": float(s.error[h])}
        rows.append(artifact_row(c.layer, GLOBAL, r, space))
    return rows


def curve_point(alloc: Allocation, curves: list[HeadCurve], rows: list[dict]) -> dict:
    """One budget-curve point: multiplier, total cost over dense, mean density and output error of the searched heads."""
    lam = None if alloc.lam is None or not math.isfinite(alloc.lam) else round(alloc.lam, 9)
    return {"lam": lam, "cost_fraction": round(alloc.cost_fraction(curves), 6), "sparse_heads": sum(i != DENSE for i in alloc.choices),
            "mean_density": round(sum(r["density"] for r in rows) / len(rows), 6),
            "mean_output_error": round(sum(r["output_error"] for r in rows) / len(rows), 6)}


def kl_model(curves: list[HeadCurve], path: list[Allocation], measure: Callable[[Allocation], float]) -> dict:
    """The per-layer KL model of a --target-kl search (search/targets.py): at ``probe_allocation`` (the error
    path's point nearest PROBE_COST of dense cost), the KL with one layer at a time sparse, and per layer
    a_l = KL_l / sum_h error_h^2. Returns {"sensitivity": {layer: a_l}, "record": the manifest's account}."""
    probe = probe_allocation(curves, path, PROBE_COST)
    layers = sorted({c.layer for c, i in zip(curves, probe.choices) if i != DENSE})
    layer_kl = {layer: measure(only_layer(probe, curves, layer)) for layer in layers}
    sensitivity = kl_sensitivity(curves, probe, layer_kl)
    sq = lambda layer: sum(c.error_of(i) ** 2 for c, i in zip(curves, probe.choices) if c.layer == layer)
    record = {
        "model": "KL ~= sum over layers of a_layer x sum over heads of output_error^2 (a_layer measured with only that layer sparse)",
        "probe": {"cost_fraction": round(probe.cost_fraction(curves), 6), "near": PROBE_COST},
        "sum_of_layer_kl": round(sum(layer_kl.values()), 9),
        "layers": [{"layer": layer, "kl": round(layer_kl[layer], 9) if layer in layer_kl else None,
                    "sum_sq_error": round(sq(layer), 6), "sensitivity": round(a, 9)} for layer, a in sorted(sensitivity.items())],
    }
    return {"sensitivity": sensitivity, "record": record}


def allocate_target(req: TargetRequest, work: Path, n_samples: int, layers: list[int], space,
                    kl_of: Callable[[list[dict]], float], guard: tuple[Callable[[list[dict]], int] | None, dict] | None = None,
                    ) -> tuple[list[dict], dict]:
    """The quality target's allocation over the searched layers (search/targets.py) -> (global rows, the
    manifest's target record without the held-out part). kl_of(rows) measures the model KL of the searched
    layers' rows on the tuning prompts (target_kl only); guard (target_kl only, tuning.retrieval_guard):
    (misses_of(rows) or None, its record), which moves the KL's choice up the path until no guard answer is
    lost. Raises ValueError for an unreachable target unless req.allow_miss."""
    kind, value = req.kind, req.value
    scored, curves, model = {}, [], None
    for layer in layers:
        scored[layer], head_curves = layer_curves(work, layer, n_samples)
        curves.extend(head_curves)
    rows_of = lambda a: allocation_rows(a, curves, scored, space)
    path = lagrangian_path(curves)
    measured: dict[int, float] = {}
    miss, guard_record = None, None
    if kind == "max_output_error":
        alloc = cap_allocation(curves, value)
        if all(i == DENSE for i in alloc.choices):
            smallest = min((e for c in curves for e in c.error), default=math.inf)
            miss = f"--max-output-error {value:g} cannot be met by any sparse candidate: every head would be dense (smallest error searched {smallest:.3g})"
    elif kind == "latency_budget":
        alloc = budget_allocation(curves, value)
        if alloc is None:
            alloc = path[0]
            miss = f"--latency-budget {value:g} cannot be met: the cheapest allocation costs {path[0].cost_fraction(curves):.3g} of dense"
    else:
        model = kl_model(curves, path, lambda a: kl_of(rows_of(a)))
        path, predicted = frontier_kl_path(curves, model["sensitivity"])
        # what a sweep's earlier targets measured on this path (tuning_kl's memo) is not run again
        known = getattr(kl_of, "known", None)
        found = search_target(path, lambda a: kl_of(rows_of(a)), value, [a.cost_fraction(curves) for a in path], KL_RESOLUTION, predicted,
                              known=None if known is None else [known(rows_of(a)) for a in path])
        measured = found.measured
        alloc = path[found.best if found.chosen is None else found.chosen]
        if found.chosen is None:
            miss = (f"--target-kl {value:g} cannot be met on the calibration data: the densest sparse allocation "
                    f"({curve_point(path[-2], curves, rows_of(path[-2]))['sparse_heads']} of {len(curves)} heads sparse) measured KL "
                    f"{measured[len(path) - 2]:.3g}; only all-dense meets it")
        elif guard is not None:
            alloc, guard_record, guard_miss = hold_retrieval(path, found.chosen, guard, rows_of, curves)
            check_of = guard[0]
            if check_of is not None and (guard_miss or alloc is not path[found.chosen]):
                # the KL's choice loses a key: keeping the layers that lose it dense may hold the guard cheaper
                # than moving up the path (SmolLM2 8K, RESULTS Run 38: the move went from 0.13-0.55 to 0.67 of dense)
                check = lambda a: check_of(rows_of(a))
                prot = protect_retrieval(curves, model["sensitivity"], path[found.chosen], check, lambda a: kl_of(rows_of(a)), value)
                guard_record["protect"] = prot.record
                if prot.chosen is not None and (guard_miss or prot.path[prot.chosen].cost(curves) < alloc.cost(curves)):
                    path, predicted, measured = prot.path, prot.predicted, prot.measured
                    alloc, guard_miss = path[prot.chosen], None
                    guard_record = {**guard_record, "held": True, "by": "protect", "cost": prot.record["cost"]}
            miss = miss or guard_miss
            if path.index(alloc) not in measured:  # moved up by the guard: its own KL, so the record's achieved is measured
                measured[path.index(alloc)] = float(kl_of(rows_of(alloc)))
    if miss and not req.allow_miss:
        raise ValueError(f"{miss} (pass --allow-miss to write the best reachable artifact)")
    rows = rows_of(alloc)
    point = curve_point(alloc, curves, rows)
    achieved = {"target_kl": measured.get(path.index(alloc)) if kind == "target_kl" else None,
                "max_output_error": max(r["output_error"] for r in rows), "latency_budget": point["cost_fraction"]}[kind]
    keep = sorted(set(measured) | set(range(0, len(path), max(1, len(path) // CURVE_POINTS))) | {len(path) - 1})
    curve = [{**curve_point(path[i], curves, rows_of(path[i])), **({"predicted_kl": round(predicted[i], 9)} if kind == "target_kl" else {}),
              **({"kl": round(measured[i], 9)} if i in measured else {})} for i in keep]
    record = {
        "kind": kind, "value": value, "met": miss is None,
        # given by the user, or the command line's default (--space-budget searches the space's budget instead)
        "source": req.source, "allow_miss": req.allow_miss, "missed": miss,
        "allocation": {"max_output_error": "per-head cap", "latency_budget": "lagrangian path (cost + lam x dense cost x error per head)",
                       "target_kl": "exact frontier of a measured KL model (cost vs sum of a_layer x error^2 per head, mixing and each launch past a layer's first priced; "
                                    "the Lagrangian path's points and those between them)"}[kind],
        **({"kl_model": model["record"]} if model else {}),
        **({"retrieval_guard": guard_record} if guard_record is not None else {}),
        "calibration": {"data": req.data, "achieved": achieved, **point,
                        "kl_prompts": req.kl_prompts if kind == "target_kl" else None},
        "curve": curve, "path_points": len(path),
        "dense_heads": [{"layer": l, "head": h, "reason": alloc.reasons[(l, h)]} for l, h in alloc.dense_heads(curves)],
    }
    return rows, record


def hold_retrieval(path, chosen: int, guard, rows_of, curves) -> tuple[Allocation, dict, str | None]:
    """The KL target's choice path[chosen] moved up the path to the cheapest point that loses no guard key
    (search/targets.hold_guard) -> (allocation, the manifest's guard record, a miss line or None)."""
    check_of, record = guard
    if check_of is None:  # dense retrieves none of the guard keys: the KL's choice stands, said so
        return path[chosen], record, None
    held, measured = hold_guard(path, chosen, lambda a: check_of(rows_of(a)).misses)
    at = lambda i: round(path[i].cost_fraction(curves), 6)
    record = {**record, "held": held is not None, "kl_choice_cost": at(chosen),
              "measured": [{"cost_fraction": at(i), "misses": m} for i, m in sorted(measured.items())]}
    if held is None:
        top = len(path) - 2
        return path[chosen], record, (f"the retrieval guard cannot be held: the densest sparse allocation loses {measured[top]} of "
                                      f"{record['dense_retrieves']} passkey keys dense retrieves (--retrieval-guard 0 to turn it off)")
    return path[held], {**record, "cost": at(held)}, None


@dataclass
class Protected:
    """The guard's other way to hold a KL choice that loses a key (search/targets.protect_layers): its layers
    ``layers`` kept dense and the KL target searched again over the rest. path/predicted/measured: that search's
    path, predicted KL and measured KL by index; chosen: the path index the guard holds at; record: the manifest's
    account (each layer's reading alone, the layers kept, the cost reached)."""

    path: list[Allocation]
    predicted: list[float]
    measured: dict[int, float]
    chosen: int | None
    record: dict


def protect_retrieval(curves: list[HeadCurve], sensitivity: dict[int, float], start: Allocation, check, kl_of, value: float) -> Protected:
    """Keep dense the fewest layers whose sparse heads lose a key at ``start`` (the KL target's choice), then meet
    the KL target over the remaining layers (their exact frontier, search_target on kl_of) and hold the guard along
    that path (hold_guard). check(alloc) -> KeyCheck, kl_of(alloc) -> measured KL."""
    layers, alone = protect_layers(curves, start, check)
    record = {"alone": [{"layer": layer, "misses": r.misses, "worst": round(r.worst, 4)} for layer, r in sorted(alone.items())],
              "layers": layers}
    if not layers:  # None: only every layer dense holds; []: nothing to protect (the KL choice holds)
        return Protected([], [], {}, None, record)
    keep = set(layers)
    why = lambda c: (f"kept dense for retrieval: with only layer {c.layer}'s heads sparse the model loses {alone[c.layer].misses} passkey "
                     f"key(s) dense retrieves (weakest digit at {alone[c.layer].worst:.2g} of its dense probability)")
    rest = [c for c in curves if c.layer not in keep]
    sub, predicted = frontier_kl_path(rest, sensitivity)
    at = {(c.layer, c.head): k for k, c in enumerate(curves)}

    def widen(a: Allocation) -> Allocation:  # a choice per head of ``rest`` -> one per head of ``curves``, kept layers dense
        choices = [DENSE] * len(curves)
        for c, i in zip(rest, a.choices):
            choices[at[(c.layer, c.head)]] = i
        return dense_layers(Allocation(choices, a.lam, a.reasons), curves, keep, why)

    path = [widen(a) for a in sub]
    if len(path) < 2:  # the other layers have no candidate cheaper than dense
        return Protected(path, predicted, {}, None, {**record, "held": False, "why": "no other layer has a sparse candidate"})
    found = search_target(path, kl_of, value, [a.cost_fraction(curves) for a in path], KL_RESOLUTION, predicted)
    measured = dict(found.measured)
    if found.chosen is None:
        return Protected(path, predicted, measured, None, {**record, "held": False, "why": "the KL target cannot be met with these layers dense"})
    held, checks = hold_guard(path, found.chosen, lambda a: check(a).misses)
    record = {**record, "held": held is not None, "kl_choice_cost": round(path[found.chosen].cost_fraction(curves), 6),
              "measured": [{"cost_fraction": round(path[i].cost_fraction(curves), 6), "misses": m} for i, m in sorted(checks.items())]}
    if held is not None:
        record["cost"] = round(path[held].cost_fraction(curves), 6)
    return Protected(path, predicted, measured, held, record)
