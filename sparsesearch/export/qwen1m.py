"""Qwen2.5-1M / Qwen3-2507-1M ``sparse_attention_config.json``: the per-head vertical-slash file that the dual-chunk
backends read (vLLM's ``DUAL_CHUNK_FLASH_ATTN`` up to 0.10.2, SGLang's dual-chunk backend 0.5.16-0.5.19).

The file has MInference's layout (a list per layer of ``{str(query head): [type, vertical_size, slash_size,
score]}``, see ``export.minference``) but those engines read it more strictly than MInference's own runtime
(docs/peers.md, "Where a searched artifact can be deployed"; vLLM
``vllm/attention/backends/dual_chunk_flash_attn.py``):

* every query head of every layer must be present: each tensor-parallel rank picks its heads out of the layer's
  dict by index, so a missing head is a KeyError, not MInference's VS(1000, 6096) fallback;
* only ``vertical_and_slash`` is accepted (anything else fails an assert);
* a vertical size of exactly 30 is read as 130, and sizes below 8 can overflow an index fallback path;
* the slash size sizes index buffers (heads x slash_size int64) *before* it is clamped to the prompt, so the
  MInference export's 2**30 "dense" pair would ask for 8 GiB per head; the vertical size is clamped first.

The export therefore writes only what those engines run exactly as our runtime does, and refuses the rest:

==============  ==============================================  ==================================================
pattern         entry                                           why it is exact
==============  ==============================================  ==================================================
vertical_slash  ["vertical_and_slash", v, s, score]             same estimate (last 64 queries, first 30 columns
                                                                and last 100 diagonals forced); refused when v is
                                                                30 (read as 130) or v or s is below 8
dense           ["vertical_and_slash", C, 100, score]           C = the model's context (max_position_embeddings):
                                                                the top-C columns of a prompt of at most C tokens
                                                                are all of its columns, so every key is kept; the
                                                                slash size is the forced 100 (any more is waste)
others          refused, naming the first (layer, head)         A-shape, block top-k, triangle (TriangleMix
                                                                layers), grid and a sliding layer's window have no
                                                                exact vertical-slash form
==============  ==============================================  ==================================================

``export.convert`` (``sparsesearch export --format qwen-1m --convert``) writes the refused kinds in their closest
vertical-slash form instead: that changes what the head computes, so (issue P14) the file is written only after
its KL against the artifact is measured on held-out text. Here it is a hook: ``export_qwen1m(convert=...)`` hands
each head without an exact entry to it.

A KV-space artifact is written per query head: a KV head's entry is repeated for each query head of its group.
The engines estimate lines per query head where our runtime estimates them once per KV group, so the lines can
differ between heads of one group (docs/deploying.md says so). Import (``export.minference.import_minference``)
reads the file back; a dense entry comes back as dense because a vertical size of at least the model's context
means every column there.

The engines need the model's ``config.json`` to hold a ``dual_chunk_attention_config``; current vLLM (V1)
rejects that key, so it is never written into a config here: ``dca_block`` returns the keys to merge by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..artifacts.io import Artifact
from ..artifacts.tables import to_query_heads
from ._common import effective_rows, write_file_atomic
from .minference import VS_FIXED, minference_json

FORMAT = "qwen-1m"
FILE_NAME = "sparse_attention_config.json"  # the name the engines look for beside config.json
TYPE = "vertical_and_slash"
REREAD_VERTICAL = (30, 130)  # the engines read a vertical size of exactly 30 as 130
MIN_SIZE = 8  # below this an engine's fallback index path can overflow
DENSE_SLASH = VS_FIXED["force_slash"]
ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")


def _where(row: dict) -> str:
    return f"layer {row['layer']} head {row['head']} ({row['pattern']})"


def _vs_refusal(row: dict) -> str | None:
    """Why the engines would run this vertical-slash row differently from our runtime, or None."""
    for name, value in VS_FIXED.items():
        if row[name] != value:
            return f"{FORMAT}: {_where(row)} has {name} {row[name]}; the engines fix {name} {value}"
    vertical, slash = row["vertical_size"], row["slash_size"]
    if vertical == REREAD_VERTICAL[0]:
        return f"{FORMAT}: {_where(row)} has vertical_size 30, which the engines read as 130"
    if min(vertical, slash) < MIN_SIZE:
        return f"{FORMAT}: {_where(row)} has a size below {MIN_SIZE} ({vertical}, {slash}), which can overflow the engines' fallback path"
    return None


def _dense_entry(row: dict, context: int | None) -> list:
    """A dense head as vertical-slash over every column of the model's context (module docstring)."""
    if context is None:
        raise ValueError(f"{FORMAT}: {_where(row)} is dense, which needs the model's context (max_position_embeddings) "
                         f"to be written exactly; the artifact's manifest has none")
    return [TYPE, context, DENSE_SLASH, row["score"]]


def _entry(row: dict, context: int | None, convert: Callable[[dict], list] | None) -> list:
    """The head's entry: exact, or ``convert(row)``'s when there is no exact one and a converter is given."""
    if row["boundary"] != "none":
        raise ValueError(f"{FORMAT}: {_where(row)} has boundary {row['boundary']!r}; the format has no boundaries")
    if row["pattern"] == "dense":
        return _dense_entry(row, context)
    if row["pattern"] == "vertical_slash" and _vs_refusal(row) is None:
        return [TYPE, row["vertical_size"], row["slash_size"], row["score"]]
    if convert is not None:
        return convert(row)
    if row["pattern"] == "vertical_slash":
        raise ValueError(_vs_refusal(row))
    raise ValueError(
        f"{FORMAT}: {_where(row)} has no exact vertical_and_slash form (the engines accept no other type); "
        f"--convert writes its closest form once its KL is measured"
    )


def export_qwen1m(artifact: Artifact, *, convert: Callable[[dict], list] | None = None) -> list[dict]:
    """The file's content: one dict per layer with an entry for every query head, or ValueError naming the first
    head the engines cannot run as the artifact does. ``convert(row) -> entry`` (``export.convert``): the entry
    of a query-head row (boundary none) that has no exact one; it raises ValueError for a head it refuses."""
    model = artifact.manifest["model"]
    rows, _ = effective_rows(artifact, FORMAT)
    config: list[dict] = [{} for _ in range(model["num_layers"])]
    for row in to_query_heads(list(rows.values()), artifact.manifest):  # sorted by (layer, head)
        config[row["layer"]][str(row["head"])] = _entry(row, model.get("max_position_embeddings"), convert)
    return config


def dca_block() -> dict:
    """The keys to merge by hand into ``dual_chunk_attention_config`` of the model's config.json (kept out of any
    file we write: current vLLM rejects the key). ``sparse_attention_last_q`` is the 64 every exported head uses;
    the model's own chunk_size / local_size / original_max_position_embeddings stay as it ships them."""
    return {"sparse_attention_enabled": True, "sparse_attention_last_q": VS_FIXED["last_q"]}


def architecture_note(artifact: Artifact) -> str | None:
    """A line when the artifact's model is not of the Qwen2/Qwen3 families, the only ones those backends serve."""
    arch = artifact.manifest["model"].get("architecture")
    if arch in ARCHITECTURES:
        return None
    return f"{FORMAT}: the dual-chunk backends serve Qwen2/Qwen3 models only; this artifact's model is {arch}"


def write_qwen1m(artifact: Artifact, out) -> Path:
    """Write the file at ``out`` whole or not at all; nothing is written when any head is refused."""
    return write_file_atomic(out, minference_json(export_qwen1m(artifact)).encode())
