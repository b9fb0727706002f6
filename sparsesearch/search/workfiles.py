"""The layer search's partial state: one JSON file per (sample, layer, region) of scores, one per
(sample, layer) of the boundary choice, in calibrate's work directory ``OUT.partial/``.

A killed calibrate resumes from whole files only (every write is atomic), and a layer counts as done when
its last file is there: the global scope's for text, the boundary file (written after all of the layer's
region files) for multi-modal data. The target allocation (search/allocate.py) reads the global scores
back from here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..artifacts.columns import ALL_MODALITIES
from ..files import write_json_atomic
from ..patterns import PARAMS
from ..patterns.boundary import scope_name, split_scope
from .layer import Scored, Timings
from .space import Candidate

GLOBAL = scope_name(ALL_MODALITIES, ALL_MODALITIES)  # every row x every key: the "none" boundary's region


def scores_to_json(scored: list[Scored], budget: torch.Tensor, timings: Timings, dense_cost: torch.Tensor | None = None,
                   mix_cost: float = 0.0, split_cost: float = 0.0) -> dict:
    return {
        **({} if dense_cost is None else {"dense_cost_ms": dense_cost.tolist()}),
        **({"mix_cost_ms": mix_cost} if mix_cost > 0 else {}),
        **({"split_cost_ms": split_cost} if split_cost > 0 else {}),
        "budget_ms": budget.tolist(),
        "timings": dataclasses.asdict(timings),
        "candidates": [
            {
                "pattern": s.candidate.pattern, "params": s.candidate.params,
                "modalities": list(s.candidate.modalities) if s.candidate.modalities else None,
                **({} if s.candidate.scaled else {"scaled": False}),
                "head_params": [dataclasses.asdict(p) if p is not None else None for p in s.params],
                "head_patterns": [type(p).__module__.rsplit(".", 1)[-1] if p is not None else None for p in s.params],
                "error": s.error.tolist(), "recall": s.recall.tolist(), "density": s.density.tolist(), "cost_ms": s.cost_ms.tolist(),
            }
            for s in scored
        ],
    }


def scores_from_json(data: dict) -> tuple[list[Scored], torch.Tensor, Timings]:
    scored = []
    for c in data["candidates"]:
        cand = Candidate(c["pattern"], c["params"], tuple(c["modalities"]) if c["modalities"] else None, c.get("scaled", True))
        params = [PARAMS[pat](**p) if p is not None else None for pat, p in zip(c["head_patterns"], c["head_params"])]
        t = lambda name: torch.tensor(c[name], dtype=torch.float64)
        scored.append(Scored(cand, params, t("error"), t("recall"), t("density"), t("cost_ms")))
    return scored, torch.tensor(data["budget_ms"], dtype=torch.float64), Timings(**data["timings"])


def write_state(path: Path, payload: dict) -> None:
    """A partial-state file, sorted keys, whole or not at all: a killed run resumes from whole files only."""
    write_json_atomic(path, payload, sort_keys=True)


def scope_path(work: Path, si: int, layer: int, scope: str) -> Path:
    q_mod, k_mod = split_scope(scope)
    return work / f"s{si}_l{layer}_{q_mod}-{k_mod}.json"


def scope_files(work: Path, si: int, layer: int) -> dict[str, Path]:
    """The region files (sample si, layer) has on disk, by scope: the inverse of ``scope_path``."""
    found = {}
    for path in sorted(work.glob(f"s{si}_l{layer}_*-*.json")):
        q_mod, k_mod = path.stem.split("_", 2)[2].split("-")
        found[scope_name(q_mod, k_mod)] = path
    return found


def boundary_path(work: Path, si: int, layer: int) -> Path:
    return work / f"s{si}_l{layer}.boundary.json"


def layer_done(work: Path, si: int, layer: int, modal: bool) -> bool:
    """A text layer is done with its global scope file; a multi-modal one with its boundary file (written
    after all of the layer's region files)."""
    return (boundary_path(work, si, layer) if modal else scope_path(work, si, layer, GLOBAL)).is_file()
