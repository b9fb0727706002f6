"""DuoAttention-style head table: which KV heads keep full attention and which can stream.

Output: tab-separated text, one line per layer, one column per KV head: ``1`` = dense / retrieval head
(full KV cache), ``0`` = streaming head (attention sinks + recent window: the patterns whose registry fact
STREAMING is set, ashape and triangle).
DuoAttention decides per KV head, so a KV head is 0 only when every row that applies to it streams:
every query head of its GQA group (query-space artifacts) and every modality pair. Any other pattern
(vertical_slash, block_topk, grid, dense) counts as 1. Rows are read as the runtime reads them: every
head of a TriangleMix layer (methods.trianglemix.start_layer and deeper) streams, a head with no row is
dense. Boundaries do not matter here.

Hybrid models (Gemma 3): a sliding-window layer's KV heads are ``0`` — they keep only a recent window (sink 0,
recent = the model's sliding_window), which is what a DuoAttention streaming head is. The table carries no
sizes: DuoAttention applies its own global sink/recent to every streaming head, so a deployment must keep
the model's window on those layers (recorded in the artifact's model.sliding_window), not Duo's recent size.
"""

from __future__ import annotations

from pathlib import Path

from ..artifacts.io import Artifact
from ..artifacts.tables import to_query_heads
from ..patterns.registry import REGISTRY
from ._common import effective_rows, write_file_atomic


def export_duo(artifact: Artifact) -> list[list[int]]:
    """[num_layers][num_kv_heads] of 0 (streaming) / 1 (full attention)."""
    model = artifact.manifest["model"]
    layers, heads, kv_heads = model["num_layers"], model["num_heads"], model["num_kv_heads"]
    group = heads // kv_heads
    text, pairs = effective_rows(artifact, "duo", modality_rows=True)
    streams: dict[tuple[int, int], bool] = {}
    for row in to_query_heads([*text.values(), *pairs], artifact.manifest):
        key = (row["layer"], row["head"])
        streams[key] = streams.get(key, True) and REGISTRY[row["pattern"]].STREAMING
    return [
        [0 if all(streams[(layer, kv * group + g)] for g in range(group)) else 1 for kv in range(kv_heads)]
        for layer in range(layers)
    ]


def duo_tsv(table: list[list[int]]) -> str:
    return "".join("\t".join(str(v) for v in row) + "\n" for row in table)


def write_duo(artifact: Artifact, out) -> Path:
    return write_file_atomic(out, duo_tsv(export_duo(artifact)).encode())
