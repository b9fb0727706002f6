"""Search spaces as data: the kernel-aware candidate table (paper 000 Table 3 + C.5), validated on load.

A search space is a JSON file (``search_spaces/*.json`` ships the default; users pass their own): a name,
``reference_tokens``, block sizes, a ``target`` pattern whose cost is the budget (plus ``budget_slack``),
and ``candidates`` — {pattern, params, modalities?, scaled?}. Token-count parameters listed in ``scaled_params``
are sized for ``reference_tokens`` and scale down linearly for shorter calibration inputs (never up), so a
4K-token calibration searches the same shapes at 1/8 the size; a candidate with ``"scaled": false`` keeps its
token counts at every length (a StreamingLLM/DuoAttention streaming head is sink 64 + a few hundred local
tokens whatever the context). Grid ``stride`` is an int, "frame_stride"
(from the calibration sample) or "estimate" (online stride/phase search, paper 000 Alg. 1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from ..patterns import PARAMS
from ..patterns.boundary import BOUNDARIES

DEFAULT_SPACE = "mminference"
FORMAT = 1
ROUND = 8  # scaled token counts are rounded to a multiple of this (and kept >= it)
STRIDE_WORDS = ("frame_stride", "estimate")
MODALITY_NAMES = ("text", "image", "video")


@dataclass(frozen=True)
class Candidate:
    """One entry of a search space, before (raw) or after (resolved) scaling to a length."""

    pattern: str
    params: dict
    modalities: tuple[str, ...] | None = None  # None: every modality
    scaled: bool = True  # False: token counts as written at every length

    @property
    def key(self) -> str:
        """Stable identifier: pattern plus sorted params (and "fixed" for an unscaled entry)."""
        return self.pattern + json.dumps(self.params, sort_keys=True) + ("" if self.scaled else " fixed")


@dataclass(frozen=True)
class SearchSpace:
    name: str
    sha256: str
    reference_tokens: int
    block_m: int
    block_n: int
    target: Candidate
    budget_slack: float
    scaled_params: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    boundaries: tuple[str, ...]

    def scale(self, tokens: int) -> float:
        return min(1.0, tokens / self.reference_tokens)

    def resolve(self, candidate: Candidate, tokens: int, *, frame_stride: int | None = None):
        """The params dataclass for `candidate` at `tokens`, or None when it cannot apply (no frame stride)."""
        factor = self.scale(tokens)
        values = {}
        for name, value in candidate.params.items():
            if name == "stride" and value in STRIDE_WORDS:
                if value == "frame_stride":
                    if not frame_stride:
                        return None
                    value = frame_stride
                else:
                    value = None  # estimated per head at search time
            elif candidate.scaled and name in self.scaled_params and isinstance(value, int):
                value = max(ROUND, int(round(value * factor / ROUND)) * ROUND)
            values[name] = value
        if candidate.pattern == "grid" and values.get("stride") is None:
            return ("estimate", values)
        return PARAMS[candidate.pattern](**values)

    def applies_to(self, candidate: Candidate, modality: str) -> bool:
        return candidate.modalities is None or modality in candidate.modalities


def load_space(spec: str | Path | None = None) -> SearchSpace:
    """Load a search space: None / a bundled name (``mminference``) / a path to a JSON file."""
    if spec is None or (isinstance(spec, str) and not spec.endswith(".json") and "/" not in spec):
        name = spec or DEFAULT_SPACE
        data = _bundled(name)
        if data is None:
            raise ValueError(f"unknown bundled search space {name!r}; pass a .json path or use {DEFAULT_SPACE!r}")
        where = f"bundled {name}"
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"search space file not found: {path}")
        data = path.read_bytes()
        where = str(path)
    try:
        raw = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"search space {where} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return parse_space(raw, hashlib.sha256(data).hexdigest(), where)


def _bundled(name: str) -> bytes | None:
    """A bundled space's bytes: from the installed package data, else from a source checkout's search_spaces/."""
    try:
        return resources.files("sparsesearch.search_spaces").joinpath(f"{name}.json").read_bytes()
    except (FileNotFoundError, ModuleNotFoundError):
        pass
    source = Path(__file__).resolve().parents[2] / "search_spaces" / f"{name}.json"
    return source.read_bytes() if source.is_file() else None


def parse_space(raw: dict, sha256: str, where: str = "search space") -> SearchSpace:
    """Validate every field; errors name the file, the entry and the bad value."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: top level must be an object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise ValueError(f"{where}: format must be {FORMAT}, got {raw.get('format')!r}")
    for key in ("name", "reference_tokens", "target", "candidates"):
        if key not in raw:
            raise ValueError(f"{where}: missing required field {key!r}")
    ref = raw["reference_tokens"]
    if not isinstance(ref, int) or ref < 64:
        raise ValueError(f"{where}: reference_tokens must be an int >= 64, got {ref!r}")
    slack = raw.get("budget_slack", 0.0)
    if not isinstance(slack, (int, float)) or slack < 0:
        raise ValueError(f"{where}: budget_slack must be a number >= 0, got {slack!r}")
    blocks = []
    for key in ("block_m", "block_n"):
        value = raw.get(key, 64)
        if value not in (16, 32, 64, 128):
            raise ValueError(f"{where}: {key} must be 16, 32, 64 or 128, got {value!r}")
        blocks.append(value)
    scaled = tuple(raw.get("scaled_params", ()))
    boundaries = tuple(raw.get("boundaries", ("none",)))
    bad = [b for b in boundaries if b not in BOUNDARIES]
    if bad:
        raise ValueError(f"{where}: unknown boundary type(s) {bad}; known: {', '.join(BOUNDARIES)}")
    target = _candidate(raw["target"], f"{where}: target")
    if not isinstance(raw["candidates"], list) or not raw["candidates"]:
        raise ValueError(f"{where}: candidates must be a non-empty list")
    candidates = tuple(_candidate(c, f"{where}: candidates[{i}]") for i, c in enumerate(raw["candidates"]))
    space = SearchSpace(str(raw["name"]), sha256, ref, blocks[0], blocks[1], target, float(slack), scaled, candidates, boundaries)
    # Every candidate's raw values must make valid params (scaling would hide e.g. a negative sink).
    for i, cand in enumerate((target,) + candidates):
        raw_values = {k: (64 if k == "stride" and v in STRIDE_WORDS else v) for k, v in cand.params.items()}
        try:
            PARAMS[cand.pattern](**raw_values)
        except (TypeError, ValueError) as exc:
            label = "target" if i == 0 else f"candidates[{i - 1}]"
            raise ValueError(f"{where}: {label} ({cand.pattern}): {exc}") from None
    return space


def _candidate(entry, where: str) -> Candidate:
    if not isinstance(entry, dict) or "pattern" not in entry:
        raise ValueError(f"{where}: must be an object with a 'pattern'")
    pattern = entry["pattern"]
    if pattern not in PARAMS:
        raise ValueError(f"{where}: unknown pattern {pattern!r}; known: {sorted(PARAMS)}")
    params = entry.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where}: params must be an object")
    known = {f.name for f in fields(PARAMS[pattern])}
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(f"{where}: {pattern} has no parameter(s) {extra}; known: {sorted(known)}")
    modalities = entry.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or any(m not in MODALITY_NAMES for m in modalities):
            raise ValueError(f"{where}: modalities must be a list of {MODALITY_NAMES}, got {modalities!r}")
        modalities = tuple(modalities)
    scaled = entry.get("scaled", True)
    if not isinstance(scaled, bool):
        raise ValueError(f"{where}: scaled must be true or false, got {scaled!r}")
    return Candidate(pattern, dict(params), modalities, scaled)
