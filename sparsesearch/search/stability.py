"""Heads that change their mind: how stable each head's pick is across calibration samples (P11 §4).

With several calibration samples the search averages each candidate's scores over them and picks per head on
the mean (``layer.mean_scored`` + ``layer.head_rows``). A mean can hide a head whose best pattern differs from
sample to sample — A-shape on one prompt, vertical-slash on the next — and whose pick then fits neither well.
Here, per head:

- ``picks``: the pattern each sample alone would pick (``head_rows`` on that sample's scores and budget);
- ``errors``: the output error of the mean pick's candidate in each sample, and their spread (max - min);
- ``stable``: every sample picks the same kind of pattern.

An unstable head takes the safer choice: the admissible candidate with the lowest *worst-case* error over the
samples (``worst_scored``: error max, recall min, cost and density averaged), not the best mean. Its row says
so in ``reason``, and the manifest lists it (``methods.mminference.stability``) for ``inspect``.
"""

from __future__ import annotations

import math

import torch

from .layer import Scored, head_rows

RULE = ("a head is unstable when the samples alone pick different kinds of pattern; it then takes the admissible "
        "candidate with the lowest worst-case output error over the samples")


def worst_scored(per_sample: list[list[Scored]]) -> list[Scored]:
    """Candidate by candidate (same space, same order): the largest error and the smallest recall over the
    samples, the mean cost and density (what a head would pay on average)."""
    out = []
    for parts in zip(*per_sample):
        first = parts[0]
        stack = lambda name: torch.stack([getattr(p, name) for p in parts])  # noqa: E731
        out.append(Scored(first.candidate, first.params, stack("error").amax(0), stack("recall").amin(0),
                          stack("density").mean(0), stack("cost_ms").mean(0)))
    return out


def head_stability(per_sample: list[list[Scored]], budgets: list[torch.Tensor], objective: str,
                   chosen: list[dict]) -> list[dict]:
    """Per head of ``chosen`` (the rows picked on the mean scores): {head, picks, errors, spread, stable}.

    per_sample: each sample's scored list; budgets: each sample's budget [H] (ms)."""
    alone = [head_rows(sc, b, objective) for sc, b in zip(per_sample, budgets)]
    keys = [s.candidate.key for s in per_sample[0]]
    out = []
    for row in chosen:
        h = row["head"]
        index = _candidate_index(per_sample[0], h, row)
        errors = [float(sc[index].error[h]) for sc in per_sample] if index is not None else []
        picks = [rows[h]["pattern"] for rows in alone]
        finite = [e for e in errors if math.isfinite(e)]
        # A sample whose budget pruned the candidate left it unrun (error inf): null, as JSON has no inf.
        out.append({"head": h, "picks": picks, "errors": [round(e, 6) if math.isfinite(e) else None for e in errors],
                    "spread": round(max(finite) - min(finite), 6) if finite else None, "stable": len(set(picks)) == 1,
                    "candidate": keys[index] if index is not None else None})
    return out


def _candidate_index(scored: list[Scored], h: int, row: dict) -> int | None:
    """Which entry of ``scored`` a chosen row came from: same pattern, same params for head h."""
    return next((i for i, s in enumerate(scored) if s.candidate.pattern == row["pattern"] and s.params[h] == row["params"]), None)


def safer_rows(chosen: list[dict], per_sample: list[list[Scored]], budget: torch.Tensor, objective: str,
               stability: list[dict]) -> list[dict]:
    """``chosen`` with each unstable head's row replaced by its worst-case pick (``worst_scored``) when that
    differs, its ``reason`` saying why; stable heads keep their rows."""
    worst = head_rows(worst_scored(per_sample), budget, objective)
    out = []
    for row, stab in zip(chosen, stability):
        if stab["stable"] or worst[row["head"]]["pattern"] == row["pattern"] and worst[row["head"]]["params"] == row["params"]:
            out.append(row)
            continue
        picks = "/".join(stab["picks"])
        out.append({**worst[row["head"]], "reason": f"unstable across samples (alone they pick {picks}): the lowest worst-case error"})
    return out


def record(layer_stability: dict[int, list[dict]], samples: int) -> dict:
    """The manifest's account: how many heads were checked and which were unstable, with their picks and errors."""
    heads = [{"layer": layer, **s} for layer, rows in sorted(layer_stability.items()) for s in rows]
    spreads = [s["spread"] for s in heads if s["spread"] is not None]
    return {
        "samples": samples, "rule": RULE, "heads": len(heads), "unstable_count": sum(not s["stable"] for s in heads),
        "max_error_spread": max(spreads) if spreads else None,
        "unstable": [s for s in heads if not s["stable"]],
    }
