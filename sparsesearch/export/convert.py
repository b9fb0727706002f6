"""A measured conversion to the qwen-1m file (issue P14 §1): heads the dual-chunk engines cannot run exactly are
written in their closest ``vertical_and_slash`` form, and the file is kept only once that is measured.

The engines take one type (``export.qwen1m``): a head keeps ``vertical_size`` columns and ``slash_size`` diagonals
(offsets pos - j), ranked by the last 64 queries' attention, with the first columns and the nearest diagonals
forced (``patterns.vertical_slash.forced``). The closest form of another kind keeps as many lines as the head keeps
keys per row, so it costs about what the head cost; for the A-shape and triangle the forced lines (the first
columns, the nearest diagonals) lie inside the head's own sink and window:

==============  ====================================  =============================================================
pattern         vertical_size, slash_size             what is lost
==============  ====================================  =============================================================
ashape          sink, local                           the sink columns past the forced ones and the window's far
                                                      diagonals become data-chosen lines: kept where the last
                                                      queries attend there (the reason the head was an A-shape)
triangle        sink, window                          the same, and the dense last ``last`` rows: a vertical-slash
                                                      head keeps the same lines in every row
block_topk      (sink_blocks + k_blocks) x block_n,   best effort: the per-query-block choice of key blocks becomes
                max(block_m, block_n)                 one set of columns for every row (the same keys per row), the
                                                      slashes cover each row's own diagonal block
vertical_slash  its own sizes                         other last_q / force_* values become the engines' 64 / 30 /
                                                      100; sizes are moved as below
grid            refused                               its lines repeat every ``stride`` tokens, so their count grows
                                                      with the prompt where the file's sizes are fixed token counts,
                                                      and its horizontal lines (rows over every key) have no form
sliding layer   refused                               our runtime and import run the model's window there whatever
                                                      the file says, so the conversion could not be measured
==============  ====================================  =============================================================

Every size is then moved to one the engines read as written: up to ``MIN_SIZE`` (smaller ones can overflow their
fallback path), a vertical size of 30 to 31 (they read 30 as 130; one more column still covers the sinks), and down
to the model's context (a line past it holds no key; a vertical size reaching it reads back as dense, which it is).

Measurement (``measure``): the written text is read back by ``import_minference`` into an artifact (checked like
any artifact), and the original artifact and the converted one run through our runtime on the same held-out
prompts, compared with one dense run through ``fidelity.evaluate_against`` (the KL of ``quality``). Every prompt
runs sparse (``MEASURE_MIN_TOKENS``): the engines' own threshold (32768 tokens) is a deployment setting, and a
prompt run dense would hide the difference being measured.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..artifacts.io import Artifact
from ..models.info import ModelInfo
from ..patterns.vertical_slash import VerticalSlashParams
from .minference import VS_FIXED, minference_json
from .qwen1m import FORMAT, MIN_SIZE, REREAD_VERTICAL, TYPE, export_qwen1m

MEASURE_MIN_TOKENS = 1  # the runtime's dense threshold during the measurement: every prompt runs sparse
DEFAULT_MAX_KL_INCREASE = 0.01  # nats per position: the bar sweep-spava sets a whole configuration, a fifth of probe-layers'


def _where(row: dict) -> str:
    return f"layer {row['layer']} head {row['head']} ({row['pattern']})"


def _sliding(row: dict, model: dict) -> bool:
    types = model.get("layer_types") or []
    return row["layer"] < len(types) and types[row["layer"]] == "sliding_attention"


def _lines(row: dict) -> tuple[int, int]:
    """(vertical, slash) lines of the head's closest form before the engines' size rules (module docstring's
    table); ValueError naming the head and the reason for a kind with no such form."""
    pattern = row["pattern"]
    if pattern == "ashape":
        return row["sink"], row["local"]  # the sink columns and the window's diagonals 0 .. local - 1
    if pattern == "triangle":
        return row["sink"], row["window"]  # its streaming rows are an A-shape; the dense last rows have no lines
    if pattern == "block_topk":
        # A row keeps its sink blocks and k scored blocks (that many keys) plus its own diagonal block, whose keys
        # lie at offsets below max(block_m, block_n) when one block size divides the other (as ours do).
        return (row["sink_blocks"] + row["k_blocks"]) * row["block_n"], max(row["block_m"], row["block_n"])
    if pattern == "vertical_slash":
        return row["vertical_size"], row["slash_size"]
    if pattern == "grid":
        raise ValueError(f"{FORMAT} --convert: {_where(row)} has no vertical_and_slash form: its lines repeat every "
                         f"{row['stride']} tokens, so their count grows with the prompt while the file's sizes are "
                         f"fixed token counts, and its horizontal lines (rows over every key) have none")
    raise ValueError(f"{FORMAT} --convert: {_where(row)}: no conversion to vertical_and_slash is defined for {pattern}")


def engine_sizes(vertical: int, slash: int, context: int | None) -> tuple[int, int]:
    """(vertical, slash) moved to sizes the engines read as written (module docstring): at least MIN_SIZE, at most
    the context, and a vertical size never 30."""
    vertical, slash = max(vertical, MIN_SIZE), max(slash, MIN_SIZE)
    if context is not None:
        vertical, slash = min(vertical, context), min(slash, context)
    if vertical == REREAD_VERTICAL[0]:
        vertical += 1
    return vertical, slash


def closest_params(row: dict, model: dict) -> VerticalSlashParams:
    """The closest vertical-slash params of a query-head row (boundary none) of the artifact's model (manifest
    ``model``), with the engines' fixed last_q / force_* values; ValueError naming the head for a refusal."""
    if _sliding(row, model):
        raise ValueError(f"{FORMAT} --convert: {_where(row)} is on a sliding-window layer, where our runtime and "
                         f"import-minference run the model's window whatever the file says: a conversion could not be measured")
    vertical, slash = engine_sizes(*_lines(row), model.get("max_position_embeddings"))
    return VerticalSlashParams(vertical_size=vertical, slash_size=slash, **VS_FIXED)


@dataclass(frozen=True)
class Converted:
    """The converted file: its text (what is written), and the query heads converted, by original pattern."""

    text: str
    kinds: dict[str, int]


def convert_qwen1m(artifact: Artifact) -> Converted:
    """The qwen-1m file of ``artifact`` with every head lacking an exact entry in its closest form (``closest_params``);
    ValueError naming the first head that has none. Nothing is measured here (``measure``)."""
    model = artifact.manifest["model"]
    kinds: Counter = Counter()

    def convert(row: dict) -> list:
        params = closest_params(row, model)
        kinds[row["pattern"]] += 1
        return [TYPE, params.vertical_size, params.slash_size, row["score"]]

    config = export_qwen1m(artifact, convert=convert)
    return Converted(minference_json(config), dict(sorted(kinds.items())))


def reimport(text: str, info: ModelInfo) -> Artifact:
    """The file's text read back as ``sparsesearch import-minference`` reads it, into an artifact written to a
    scratch directory and loaded with every artifact check (``load_artifact``). The directory is removed once
    loaded: the artifact's tables are in memory, its ``path`` names nothing."""
    from ..artifacts import load_artifact, write_artifact
    from ..json_input import parse_json
    from .minference import import_minference
    from .qwen1m import FILE_NAME

    manifest, tables = import_minference(parse_json(text.encode(), FILE_NAME), info)
    with tempfile.TemporaryDirectory(prefix="qwen1m-convert-") as scratch:
        return load_artifact(write_artifact(Path(scratch) / "converted", manifest, tables), model_info=info)


def measure(model, tokenizer, original: Artifact, converted: Artifact, *, data: str, samples: int, tokens: int,
            seed: int = 0, on_prompt: Callable[[str, int, int], None] | None = None) -> dict:
    """Teacher-forced KL(dense || artifact) and KL(dense || converted), each the mean over every position of the
    same ``samples`` held-out prompts of ``data`` (``tokens`` long), against one dense run. ``on_prompt(pass,
    done, total)`` after each prompt of the passes "dense", "artifact" and "converted". Returns eval_data,
    samples, tokens (the longest prompt), positions, kl_artifact, kl_converted and kl_increase (their
    difference: how much the conversion loses beyond what the artifact already does)."""
    from ..fidelity import evaluate_against, held_out_reference

    def progress(name: str):
        return None if on_prompt is None else (lambda done, total: on_prompt(name, done, total))

    reference = held_out_reference(model, tokenizer, data=data, samples=samples, tokens=tokens, seed=seed, on_prompt=progress("dense"))
    kl = {}
    for name, art in (("artifact", original), ("converted", converted)):
        report = evaluate_against(model, tokenizer, art.manifest, art.head_rows(), reference,
                                  min_tokens=MEASURE_MIN_TOKENS, on_prompt=progress(name))
        kl[name] = report["teacher_forced"]["kl_mean"]
    return {
        "eval_data": data, "samples": report["samples"], "tokens": report["tokens"],
        "positions": report["teacher_forced"]["tokens"], "kl_artifact": kl["artifact"], "kl_converted": kl["converted"],
        "kl_increase": round(kl["converted"] - kl["artifact"], 6),
    }


def refusal(result: dict, max_increase: float) -> str | None:
    """Why the converted file must not be written (its KL increase is past ``max_increase``, or a KL is not a
    finite number: then nothing was measured), or None."""
    numbers = f"KL(dense||converted) {result['kl_converted']:.6f} vs KL(dense||artifact) {result['kl_artifact']:.6f}"
    if not all(math.isfinite(result[k]) for k in ("kl_artifact", "kl_converted")):
        return f"{FORMAT} --convert: the measurement gave {numbers}; nothing written"
    if result["kl_increase"] > max_increase:
        return (f"{FORMAT} --convert: {numbers}, an increase of {result['kl_increase']:.6f} > --max-kl-increase "
                f"{max_increase:g}; nothing written")
    return None
