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

Retrieval (issue P11 §1-2: sparse passkey accuracy equal to dense's). Average KL cannot see a lost needle, and
the searched artifacts were held to their keys by calibration's retrieval guard while the baselines were not,
so the KL rule alone can call a baseline "not beaten" that loses the key. A judged baseline point ("beaten" or
"not beaten" by the KL rule) becomes "loses keys" when
- the key check ran (its ``keys_lost`` is a number: --keys > 0 and dense holds at least one key), and it loses
  at least one key dense holds, and
- every searched point on the curve it is judged against (the frontier with the dense anchor) had its keys read
  and lost none: a searched curve that itself loses a key makes no retrieval claim over anyone.
The KL verdict stays in ``kl_verdict`` and the ratios are reported as before. "out of range", "dearer than
dense" and "no searched points" stand whatever the keys: no searched point is there to hold them at that cost
(or dense, cheaper, holds them itself).
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


def curve_rows(rows: list[dict]) -> list[dict]:
    """The searched rows on the curve baselines are judged against: the frontier of the searched points with the
    dense anchor (a searched point the anchor or another searched point dominates is not on it)."""
    searched = [r for r in rows if r["searched"] and r["kl"] is not None]
    on_curve = set(frontier([(r["cost_fraction"], r["kl"]) for r in searched] + [(1.0, 0.0)]))
    return [r for r in searched if (r["cost_fraction"], r["kl"]) in on_curve]


def curve_holds_keys(rows: list[dict]) -> bool:
    """Whether every searched point on the curve had its keys read and lost none (module docstring); False
    when the check did not run (keys_lost None) or there is no searched point."""
    mine = curve_rows(rows)
    return bool(mine) and all(r.get("keys_lost") == 0 for r in mine)


def kl_verdict(searched: bool, cost: float, at_cost: float | None, kl_ratio: float | None, cost_ratio: float | None) -> str:
    """The KL rule's verdict for a baseline at ``cost`` (module docstring); searched: whether any searched point
    was measured."""
    if not searched:
        return "no searched points"
    if cost >= 1.0:
        return "dearer than dense"
    if at_cost is None:
        return "out of range"
    if (kl_ratio is not None and kl_ratio <= KL_RATIO) or (cost_ratio is not None and cost_ratio <= COST_RATIO):
        return "beaten"
    return "not beaten"


def verdicts(rows: list[dict]) -> list[dict]:
    """Per baseline row (dense excluded): the searched curve's KL at its cost and cost at its KL, the two
    ratios, the KL rule's verdict (``kl_verdict``: "beaten", "not beaten", "out of range", "dearer than dense",
    or "no searched points"), the keys it loses (``keys_lost``, None when not checked) and the verdict: the KL
    one, or "loses keys" (module docstring)."""
    searched = [(r["cost_fraction"], r["kl"]) for r in rows if r["searched"] and r["kl"] is not None]
    curve = frontier(searched + [(1.0, 0.0)]) if searched else []
    curve_holds = curve_holds_keys(rows)
    out = []
    for r in rows:
        if r["searched"] or r["family"] == "dense" or r["kl"] is None:
            continue
        at_cost, at_kl = kl_at(curve, r["cost_fraction"]), cost_at(curve, r["kl"])
        kl_ratio = None if at_cost is None or r["kl"] <= 0 else at_cost / r["kl"]
        cost_ratio = None if at_kl is None else at_kl / r["cost_fraction"]
        by_kl = kl_verdict(bool(searched), r["cost_fraction"], at_cost, kl_ratio, cost_ratio)
        lost = r.get("keys_lost")
        loses = curve_holds and by_kl in ("beaten", "not beaten") and lost is not None and lost > 0
        out.append({"family": r["family"], "label": r["label"], "cost_fraction": r["cost_fraction"], "kl": r["kl"],
                    "searched_kl_at_cost": _round(at_cost), "kl_ratio": _round(kl_ratio),
                    "searched_cost_at_kl": _round(at_kl), "cost_ratio": _round(cost_ratio), "keys_lost": lost,
                    "kl_verdict": by_kl, "verdict": "loses keys" if loses else by_kl})
    return out


def summary(verdicts_: list[dict], rows: list[dict] | None = None) -> str:
    """One line for a report's title and screen: points beaten of those judged by KL; the judged points that lose
    a passkey key dense holds while the searched curve holds them all (counted apart: the KL rule did not decide
    them); the cheaper points no searched artifact reaches (left of the searched range, so neither beaten nor
    not: a gap to close with a looser target); and, given the rows, the searched curve's own lost keys (then no
    baseline is marked for losing them)."""
    count = lambda *kinds: sum(v["verdict"] in kinds for v in verdicts_)
    if count("no searched points"):
        return "no searched artifact given: baselines only, nothing judged"
    line = f"searched beats {count('beaten')}/{count('beaten', 'not beaten')} judged baseline points"
    lose, below = count("loses keys"), count("out of range")
    line += f"; {lose} more {_lose(lose)} passkey keys dense holds" if lose else ""
    line += f"; {below} cheaper than every searched point" if below else ""
    own = sum((r.get("keys_lost") or 0) > 0 for r in curve_rows(rows or []))
    return line + (f"; {own} searched point{'s' * (own > 1)} on the curve {_lose(own)} passkey keys dense holds" if own else "")


def _lose(n: int) -> str:
    return "loses" if n == 1 else "lose"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
