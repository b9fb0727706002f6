"""Check an exported file against a model's config and its target engine's rules before deploying it.

``check_file`` returns one ``Finding`` per problem (the engine would crash, or the file does not fit the model)
and per note (the engine runs something else than the file says, silently). A file that cannot be read as the
format at all (not JSON, not a list, not a flag line) raises ValueError with one line instead.

Rules per format (facts from docs/peers.md and the engines' code cited in ``export.qwen1m``):

* ``minference`` (MInference's runtime): one entry per layer of the model; head keys are query-head indices in
  range; entries are ``[type, vertical_size, slash_size(, score)]`` with a known type and integer sizes.
  A head left out is a note: MInference runs it as VS(1000, 6096).
* ``qwen-1m`` (vLLM <= 0.10.2 / SGLang <= 0.5.19 dual-chunk backends): everything above, and a problem for a
  missing query head (KeyError), a type other than ``vertical_and_slash`` (assert), a size below 8 (overflow),
  a slash size above the model's context (index buffers sized before clamping), a model outside the
  Qwen2/Qwen3 families, and a ``--tp`` the model's heads do not divide; a vertical size of 30 is a note (read as
  130), as are the real Qwen2.5-1M file's 72 such heads.
* ``flashprefill``: one line ``--flashprefill-full-attention-layers N`` with N at most the model's layers (a
  note when N covers every layer: nothing would run sparse), and a ``--tp`` the model's heads divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..json_input import parse_json, read_bytes
from ..models.info import ModelInfo
from . import flashprefill, qwen1m
from .minference import CONFIG_MAX_BYTES, FALLBACK, TYPES, _is_int

FORMATS = ("minference", "qwen-1m", "flashprefill")


@dataclass(frozen=True)
class Finding:
    """One line of a check: ``level`` "problem" (fails the check) or "note" (the engine silently differs)."""

    level: str
    text: str

    def line(self) -> str:
        return f"{self.level}: {self.text}"


def problem(text: str) -> Finding:
    return Finding("problem", text)


def note(text: str) -> Finding:
    return Finding("note", text)


def check_file(path, fmt: str, info: ModelInfo, *, tp: int | None = None) -> list[Finding]:
    """The findings of the file at ``path`` read as ``fmt`` for the model ``info`` (module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)} for a check, got {fmt!r}")
    path = Path(path)
    data = read_bytes(path, str(path), max_bytes=CONFIG_MAX_BYTES)
    if fmt == "flashprefill":
        return check_flashprefill(_text(data, path), path.name, info, tp=tp)
    config = parse_json(data, path.name)
    if not isinstance(config, list):
        raise ValueError(f"{path.name}: expected a JSON list with one object per layer, got {type(config).__name__}")
    if fmt == "minference":
        return check_minference(config, info)
    return check_qwen1m(config, info, tp=tp)


def _text(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path.name}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


# ------------------------------------------------------------------------------------------ per-head files


def _entry_findings(entry, where: str) -> list[Finding]:
    """What MInference's own reader needs of one entry: a list, a known type, integer sizes, a numeric score."""
    if not isinstance(entry, list) or len(entry) not in (3, 4):
        return [problem(f"{where}: expected [type, vertical_size, slash_size, score], got {str(entry)[:60]}")]
    out = []
    if entry[0] not in TYPES:
        out.append(problem(f"{where}: unknown type {entry[0]!r} (known: {', '.join(TYPES)})"))
    if not (_is_int(entry[1]) and _is_int(entry[2]) and entry[1] >= 0 and entry[2] >= 0):
        out.append(problem(f"{where}: sizes must be non-negative integers, got {entry[1]!r} and {entry[2]!r}"))
    score = entry[3] if len(entry) == 4 else None
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        out.append(problem(f"{where}: score must be a number or null, got {score!r}"))
    return out


def _layer_heads(config: list, info: ModelInfo) -> tuple[list[Finding], list[dict[int, object]]]:
    """Structural findings shared by both per-head formats, and per layer the entries by query-head index."""
    out, layers = [], []
    if len(config) != info.num_layers:
        out.append(problem(f"the file has {len(config)} layers, model {info.id} has {info.num_layers}"))
    for layer, entries in enumerate(config):
        heads: dict[int, object] = {}
        layers.append(heads)
        if not isinstance(entries, dict):
            out.append(problem(f"layer {layer}: expected an object of query head -> entry, got {type(entries).__name__}"))
            continue
        for key, entry in entries.items():
            if not (key.isdigit() and str(int(key)) == key):
                out.append(problem(f"layer {layer}: head key {key!r} is not a query-head index like '0'"))
            elif int(key) >= info.num_heads:
                out.append(problem(f"layer {layer} head {key}: out of range [0, {info.num_heads}) (query heads of {info.id})"))
            else:
                heads[int(key)] = entry
                out += _entry_findings(entry, f"layer {layer} head {key}")
    return out, layers


def _missing(heads: dict, info: ModelInfo) -> list[int]:
    return [head for head in range(info.num_heads) if head not in heads]


def check_minference(config: list, info: ModelInfo) -> list[Finding]:
    """Findings of a MInference config under MInference's own runtime."""
    out, layers = _layer_heads(config, info)
    for layer, heads in enumerate(layers):
        missing = _missing(heads, info)
        if missing and isinstance(config[layer], dict):
            out.append(note(f"layer {layer}: query heads {_ranges(missing)} are left out; MInference runs them as "
                            f"{FALLBACK[0]}({FALLBACK[1]}, {FALLBACK[2]})"))
    return out


def _qwen_entry_findings(entry, where: str, context: int | None) -> list[Finding]:
    """The dual-chunk engines' rules for one well-formed entry."""
    if not isinstance(entry, list) or len(entry) not in (3, 4) or not (_is_int(entry[1]) and _is_int(entry[2])):
        return []  # already a problem under the MInference rules
    kind, vertical, slash = entry[0], entry[1], entry[2]
    out = []
    if kind != qwen1m.TYPE:
        out.append(problem(f"{where}: type {kind!r} fails the engines' assert (only {qwen1m.TYPE!r} is accepted)"))
    if min(vertical, slash) < qwen1m.MIN_SIZE:
        out.append(problem(f"{where}: size below {qwen1m.MIN_SIZE} ({vertical}, {slash}) can overflow the engines' fallback path"))
    if context is not None and slash > context:
        out.append(problem(f"{where}: slash size {slash} exceeds the model's context ({context}); the engines size "
                           f"index buffers by it before clamping"))
    if vertical == qwen1m.REREAD_VERTICAL[0]:
        out.append(note(f"{where}: vertical size 30 is read as 130 by the engines"))
    return out


def check_qwen1m(config: list, info: ModelInfo, *, tp: int | None = None) -> list[Finding]:
    """Findings of a ``sparse_attention_config.json`` under the dual-chunk engines' rules."""
    out, layers = _layer_heads(config, info)
    arch = info.text_architecture or info.architecture
    if arch not in qwen1m.ARCHITECTURES:
        out.append(problem(f"model {info.id} is {arch}; the dual-chunk backends serve Qwen2/Qwen3 models only"))
    out += _tp_findings(info, tp)
    for layer, heads in enumerate(layers):
        missing = _missing(heads, info)
        if missing and isinstance(config[layer], dict):
            out.append(problem(f"layer {layer}: query heads {_ranges(missing)} are missing (a KeyError in the engines)"))
        for head, entry in sorted(heads.items()):
            out += _qwen_entry_findings(entry, f"layer {layer} head {head}", info.max_position_embeddings)
    return out


def _tp_findings(info: ModelInfo, tp: int | None) -> list[Finding]:
    """Tensor parallelism splits query heads evenly and KV heads evenly (or replicates them when there are fewer
    KV heads than ranks, which then must divide the rank count), as vLLM and SGLang do."""
    if tp is None:
        return []
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    out = []
    if info.num_heads % tp:
        out.append(problem(f"--tp {tp} does not divide the model's {info.num_heads} query heads"))
    kv = info.num_kv_heads
    if kv % tp and tp % kv:
        out.append(problem(f"--tp {tp} and the model's {kv} KV heads: neither divides the other"))
    return out


def _ranges(heads: list[int]) -> str:
    """'0-3, 7' for [0, 1, 2, 3, 7]: a layer missing 28 heads stays one short line."""
    parts, start = [], heads[0]
    for prev, cur in zip(heads, heads[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------ flashprefill


def check_flashprefill(text: str, where: str, info: ModelInfo, *, tp: int | None = None) -> list[Finding]:
    """Findings of a flag file: its N against the model's layer count, and the --tp split."""
    layers = flashprefill.parse_flag_line(text, where)
    out = _tp_findings(info, tp)
    if layers > info.num_layers:
        out.append(problem(f"{flashprefill.FLAG} {layers} exceeds the model's {info.num_layers} layers"))
    elif layers == info.num_layers:
        out.append(note(f"{flashprefill.FLAG} {layers} keeps every layer dense: nothing runs sparse"))
    return out
