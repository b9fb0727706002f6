"""One-size baselines: the configs a user could write in one line, as artifacts the runtime runs.

Each family maps a budget b in (0, 1] — the attention cost it may spend, as a fraction of dense — to one
setting for every head of every global layer (sliding layers of hybrid models keep their own window, as in
every artifact). Static families pick the parameter whose exact density (the pattern's own ``density`` at
the evaluated length, block granularity) is nearest b; dynamic families scale a shape to the length and
their real density is what the cost step measures on the held-out windows, never this nominal budget.

- ``streaming``: StreamingLLM — a 64-token sink and the local window whose density is nearest b.
- ``minference``: MInference's one vertical-slash setting for every head; ``minference`` is its shipped default
  (1000 verticals, 6096 slashes) at any length, the budgets split b·n lines in that ratio.
- ``topk``: block top-k, FlashPrefill / XAttention style, one sink block and the k of 64-blocks nearest b.
- ``trianglemix``: TriangleMix alone, dense below the start layer (the probed one when known, else the start
  whose layer mix costs b with the triangle's own density).
- ``duo``: DuoAttention-style, a share of heads streaming (sink 64, local 256), the rest dense; the
  streaming heads are those whose A-shape output error on a calibration window is lowest (the role
  DuoAttention's trained gates play), the share the one that costs b.
- ``dense``: the model's own attention (cost 1, KL 0): the anchor of every curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..artifacts.columns import ALL_MODALITIES, row_from_params, window_row
from ..patterns import ashape, block_topk, triangle
from ..patterns.ashape import AShapeParams
from ..patterns.block_topk import BlockTopKParams
from ..patterns.triangle import TriangleParams
from ..patterns.vertical_slash import VerticalSlashParams

BLOCK = 64  # block_m = block_n of every baseline row: the runtime's and the bundled search space's
# Named after the method each one-size config stands for (not the pattern it runs: a family is a config, and
# the pattern names belong to the registry).
FAMILIES = ("streaming", "minference", "topk", "trianglemix", "duo", "dense")
DEFAULT_BUDGETS = (0.3, 0.5, 0.7)
SINK = 64  # StreamingLLM's sink (one block)
MINFERENCE_DEFAULT = (1000, 6096)  # vertical_size, slash_size of MInference's shipped config, every head
STREAM = AShapeParams(sink=64, local=256)  # a DuoAttention streaming head
TRIANGLE = TriangleParams(sink=8, window=512, last=128)  # paper 002's inference defaults (probe.run)


@dataclass
class Point:
    """One setting to measure: ``family`` and its nominal ``budget`` (None for dense, a fixed default or a
    given artifact), a short ``label`` for tables, its parameters in words, and the artifact it runs as
    (``manifest`` + heads ``rows``). ``searched``: the point is a calibrated artifact, not a baseline."""

    family: str
    label: str
    budget: float | None
    setting: str
    manifest: dict
    rows: list[dict]
    searched: bool = False
    extra: dict = field(default_factory=dict)


def check_budgets(budgets: list[float]) -> None:
    """ValueError (one line) unless every budget is in (0, 1]."""
    for b in budgets:
        if not (isinstance(b, (int, float)) and math.isfinite(b) and 0 < b <= 1):
            raise ValueError(f"--budgets: each budget is a fraction of dense cost in (0, 1], got {b!r}")


def check_families(families: list[str]) -> None:
    """ValueError (one line) naming the first unknown family and the known ones."""
    for name in families:
        if name not in FAMILIES:
            raise ValueError(f"--baselines: unknown baseline {name!r} (known: {', '.join(FAMILIES)})")


def _row(layer: int, head: int, params) -> dict:
    """A global heads row of ``params`` (pattern from its class), nothing measured."""
    from ..patterns.registry import PARAMS

    name = next(n for n, cls in PARAMS.items() if isinstance(params, cls))
    return {"layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES, "boundary": "none",
            "pattern": name, **row_from_params(params), "block_m": BLOCK, "block_n": BLOCK, "density": None,
            "recall": None, "output_error": None, "latency_ms": None, "score": None, "reason": None}


def _heads(info) -> int:
    return info.num_kv_heads  # baselines are per KV head: a GQA group shares one pattern, as kernels run it


def _sliding(info, tokens: int) -> list[dict]:
    """A hybrid model's window rows (the model's own attention there), density at ``tokens``."""
    if not info.sliding_layers:
        return []
    density = ashape.density(AShapeParams(sink=0, local=int(info.sliding_window)), tokens, block_m=BLOCK, block_n=BLOCK)
    return [window_row(layer, head, info.sliding_window, density=round(density, 6))
            for layer in info.sliding_layers for head in range(_heads(info))]


def _manifest(info, source: str, methods: dict | None = None) -> dict:
    from ..artifacts.manifest import new_manifest

    return new_manifest(info, head_index_space="kv", provenance={"kind": "manual", "source": source}, methods=methods)


def uniform(info, tokens: int, family: str, label: str, budget: float | None, params, setting: str) -> Point:
    """Every head of every global layer runs ``params``."""
    rows = _sliding(info, tokens) + [_row(layer, head, params) for layer in info.global_layers for head in range(_heads(info))]
    return Point(family, label, budget, setting, _manifest(info, f"pareto baseline {label}"), rows)


def nearest(candidates: list, density_of, budget: float):
    """The candidate whose density is nearest ``budget`` (the cheaper on a tie)."""
    return min(candidates, key=lambda c: (abs(density_of(c) - budget), density_of(c)))


def ashape_point(info, tokens: int, budget: float) -> Point:
    locals_ = [BLOCK * i for i in range(1, max(2, math.ceil(tokens / BLOCK)) + 1)]
    dens = lambda local: ashape.density(AShapeParams(sink=SINK, local=local), tokens, block_m=BLOCK, block_n=BLOCK)  # noqa: E731
    local = nearest(locals_, dens, budget)
    return uniform(info, tokens, "streaming", f"ashape {SINK}/{local}", budget, AShapeParams(sink=SINK, local=local),
                   f"sink {SINK}, local {local} (density {dens(local):.3f})")


def block_topk_point(info, tokens: int, budget: float) -> Point:
    blocks = max(1, math.ceil(tokens / BLOCK))
    dens = lambda k: block_topk.density(BlockTopKParams(k_blocks=k, sink_blocks=1), tokens, block_m=BLOCK, block_n=BLOCK)  # noqa: E731
    k = nearest(list(range(0, blocks + 1)), dens, budget)
    return uniform(info, tokens, "topk", f"topk {k}", budget, BlockTopKParams(k_blocks=k, sink_blocks=1),
                   f"top {k} of {blocks} key blocks + 1 sink block (density {dens(k):.3f})")


def vertical_slash_point(info, tokens: int, budget: float | None) -> Point:
    """budget None: MInference's shipped default; else b·n lines split 1000 : 6096 (at least one each)."""
    if budget is None:
        v, s = MINFERENCE_DEFAULT
        return uniform(info, tokens, "minference", f"vs {v}/{s}", None, VerticalSlashParams(vertical_size=v, slash_size=s),
                       f"MInference default: {v} verticals, {s} slashes")
    lines = budget * tokens
    v = max(1, round(lines * MINFERENCE_DEFAULT[0] / sum(MINFERENCE_DEFAULT)))
    s = max(1, round(lines * MINFERENCE_DEFAULT[1] / sum(MINFERENCE_DEFAULT)))
    return uniform(info, tokens, "minference", f"vs {v}/{s}", budget, VerticalSlashParams(vertical_size=v, slash_size=s),
                   f"{v} verticals, {s} slashes (MInference's ratio at {budget:g} of the length)")


def triangle_start(info, tokens: int, budget: float) -> int:
    """The global layer from which triangle attention makes the global layers cost ``budget``: with a share
    t of them triangle, cost = (1 - t) + t·d_tri, so t = (1 - b) / (1 - d_tri)."""
    d_tri = triangle.density(TRIANGLE, tokens, block_m=BLOCK, block_n=BLOCK)
    layers = list(info.global_layers)
    share = min(1.0, max(0.0, (1 - budget) / max(1e-9, 1 - d_tri)))
    keep = len(layers) - round(share * len(layers))  # global layers left dense, from the bottom
    return layers[min(keep, len(layers) - 1)]


def triangle_point(info, tokens: int, start: int, budget: float | None, how: str) -> Point:
    tri = {"start_layer": int(start), "sink": TRIANGLE.sink, "window": TRIANGLE.window, "last": TRIANGLE.last}
    manifest = _manifest(info, f"pareto baseline triangle from layer {start}", {"trianglemix": tri})
    return Point("trianglemix", f"triangle L{start}", budget, f"TriangleMix from layer {start} ({how}), dense below",
                 manifest, _sliding(info, tokens))


def duo_point(info, tokens: int, budget: float, stream_order: list[tuple[int, int]]) -> Point:
    """``stream_order``: (layer, KV head) of the global layers, most streamable first."""
    d_stream = ashape.density(STREAM, tokens, block_m=BLOCK, block_n=BLOCK)
    share = min(1.0, max(0.0, (1 - budget) / max(1e-9, 1 - d_stream)))
    streaming = set(stream_order[: round(share * len(stream_order))])
    rows = _sliding(info, tokens) + [_row(layer, head, STREAM) for layer, head in sorted(streaming)]
    label = f"duo {len(streaming)}/{len(stream_order)}"
    return Point("duo", label, budget, f"{len(streaming)} of {len(stream_order)} KV heads streaming (sink {STREAM.sink}, "
                 f"local {STREAM.local}), the rest dense", _manifest(info, f"pareto baseline {label}"), rows)


def dense_point(info, tokens: int) -> Point:
    return Point("dense", "dense", 1.0, "the model's own attention", _manifest(info, "pareto baseline dense"), _sliding(info, tokens))


def baseline_points(info, tokens: int, families: list[str], budgets: list[float], *, triangle_probed: int | None = None,
                    stream_order: list[tuple[int, int]] | None = None) -> list[Point]:
    """Every (family, budget) point, in FAMILIES order; duplicates (two budgets giving one setting) dropped.
    triangle_probed: the probed start layer (an extra triangle point); stream_order: needed for ``duo``."""
    points: list[Point] = []
    for family in [f for f in FAMILIES if f in families]:
        if family == "dense":
            points.append(dense_point(info, tokens))
        elif family == "minference":
            points += [vertical_slash_point(info, tokens, None)] + [vertical_slash_point(info, tokens, b) for b in budgets]
        elif family == "trianglemix":
            starts = {triangle_start(info, tokens, b): b for b in budgets}
            points += [triangle_point(info, tokens, s, b, f"budget {b:g}") for s, b in starts.items()]
            if triangle_probed is not None and triangle_probed not in starts:
                points.append(triangle_point(info, tokens, triangle_probed, None, "probed"))
        elif family == "duo":
            if stream_order is None:
                raise ValueError("the duo baseline needs the heads ranked by streaming error (stream_order)")
            points += [duo_point(info, tokens, b, stream_order) for b in budgets]
        elif family == "streaming":
            points += [ashape_point(info, tokens, b) for b in budgets]
        else:  # topk
            points += [block_topk_point(info, tokens, b) for b in budgets]
    return _unique(points)


def _unique(points: list[Point]) -> list[Point]:
    seen, out = set(), []
    for p in points:
        if (p.family, p.label) not in seen:
            seen.add((p.family, p.label))
            out.append(p)
    return out
