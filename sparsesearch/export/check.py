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
* ``flashinfer`` (``export.flashinfer``): the plan's layer, query-head and KV-head counts equal the model's, its
  length at most the model's context, R and C positive; per (layer, KV head) the three tensors present, indptr
  [ceil(tokens / R) + 1] from 0, monotone, ending at the number of indices, indices in [0, ceil(tokens / C)) and
  unique within a block row, one partial flag per index. Notes: C not dividing the length
  (``BlockSparseAttentionWrapper`` reads every key block as C long), and heads whose ``lossy_blocks`` say
  ``causal=True`` admits keys our window/sink mask drops.
* ``modelopt`` (``export.modelopt``; a bare ``sparse_attention_config`` block or a config.json holding one):
  ``config_groups`` a non-empty object of groups, each with a string ``algorithm``, a non-empty ``targets`` list
  of strings, ``ignore`` strings naming ``layers.N`` with N in range, ``target_sparsity`` a number in [0, 1] or
  ``{prefill, decode}`` of such; ``producer`` an object with a ``name``. Notes: an algorithm ModelOpt 0.47's
  reader does not know (silently ignored), and a ``skip_softmax`` group without ``threshold_scale_factor`` (the
  reader then runs its preset and applies neither ``ignore`` nor ``target_sparsity``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..json_input import parse_json, read_bytes
from ..models.info import ModelInfo
from . import flashinfer, flashprefill, modelopt, qwen1m
from .minference import CONFIG_MAX_BYTES, FALLBACK, TYPES, _is_int

FORMATS = ("minference", "qwen-1m", "flashprefill", "flashinfer", "modelopt")


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
    if fmt == "flashinfer":  # binary and possibly large: safetensors reads it lazily
        return check_flashinfer(*flashinfer.load_flashinfer(path), info, tp=tp)
    data = read_bytes(path, str(path), max_bytes=CONFIG_MAX_BYTES)
    if fmt == "modelopt":
        return check_modelopt(parse_json(data, path.name), path.name, info)
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


# ------------------------------------------------------------------------------------------ flashinfer


def _plan_findings(plan: dict, info: ModelInfo) -> list[Finding]:
    """The plan's counts and sizes against the model; a plan missing a field is one problem line."""
    fields = ("tokens", "R", "C", "num_layers", "num_qo_heads", "num_kv_heads", "heads")
    missing = [name for name in fields if name not in plan]
    if missing:
        return [problem(f"plan metadata lacks {', '.join(missing)}")]
    out = []
    for name, want in (("num_layers", info.num_layers), ("num_qo_heads", info.num_heads), ("num_kv_heads", info.num_kv_heads)):
        if plan[name] != want:
            out.append(problem(f"the plan has {name} {plan[name]!r}, model {info.id} has {want}"))
    sizes = [problem(f"plan {name} must be a positive integer, got {plan[name]!r}")
             for name in ("tokens", "R", "C") if not _is_int(plan[name]) or plan[name] < 1]
    if sizes:
        return out + sizes
    if info.max_position_embeddings is not None and plan["tokens"] > info.max_position_embeddings:
        out.append(problem(f"plan tokens {plan['tokens']} exceed the model's context ({info.max_position_embeddings})"))
    if plan["tokens"] % plan["C"]:
        out.append(note(f"C {plan['C']} does not divide tokens {plan['tokens']}: BlockSparseAttentionWrapper reads every key "
                        f"block as C long (pad the keys, or use VariableBlockSparseAttentionWrapper with the last block shortened)"))
    return out


def _bsr_findings(tensors: dict, where: str, row_blocks: int, col_blocks: int) -> list[Finding]:
    """One (layer, KV head)'s BSR: indptr [row_blocks + 1] from 0, monotone, ending at len(indices); indices in
    [0, col_blocks), unique within a block row; one partial flag per index."""
    import torch

    if any(name not in tensors for name in flashinfer.TENSORS):
        return [problem(f"{where}: missing tensors (need {', '.join(flashinfer.TENSORS)})")]
    indptr, indices, partial = (tensors[name].long() for name in flashinfer.TENSORS)
    if indptr.dim() != 1 or indptr.numel() != row_blocks + 1:
        return [problem(f"{where}: indptr must be [{row_blocks + 1}] (ceil(tokens / R) + 1), got {list(indptr.shape)}")]
    if int(indptr[0]) != 0 or bool((indptr[1:] < indptr[:-1]).any()) or int(indptr[-1]) != indices.numel():
        return [problem(f"{where}: indptr must start at 0, never decrease and end at the {indices.numel()} indices")]
    out = []
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= col_blocks):
        out.append(problem(f"{where}: indices out of range [0, {col_blocks}) (ceil(tokens / C) key blocks)"))
    rows = torch.repeat_interleave(torch.arange(row_blocks), indptr[1:] - indptr[:-1])
    if torch.unique(rows * (col_blocks + 1) + indices).numel() != indices.numel():
        out.append(problem(f"{where}: a key block is listed twice in one block row"))
    if partial.shape != indices.shape:
        out.append(problem(f"{where}: partial must have one flag per index ({indices.numel()}), got {list(partial.shape)}"))
    return out


def check_flashinfer(plan: dict, tensors: dict, info: ModelInfo, *, tp: int | None = None) -> list[Finding]:
    """Findings of a FlashInfer plan file (module docstring)."""
    out = _plan_findings(plan, info) + _tp_findings(info, tp)
    if any(f.level == "problem" for f in out):
        return out
    row_blocks, col_blocks = -(-plan["tokens"] // plan["R"]), -(-plan["tokens"] // plan["C"])
    for layer in range(plan["num_layers"]):
        for head in range(plan["num_kv_heads"]):
            prefix = f"layers.{layer}.kv_heads.{head}."
            mine = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
            out += _bsr_findings(mine, f"layer {layer} KV head {head}", row_blocks, col_blocks)
            out += _lossy_note(plan, layer, head)
    return out


def _lossy_note(plan: dict, layer: int, head: int) -> list[Finding]:
    try:
        entry = plan["heads"][layer][head]
        lossy = entry["lossy_blocks"]
    except (IndexError, KeyError, TypeError):
        return [problem(f"layer {layer} KV head {head}: plan heads has no entry with lossy_blocks")]
    if not lossy:
        return []
    return [note(f"layer {layer} KV head {head} ({entry.get('pattern')}): {lossy} partial blocks need the window/sink mask; "
                 f"causal=True alone computes up to C - 1 more keys per row there")]


# ------------------------------------------------------------------------------------------ modelopt


def _sparsity_ok(value) -> bool:
    number = lambda x: not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x <= 1  # noqa: E731
    if isinstance(value, dict):
        return bool(value) and set(value) <= {"prefill", "decode"} and all(number(v) for v in value.values())
    return number(value)


def _group_findings(name: str, group, info: ModelInfo) -> list[Finding]:
    """One config group: algorithm, targets, ignore (layer names in range), target_sparsity."""
    import re

    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        return [problem(f"{where}: expected an object, got {type(group).__name__}")]
    out = []
    algorithm = group.get("algorithm")
    if not isinstance(algorithm, str):
        out.append(problem(f"{where}: algorithm must be a string, got {algorithm!r}"))
    elif algorithm not in modelopt.ALGORITHMS:
        out.append(note(f"{where}: algorithm {algorithm!r} is unknown to ModelOpt 0.47's reader and silently ignored"))
    elif algorithm == "skip_softmax" and "threshold_scale_factor" not in group:
        out.append(note(f"{where}: no threshold_scale_factor: ModelOpt's reader runs its SKIP_SOFTMAX_TRITON_DEFAULT preset "
                        f"and applies neither ignore nor target_sparsity"))
    targets = group.get("targets")
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        out.append(problem(f"{where}: targets must be a non-empty list of module class names, got {str(targets)[:60]}"))
    ignore = group.get("ignore", [])
    if not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
        return out + [problem(f"{where}: ignore must be a list of module names, got {str(ignore)[:60]}")]
    for entry in ignore:
        match = re.search(r"layers\.(\d+)(?:\.|$)", entry)
        if match is None:
            out.append(problem(f"{where}: ignore entry {entry!r} names no layer (layers.N)"))
        elif int(match.group(1)) >= info.num_layers:
            out.append(problem(f"{where}: ignore entry {entry!r}: layer out of range [0, {info.num_layers})"))
    if "target_sparsity" in group and not _sparsity_ok(group["target_sparsity"]):
        out.append(problem(f"{where}: target_sparsity must be in [0, 1] or {{prefill, decode}} of such, got {group['target_sparsity']!r}"))
    return out


def check_modelopt(config, where: str, info: ModelInfo) -> list[Finding]:
    """Findings of a ``sparse_attention_config`` block (or a config.json holding one)."""
    if isinstance(config, dict) and "sparse_attention_config" in config:
        config = config["sparse_attention_config"]
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object (a sparse_attention_config block), got {type(config).__name__}")
    groups = config.get("config_groups")
    if not (isinstance(groups, dict) and groups):
        return [problem("config_groups must be a non-empty object of groups")]
    out = []
    for name, group in groups.items():
        out += _group_findings(name, group, info)
    producer = config.get("producer")
    if not (isinstance(producer, dict) and isinstance(producer.get("name"), str)):
        out.append(problem(f"producer must be an object with a name, got {str(producer)[:60]}"))
    return out
