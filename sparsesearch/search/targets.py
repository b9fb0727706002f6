"""Quality-targeted budgets: one candidate per head across every layer, chosen for a model-level target.

The search (search/layer.py) leaves, per head, a curve of candidates with a cost (ms, measured on a GPU,
modelled on a CPU) and a relative output error; dense is one more point (its own cost, error 0). This
module picks one point per head:

- ``--max-output-error E`` (``cap_allocation``): each head takes its cheapest candidate with error <= E;
  a head with none stays dense.
- the Lagrangian path (``lagrangian_path``): for a multiplier lam every head minimises
  ``cost + lam * dense_cost * error`` independently (error weighted by the head's own dense cost, so lam
  is unitless and one lam trades equally in every layer: "pay up to lam of a dense head's cost to remove
  one unit of relative error"). Raising lam moves heads up their lower convex hulls one breakpoint at a
  time, so the path is a finite list of allocations from all-cheapest (lam = 0) to all-dense, total cost
  non-decreasing and total error non-increasing along it.
- ``--latency-budget F`` (``budget_allocation``): the dual — the last point of the path whose total cost
  is <= F x the all-dense cost (F a fraction of dense cost under the same cost model, so it means the same
  on a CPU's modelled costs and a GPU's measured ones).
- ``--target-kl X``: the sum of per-head errors orders allocations badly as a KL proxy (a unit of error
  costs very different KL in different layers), so the path is rebuilt on a measured KL model first:
  ``probe_allocation`` picks one moderate choice per head, the caller measures the model KL with one layer
  at a time sparse at it, ``kl_sensitivity`` fits per layer KL_l ~= a_l * sum_h error_h^2 (KL is second
  order in a small output perturbation) and ``kl_model_curves`` makes each head's "error" its predicted KL
  share a_l * error^2. The Lagrangian path of those curves runs in order of predicted KL; ``search_target``
  then measures KL along it (``predicted`` guides each step: the next point is where the predicted KL,
  rescaled by the last measured/predicted ratio, meets X; bisection when a guided step did not halve the
  bracket) and keeps
  the cheapest allocation measured to meet X. The all-dense end of the path is never a result: when only
  it meets X the target is unreachable and the caller says so.

Everything here is plain data (floats and lists): the caller converts the search's tensors once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

DENSE = -1  # the choice index of dense in an allocation
KINDS = ("target_kl", "max_output_error", "latency_budget")


@dataclass(frozen=True)
class HeadCurve:
    """One head's options: candidate i has cost[i] (ms) and error[i] (relative output error; inf when the
    search pruned it); dense costs dense_cost with error 0. names[i] labels candidate i in reports. mix_cost:
    what the head's layer pays once (ms) when its heads mix sparse and dense, the same on each of its heads.
    split_cost: what the layer pays (ms) for each sparse launch past its first. A candidate's cost[i] is its
    launch over every head of the layer divided among them, but heads on different candidates run as separate
    launches (runtime/plan.py: one group per pattern and parameter set), each with its own fixed price and a
    smaller grid: Gemma 3's layer 11 at 16K on three A-shape windows ran 0.96 ms where the shares said 0.75
    and SDPA takes 0.92 (RESULTS Run 39)."""

    layer: int
    head: int
    cost: tuple[float, ...]
    error: tuple[float, ...]
    dense_cost: float
    names: tuple[str, ...] = ()
    mix_cost: float = 0.0
    split_cost: float = 0.0

    def usable(self) -> list[int]:
        """Candidates worth a look: measured (finite error) and cheaper than dense (a sparse candidate that
        costs at least dense with a nonzero error is dominated by dense)."""
        return [i for i, (c, e) in enumerate(zip(self.cost, self.error)) if math.isfinite(e) and c < self.dense_cost]

    def cost_of(self, choice: int) -> float:
        return self.dense_cost if choice == DENSE else self.cost[choice]

    def error_of(self, choice: int) -> float:
        return 0.0 if choice == DENSE else self.error[choice]


@dataclass
class Allocation:
    """One choice per head (curve order): a candidate index or DENSE; lam: the multiplier that chose it
    (None for a cap allocation); reasons: why each dense head is dense, by (layer, head)."""

    choices: list[int]
    lam: float | None = None
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)

    def cost(self, curves: list[HeadCurve]) -> float:
        """The heads' costs plus what each layer pays beyond them (``layer_extras``: mix_cost, split_cost)."""
        return sum(c.cost_of(i) for c, i in zip(curves, self.choices)) + layer_extras(curves, self.choices)

    def cost_fraction(self, curves: list[HeadCurve]) -> float:
        """Total cost over the all-dense cost: float in (0, 1]."""
        return self.cost(curves) / max(1e-30, sum(c.dense_cost for c in curves))

    def dense_heads(self, curves: list[HeadCurve]) -> list[tuple[int, int]]:
        return [(c.layer, c.head) for c, i in zip(curves, self.choices) if i == DENSE]


def check_target(kind: str, value: float) -> None:
    """ValueError (the CLI's exit 2) for an unknown kind or a value outside its range."""
    if kind not in KINDS:
        raise ValueError(f"target kind must be one of {KINDS}, got {kind!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--{kind.replace('_', '-')} must be a positive number, got {value}")
    if kind == "latency_budget" and value >= 1:
        raise ValueError(f"--latency-budget is a fraction of the dense cost in (0, 1), got {value}")


def cap_allocation(curves: list[HeadCurve], max_error: float) -> Allocation:
    """Each head: its cheapest usable candidate with error <= max_error (ties: the earlier candidate);
    dense when there is none, with the reason."""
    choices, reasons = [], {}
    for c in curves:
        ok = [i for i in c.usable() if c.error[i] <= max_error]
        if ok:
            choices.append(min(ok, key=lambda i: (c.cost[i], i)))
            continue
        choices.append(DENSE)
        reasons[(c.layer, c.head)] = _dense_reason(c, f"no sparse candidate within output error {max_error:g}")
    return _unmix_dearer_layers(curves, Allocation(choices, None, reasons))


def _unmix_dearer_layers(curves: list[HeadCurve], alloc: Allocation) -> Allocation:
    """``alloc`` with every sparse layer that costs at least all-dense (its heads plus ``layer_extra``) made
    dense: cheaper and error-free, so better under any cap."""
    for ks in _by_layer(curves):
        layer, picks = [curves[k] for k in ks], [alloc.choices[k] for k in ks]
        extra = layer_extra(layer, picks)
        if extra <= 0:
            continue
        if sum(c.cost_of(i) for c, i in zip(layer, picks)) + extra >= sum(c.dense_cost for c in layer):
            for k in ks:
                if alloc.choices[k] != DENSE:
                    c = curves[k]
                    alloc.reasons[(c.layer, c.head)] = (f"its layer runs dense: its heads' launches cost the layer "
                                                        f"{extra:.3g} ms more than their shares, more than its sparse heads save")
                alloc.choices[k] = DENSE
    return alloc


def _dense_reason(c: HeadCurve, why: str) -> str:
    usable = c.usable()
    if not usable:
        return f"{why}: no sparse candidate was measured cheaper than dense"
    best = min(usable, key=lambda i: (c.error[i], c.cost[i]))
    name = c.names[best] if c.names else f"candidate {best}"
    return f"{why} (best: {name}, error {c.error[best]:.3g} at {c.cost[best] / c.dense_cost:.0%} of dense cost)"


def _pick(c: HeadCurve, lam: float) -> int:
    """argmin over dense + usable candidates of cost + lam * dense_cost * error; ties go to the cheaper
    option, then the earlier candidate (dense last), so lam = 0 picks the cheapest candidate."""
    best = _pick_sparse(c, lam)
    if best is None or (_objective(c, lam, best), c.cost[best]) > (c.dense_cost, c.dense_cost):  # dense: error 0
        return DENSE
    return best


def layer_extra(layer: list[HeadCurve], picks) -> float:
    """What one layer pays (ms) beyond its heads' prices under ``picks`` (one per head of ``layer``): mix_cost
    when its heads are part dense, part sparse, and split_cost per distinct sparse candidate past the first."""
    sparse = {i for i in picks if i != DENSE}
    mixed = bool(sparse) and DENSE in picks
    return (layer[0].mix_cost if mixed else 0.0) + layer[0].split_cost * max(0, len(sparse) - 1)


def layer_extras(curves: list[HeadCurve], choices: list[int]) -> float:
    """Sum of ``layer_extra`` over the layers of ``curves`` under ``choices``."""
    return sum(layer_extra([curves[k] for k in ks], [choices[k] for k in ks]) for ks in _by_layer(curves))


def _objective(c: HeadCurve, lam: float, i: int) -> float:
    return c.cost_of(i) + lam * c.dense_cost * c.error_of(i)


def _pick_sparse(c: HeadCurve, lam: float) -> int | None:
    """The best usable candidate at lam, dense excluded (None when there is none); ties as ``_pick``."""
    options = [(_objective(c, lam, i), c.cost[i], i) for i in c.usable()]
    return min(options)[2] if options else None


def _pick_layer(layer: list[HeadCurve], lam: float) -> list[int]:
    """One layer's picks at lam: each head's own (``_pick``) when the layer pays nothing beyond its heads for
    them (``layer_extra``); else the best, extra included, of those, every head dense, every head its own
    sparse pick, and per candidate every head on it or dense (one launch, no split). Exact when only mix_cost
    is priced (it is the same for every mixed assignment, so the heads' own picks are the best mixed one); with
    a split_cost the per-candidate options cover the one-launch layers, which the own picks split."""
    free = [_pick(c, lam) for c in layer]
    if layer_extra(layer, free) <= 0:
        return free
    total = lambda picks: sum(_objective(c, lam, i) for c, i in zip(layer, picks)) + layer_extra(layer, picks)
    # (rank, picks): on equal totals every head sparse wins, then the own picks, then one launch, dense last
    options = [(1, free), (math.inf, [DENSE] * len(layer))]
    sparse = [_pick_sparse(c, lam) for c in layer]
    if None not in sparse:
        options.append((0, sparse))
    if layer[0].split_cost > 0:  # a head without a usable i is dense in i's one-launch layer
        one = lambda c, i: min((i, DENSE), key=lambda j: _objective(c, lam, j)) if i in c.usable() else DENSE
        options += [(2 + i, [one(c, i) for c in layer]) for i in sorted(set().union(*(c.usable() for c in layer)))]
    return min(options, key=lambda o: (total(o[1]), o[0]))[1]


def _by_layer(curves: list[HeadCurve]) -> list[list[int]]:
    """The curve indices of each layer's heads, layer by layer in order of first appearance."""
    layers: dict[int, list[int]] = {}
    for k, c in enumerate(curves):
        layers.setdefault(c.layer, []).append(k)
    return list(layers.values())


def _picks(curves: list[HeadCurve], lam: float) -> list[int]:
    """Every head's pick at lam, layer by layer (``_pick_layer``), in curve order."""
    picks = [DENSE] * len(curves)
    for ks in _by_layer(curves):
        for k, i in zip(ks, _pick_layer([curves[k] for k in ks], lam)):
            picks[k] = i
    return picks


MIX_LAMS_PER_DECADE = 24  # lam samples between breakpoints where layers may switch regime (mix_cost or split_cost > 0 only)


def _lams(curves: list[HeadCurve]) -> list[float]:
    """The multipliers the path is evaluated just past: every head's breakpoints and, where some layer pays
    a mix_cost or a split_cost, a geometric grid over their span (a layer changes regime between breakpoints too)."""
    lams = {b for c in curves for b in _breakpoints(c)}
    positive = [b for b in lams if b > 0]
    if positive and any(c.mix_cost > 0 or c.split_cost > 0 for c in curves):
        lo, hi = math.log10(min(positive)) - 1, math.log10(max(positive)) + 1
        steps = max(1, math.ceil((hi - lo) * MIX_LAMS_PER_DECADE))
        lams |= {10 ** (lo + (hi - lo) * j / steps) for j in range(steps + 1)}
    return sorted(lams)


def _breakpoints(c: HeadCurve) -> list[float]:
    """The multipliers at which this head's pick changes: slopes between consecutive points of the lower
    convex hull of (error, cost) walked from the cheapest option towards dense."""
    points = sorted({(c.error[i], c.cost[i]) for i in c.usable()} | {(0.0, c.dense_cost)}, key=lambda p: (p[1], p[0]))
    out, (err, cost) = [], points[0]
    while err > 0:
        # Next hull point: the option with lower error that costs the least extra per unit of error removed.
        steps = [((pc - cost) / (err - pe), pe, pc) for pe, pc in points if pe < err]
        slope, err, cost = min(steps)
        out.append(max(0.0, slope) / c.dense_cost)
    return out


def lagrangian_path(curves: list[HeadCurve]) -> list[Allocation]:
    """Allocations from lam = 0 (every head its cheapest candidate) to all-dense, one per distinct set of
    picks, in order of rising lam (so of non-decreasing total cost). The last one is all-dense."""
    path = [Allocation(_picks(curves, 0.0), 0.0)]
    for b in _lams(curves):
        lam = b * (1 + 1e-9) + 1e-300  # just past the breakpoint: the head has switched
        picks = _picks(curves, lam)
        if picks != path[-1].choices:
            path.append(Allocation(picks, lam))
    if any(i != DENSE for i in path[-1].choices):  # heads whose error-0 candidate beats dense stay sparse
        path.append(Allocation([DENSE] * len(curves), math.inf))
    for a in path:
        a.reasons = {(c.layer, c.head): _dense_reason(c, _why_dense(c, a.lam, "error")) for c, i in zip(curves, a.choices) if i == DENSE}
    return path


def _why_dense(c: HeadCurve, lam: float, error: str) -> str:
    """Why a head is dense at lam: its own trade, or its layer's (it would be sparse alone, but its launch
    among dense heads or beside other launches costs the layer mix_cost or split_cost more)."""
    if math.isfinite(lam) and _pick(c, lam) != DENSE:
        return (f"its layer runs dense: its own launch costs the layer more than its share (mixing sparse and dense heads "
                f"{c.mix_cost:.3g} ms, each launch past the first {c.split_cost:.3g} ms)")
    return f"dense costs less than any sparse candidate's cost + {lam:.3g} x dense cost x {error}"


def budget_allocation(curves: list[HeadCurve], fraction: float) -> Allocation | None:
    """The lowest-error allocation of the path whose cost is <= fraction x all-dense cost; None when even
    the cheapest one (lam = 0) costs more."""
    fits = [a for a in lagrangian_path(curves) if a.cost_fraction(curves) <= fraction + 1e-12]
    return fits[-1] if fits else None


@dataclass
class TargetSearch:
    """The result of ``search_target``: the chosen path index (None: no sparse allocation met the target),
    the measured points {path index: value}, and the best reachable index (the lowest value measured among
    sparse allocations) for --allow-miss."""

    chosen: int | None
    measured: dict[int, float]
    best: int


def search_target(path: list[Allocation], measure: Callable[[Allocation], float], target: float,
                  costs: list[float] | None = None, resolution: float = 0.0,
                  predicted: list[float] | None = None, known: list[float | None] | None = None) -> TargetSearch:
    """The cheapest allocation of the path whose measured value (KL) is <= target, the value assumed
    non-increasing along the path (as heads go denser). The all-dense end is excluded.

    Without ``predicted``: measured first is the densest sparse allocation (path[-2]; if it misses, nothing
    cheaper is tried and chosen is None), then path[0], then bisection: about log2(len(path)) + 2 runs.
    With ``predicted`` (a model's value per path point, non-increasing): the first point measured is the
    cheapest whose prediction meets the target; each next point is the cheapest whose prediction times the
    last measured/predicted ratio meets it, moved strictly inside the bracket; a guided step that did not
    halve the bracket is followed by a bisection. Unreachable means path[-2] was measured and missed.
    Either way the search stops once the bracket's points differ by <= resolution of dense
    cost (costs: cost fraction per point; each measurement runs the model).

    known: values already measured per path point (None where not), e.g. a sweep's earlier targets on the same
    path: never measured again, and the bracket starts from them (the cheapest known point that meets the
    target, the densest cheaper one that misses). The measured KL is not monotone along the predicted path
    (Gemma 3 at 16K, RESULTS Run 40: 0.0083 at 0.703 of dense, 0.0092 at 0.713), so a target's own bisection
    could settle on a dearer point than one an earlier target had measured to meet it."""
    if len(path) < 2:
        raise ValueError("no sparse candidate is cheaper than dense for any head: nothing to allocate")
    measured = {i: float(v) for i, v in enumerate(known or []) if v is not None and i <= len(path) - 2}

    def value(i: int) -> float:
        if i not in measured:
            measured[i] = float(measure(path[i]))
        return measured[i]

    top = len(path) - 2  # the densest sparse point
    if predicted is None:
        if value(top) > target:
            return TargetSearch(None, measured, top)
        if value(0) <= target:
            return TargetSearch(0, measured, 0)
        lo, hi = 0, top  # invariant: path[lo] misses the target, path[hi] meets it
    else:
        lo, hi = -1, top + 1  # -1 / top + 1: no missing / meeting point measured yet
    lo, hi = _known_bracket(measured, target, lo, hi)
    guess = None if predicted is None else _guess(predicted, target, 1.0, top)
    while hi - lo > 1:
        if lo >= 0 and hi <= top and costs is not None and costs[hi] - costs[lo] <= resolution:
            break
        width = hi - lo
        mid = _next_point(lo, hi, top, guess)
        if value(mid) <= target:
            hi = mid
        else:
            lo = mid
        # A guided step that did not halve the bracket is followed by a bisection, so a poor model costs at
        # most about twice the bisection's runs; a good one lands in two or three.
        guided = guess is not None
        guess = None if predicted is None or (guided and 2 * (hi - lo) > width) or predicted[mid] <= 0 else \
            _guess(predicted, target, measured[mid] / predicted[mid], top)
    if hi > top:
        return TargetSearch(None, measured, min(measured, key=lambda i: (measured[i], -i)))
    return TargetSearch(hi, measured, hi)


def _known_bracket(measured: dict[int, float], target: float, lo: int, hi: int) -> tuple[int, int]:
    """The bracket (lo, hi) narrowed by the points measured inside it: hi the cheapest that meets the target,
    lo the densest cheaper one that misses."""
    meets = [i for i, v in measured.items() if lo < i < hi and v <= target]
    hi = min(meets, default=hi)
    misses = [i for i, v in measured.items() if lo < i < hi and v > target]
    return max(misses, default=lo), hi


def _next_point(lo: int, hi: int, top: int, guess: int | None) -> int:
    """The next path index to measure in the bracket (lo misses or is -1, hi meets or is top + 1): the guess
    moved strictly inside (a guess at or past a measured end says the answer is that end: measure its inner
    neighbour to confirm); without a guess the midpoint."""
    if guess is not None:
        return min(max(guess, lo + 1), hi - 1)
    return (lo + hi) // 2  # also with an open end: -1 and top + 1 keep the midpoint inside [0, top]


def _guess(predicted: list[float], target: float, ratio: float, top: int) -> int:
    """The cheapest path index <= top whose predicted value x ratio meets the target (top when none does)."""
    return next((i for i in range(top + 1) if predicted[i] * ratio <= target), top)


def probe_allocation(curves: list[HeadCurve], path: list[Allocation], cost_fraction: float) -> Allocation:
    """The allocation each layer's KL sensitivity is measured at: the point of the (error) path whose cost
    fraction is nearest ``cost_fraction``, except that a layer left all-dense there takes its cheapest
    candidates (lam = 0), so that every layer with a sparse candidate is probed."""
    near = min(path[:-1] or path, key=lambda a: abs(a.cost_fraction(curves) - cost_fraction))
    cheapest = path[0].choices
    dense_layers = {c.layer for c in curves} - {c.layer for c, i in zip(curves, near.choices) if i != DENSE}
    choices = [cheapest[k] if c.layer in dense_layers else i for k, (c, i) in enumerate(zip(curves, near.choices))]
    return Allocation(choices, near.lam)


def only_layer(alloc: Allocation, curves: list[HeadCurve], layer: int) -> Allocation:
    """``alloc`` with every head outside ``layer`` dense."""
    return Allocation([i if c.layer == layer else DENSE for c, i in zip(curves, alloc.choices)], alloc.lam)


def kl_sensitivity(curves: list[HeadCurve], probe: Allocation, layer_kl: dict[int, float]) -> dict[int, float]:
    """Per layer a_l = KL_l / sum_h error_h^2 over the layer's heads at ``probe`` (layer_kl: the KL measured
    with only that layer sparse at probe). A layer whose probe is all-dense or error-free gets the largest
    sensitivity measured (nothing says it is cheap to sparsify)."""
    sq: dict[int, float] = {}
    for c, i in zip(curves, probe.choices):
        sq[c.layer] = sq.get(c.layer, 0.0) + c.error_of(i) ** 2
    known = {layer: max(0.0, kl) / sq[layer] for layer, kl in layer_kl.items() if sq.get(layer, 0.0) > 0}
    worst = max(known.values(), default=1.0)
    return {layer: known.get(layer, worst) for layer in sq}


def kl_model_curves(curves: list[HeadCurve], sensitivity: dict[int, float]) -> list[HeadCurve]:
    """Curves whose error is each candidate's predicted KL share a_l * error^2 (same costs, same candidate
    indices): the Lagrangian path of these runs in order of predicted model KL."""
    return [replace(c, error=tuple(sensitivity[c.layer] * e * e for e in c.error)) for c in curves]


def kl_model_path(curves: list[HeadCurve], sensitivity: dict[int, float]) -> tuple[list[Allocation], list[float]]:
    """The Lagrangian path of ``kl_model_curves`` (allocations in order of predicted KL, dense reasons in
    terms of the real errors) and the predicted KL of each point, non-increasing along it."""
    model = kl_model_curves(curves, sensitivity)
    path = lagrangian_path(model)
    for a in path:
        why = lambda c, m: f"layer {c.layer} costs {sensitivity[c.layer]:.3g} KL per squared output error: " + _why_dense(m, a.lam, "its predicted KL")
        a.reasons = {(c.layer, c.head): _dense_reason(c, why(c, m)) for c, m, i in zip(curves, model, a.choices) if i == DENSE}
    return path, [predicted_kl(model, a) for a in path]


def predicted_kl(model_curves: list[HeadCurve], alloc: Allocation) -> float:
    """The KL model's value of an allocation: the sum of its heads' predicted shares (kl_model_curves)."""
    return sum(c.error_of(i) for c, i in zip(model_curves, alloc.choices))


@dataclass(frozen=True)
class KeyCheck:
    """The retrieval guard's reading of one allocation (sparsesearch/tuning.py): misses, the keys dense retrieves
    that it loses; worst, the lowest ratio of a held key digit's probability to its dense one (1.0: untouched)."""

    misses: int
    worst: float


def dense_layers(alloc: Allocation, curves: list[HeadCurve], layers: set[int], reason: Callable[[HeadCurve], str]) -> Allocation:
    """``alloc`` with every head of ``layers`` dense, each such head's reason from ``reason``."""
    reasons = {**alloc.reasons, **{(c.layer, c.head): reason(c) for c in curves if c.layer in layers}}
    return Allocation([DENSE if c.layer in layers else i for c, i in zip(curves, alloc.choices)], alloc.lam, reasons)


def protect_layers(curves: list[HeadCurve], alloc: Allocation, check: Callable[[Allocation], KeyCheck]
                   ) -> tuple[list[int] | None, dict[int, KeyCheck]]:
    """The fewest layers to keep dense so that ``alloc`` loses no key: each sparse layer is read alone (only its
    heads sparse), the layers are ranked by what they lose alone (misses, then the weakest digit), and the
    shortest prefix of that ranking whose layers dense make the guard pass is found by bisection (misses assumed
    non-increasing as layers are added). A few layers may carry the needle (retrieval heads are few: DuoAttention,
    paper 000's peers); the guard's path move instead densifies whatever the KL model ranks next. Returns (the
    layers, or None when only every layer dense passes; each layer's reading alone)."""
    layers = sorted({c.layer for c, i in zip(curves, alloc.choices) if i != DENSE})
    alone = {layer: check(only_layer(alloc, curves, layer)) for layer in layers}
    order = sorted(layers, key=lambda layer: (-alone[layer].misses, alone[layer].worst))
    prefixes = [dense_layers(alloc, curves, set(order[:k]), lambda c: "") for k in range(len(order) + 1)]
    found = search_target(prefixes, lambda a: check(a).misses, 0)
    return (None if found.chosen is None else order[:found.chosen]), alone


def hold_guard(path: list[Allocation], start: int, misses: Callable[[Allocation], int]) -> tuple[int | None, dict[int, int]]:
    """The cheapest path index >= start (the quality target's choice) at which a guard misses nothing — the
    retrieval guard (sparsesearch/tuning.py): answers dense gives that the point loses — its misses assumed
    non-increasing along the path, as heads go denser. Predicted KL only falls along the path, so every point is
    predicted to meet the KL target past start too. Measured: the densest sparse point first (if it misses, no sparse
    point holds: None), then start, then bisection. Returns (index or None, {path index: misses measured})."""
    found = search_target(path[start:], misses, 0)
    measured = {start + i: int(v) for i, v in found.measured.items()}
    return (None if found.chosen is None else start + found.chosen), measured
