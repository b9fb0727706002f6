"""Does the searched family beat each one-size baseline? The verdict rule of issue P11 §2.

The searched family's curve is the lower-left frontier of its points (every given artifact) plus the dense
anchor (cost 1, KL 0: the model's own attention, the reference every point is measured against), joined
by straight lines. A baseline point (cost c, KL k) is beaten
when, at the same cost, the searched curve's KL is at most KL_RATIO x k, or when, at the same KL, its cost
is at most COST_RATIO x c. Two verdicts make no claim either way:
- "out of range": cheaper than every searched point (no searched artifact was made that cheap);
- "dearer than dense": cost >= 1. The model's own attention beats it, so it says nothing about the search
  (before this verdict such points counted as beaten: the vertical-slash and top-k points of SmolLM2 at 8K,
  1.07-1.57 of dense there, and on Gemma 3 270M at 8K 12 of 19 points, whose head_dim 256 our kernels run
  at about half SDPA's rate).
"""

from __future__ import annotations

KL_RATIO = 0.7  # searched KL <= 0.7 x the baseline's at equal cost ...
COST_RATIO = 0.8  # ... or searched cost <= 0.8 x the baseline's at equal KL


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (cost, KL) points no other point beats on both, sorted by cost (KL then falls)."""
    out: list[tuple[float, float]] = []
    for cost, kl in sorted(points):
        if not out or kl < out[-1][1]:
            out.append((cost, kl))
    return out


def kl_at(curve: list[tuple[float, float]], cost: float) -> float | None:
    """The frontier's KL at ``cost`` (linear between its points), None below its cheapest point."""
    if not curve or cost < curve[0][0]:
        return None
    for (c0, k0), (c1, k1) in zip(curve, curve[1:]):
        if c0 <= cost <= c1:
            return k0 if c1 == c0 else k0 + (k1 - k0) * (cost - c0) / (c1 - c0)
    return curve[-1][1]


def cost_at(curve: list[tuple[float, float]], kl: float) -> float | None:
    """The frontier's cost where its KL first reaches ``kl`` (linear between its points), None when the
    curve's cheapest point is already below it (the cost there is not known to be that low)."""
    if not curve or curve[0][1] <= kl:
        return None
    for (c0, k0), (c1, k1) in zip(curve, curve[1:]):
        if k1 <= kl <= k0:
            return c0 if k0 == k1 else c0 + (c1 - c0) * (k0 - kl) / (k0 - k1)
    return None


def searched_frontier(rows: list[dict]) -> list[list[float]]:
    """[cost, KL] of the searched points' frontier (without the dense anchor): the line a plot draws."""
    return [[c, k] for c, k in frontier([(r["cost_fraction"], r["kl"]) for r in rows if r["searched"] and r["kl"] is not None])]


def verdicts(rows: list[dict]) -> list[dict]:
    """Per baseline row (dense excluded): the searched curve's KL at its cost and cost at its KL, the two
    ratios and the verdict ("beaten", "not beaten", "out of range", "dearer than dense", or "no searched
    points")."""
    searched = [(r["cost_fraction"], r["kl"]) for r in rows if r["searched"] and r["kl"] is not None]
    curve = frontier(searched + [(1.0, 0.0)]) if searched else []
    out = []
    for r in rows:
        if r["searched"] or r["family"] == "dense" or r["kl"] is None:
            continue
        at_cost, at_kl = kl_at(curve, r["cost_fraction"]), cost_at(curve, r["kl"])
        kl_ratio = None if at_cost is None or r["kl"] <= 0 else at_cost / r["kl"]
        cost_ratio = None if at_kl is None else at_kl / r["cost_fraction"]
        if not searched:
            verdict = "no searched points"
        elif r["cost_fraction"] >= 1.0:
            verdict = "dearer than dense"
        elif at_cost is None:
            verdict = "out of range"
        elif (kl_ratio is not None and kl_ratio <= KL_RATIO) or (cost_ratio is not None and cost_ratio <= COST_RATIO):
            verdict = "beaten"
        else:
            verdict = "not beaten"
        out.append({"family": r["family"], "label": r["label"], "cost_fraction": r["cost_fraction"], "kl": r["kl"],
                    "searched_kl_at_cost": _round(at_cost), "kl_ratio": _round(kl_ratio),
                    "searched_cost_at_kl": _round(at_kl), "cost_ratio": _round(cost_ratio), "verdict": verdict})
    return out


def summary(verdicts_: list[dict]) -> str:
    """One line for a report's title and screen: points beaten of those judged, and the cheaper points no searched
    artifact reaches (left of the searched range, so neither beaten nor not: a gap to close with a looser target)."""
    count = lambda *kinds: sum(v["verdict"] in kinds for v in verdicts_)
    if count("no searched points"):
        return "no searched artifact given: baselines only, nothing judged"
    line = f"searched beats {count('beaten')}/{count('beaten', 'not beaten')} judged baseline points"
    below = count("out of range")
    return line + (f"; {below} cheaper than every searched point" if below else "")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
