"""FlashInfer block-sparse plans: per layer and KV head, the BSR lists (``indptr``, ``indices``) of the blocks our
kernel computes at one declared length, for ``BlockSparseAttentionWrapper.plan`` (one (R, C) for every block) or,
as a block mask, ``VariableBlockSparseAttentionWrapper.plan`` (per KV head).

What is exported (docs/peers.md "Where a searched artifact can be deployed"; docs/deploying.md):

* static patterns only, at ``tokens`` query rows = key columns (a BSR plan is fixed before the prompt is seen):
  ashape, grid, dense, triangle (TriangleMix layers) and the window rows of a hybrid model's sliding layers. Dynamic
  ones (vertical_slash, block_topk) are estimated from each prompt's Q and K and are refused, naming the head;
* each head's index is built exactly as the runtime builds it (``execute.static_index`` with the row's own block
  sizes) and cut to the finest block size of the artifact (R = smallest block_m, C = smallest block_n; block sizes
  are powers of two, so R and C divide every row's blocks); full and partial blocks both become BSR entries;
* triangle: the streaming part and the dense last rows are one BSR (a query block holding a row at or past
  ``split_row`` lists every causal key block), as the FlexAttention export merges them;
* a query-space artifact must give the query heads of one KV group the same blocks and token mask: FlashInfer
  plans per KV head (query heads of a group share it); groups that differ are refused, naming them.

What a BSR cannot say: a partial block's token mask. FlashInfer's ``causal=True`` supplies the diagonal; the window
edge (ashape's local window, a sliding layer's window, triangle's window) and the sink edge inside a partial block
are lost, so FlashInfer computes up to C - 1 extra keys per row there (a superset of our kernel's keys) and the
rows of triangle's first dense query block that precede ``split_row`` see every causal key of their block row.
Each KV head's ``lossy_blocks`` in the plan counts the partial blocks where ``causal=True`` differs from our token
mask (0: the plan is exact with ``causal=True``). ``BlockSparseAttentionWrapper.plan`` also takes a per-block
``mask``; building it from ``window``/``sink``/``dense_from_row`` is not done here.

File (one .safetensors, no pickle): tensors ``layers.{L}.kv_heads.{H}.indptr`` int32 [MB + 1],
``.indices`` int32 [nnz] (ascending per block row), ``.partial`` bool [nnz] (the block needs a token mask); header
metadata ``format``, ``version`` and ``plan``: a JSON object with ``tokens``, ``R``, ``C``, ``num_layers``,
``num_qo_heads``, ``num_kv_heads``, ``causal`` (true) and ``heads[L][H]`` = pattern, window, sink,
dense_from_row, lossy_blocks. MB = ceil(tokens / R); the last block row (and column) is partial when R (C) does not
divide tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..artifacts.columns import PARAM_COLUMNS, params_from_row
from ..artifacts.io import Artifact
from ..execute import HeadGroup, static_index
from ..index import num_blocks
from ..json_input import parse_json
from ..patterns.registry import REGISTRY
from ._common import effective_rows, read_tagged_safetensors, write_file_atomic
from .flex import _pack_head

FORMAT = "sparsesearch-flashinfer"
NAME = "flashinfer"
VERSION = "1"
TENSORS = ("indptr", "indices", "partial")
BUILD_BYTES_PER_CELL = 32  # a head's build holds a few bool [QB, KB] masks and an int64 scatter of one


def _where(row: dict) -> str:
    return f"layer {row['layer']} head {row['head']} ({row['pattern']})"


def block_sizes(artifact: Artifact) -> tuple[int, int]:
    """(R, C): the finest block_m and block_n of the rows the runtime runs (stored and implied)."""
    rows = effective_rows(artifact, NAME)[0].values()
    return min(row["block_m"] for row in rows), min(row["block_n"] for row in rows)


def plan_bytes(artifact: Artifact, tokens: int) -> int:
    """An upper bound on the memory of an export at ``tokens``: one head's build, plus the lists of every KV head
    of every layer if every block were listed (int32 index + bool flag a block)."""
    r, c = block_sizes(artifact)
    cells = num_blocks(tokens, r) * num_blocks(tokens, c)
    model = artifact.manifest["model"]
    return cells * BUILD_BYTES_PER_CELL + cells * 5 * model["num_layers"] * model["num_kv_heads"]


def _head_blocks(row: dict, tokens: int, r: int, c: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """One head's (full, partial) bool [QB, KB] at (R, C) and its token mask (window, sink, dense_from_row)."""
    group = HeadGroup(row["pattern"], params_from_row(row), (row["head"],), row["block_m"], row["block_n"])
    index = static_index(group, tokens, tokens, "query", torch.device("cpu"))
    full, partial, _, _, mask = _pack_head(index, row, tokens, tokens, r, c)
    return full[0, 0], partial[0, 0], tuple(int(x) for x in mask)


def refuse_unplannable(row: dict) -> None:
    """ValueError (one line) for a row a static BSR plan cannot carry: a boundary head, a dynamic pattern."""
    if row["boundary"] != "none":
        raise ValueError(f"{NAME}: {_where(row)} has boundary {row['boundary']!r} (a token permutation); "
                         f"a BSR plan has none; --global-only exports its global pattern")
    if REGISTRY[row["pattern"]].DYNAMIC:
        raise ValueError(f"{NAME}: {_where(row)} is estimated from each prompt's Q and K; a BSR plan is fixed "
                         f"before the prompt is seen, so only static patterns can be exported")


def lossy_blocks(partial: torch.Tensor, mask: tuple[int, int, int], tokens: int, r: int, c: int) -> torch.Tensor:
    """bool [QB, KB]: partial blocks holding a causal (row, key) our token mask drops, which ``causal=True`` keeps.

    Our mask drops key k for row p when k <= p, k >= sink, p < dense_from_row and p - k >= window. In a block
    the pair most likely dropped is the latest row before dense_from_row against the first key at or past sink.
    """
    window, sink, dense_from = mask
    if window < 0:
        return torch.zeros_like(partial)
    rows = torch.arange(partial.shape[0]) * r
    lo = torch.arange(partial.shape[1]) * c
    hi = torch.clamp(lo + c, max=tokens) - 1
    last = torch.minimum(torch.clamp(rows + r, max=tokens) - 1, torch.tensor(dense_from - 1))
    key = torch.clamp(lo, min=sink)
    has_row = (last >= rows)[:, None]
    reach = (key <= hi)[None, :] & (key[None, :] <= last[:, None])
    return partial & has_row & reach & (last[:, None] - key[None, :] >= window)


def to_bsr(listed: torch.Tensor, partial: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block mask bool [QB, KB] -> indptr int32 [QB + 1], indices int32 [nnz] (row-major, ascending per row) and
    partial bool [nnz] (``partial`` read at those blocks)."""
    counts = listed.sum(-1, dtype=torch.int32)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0, dtype=torch.int32)])
    rows, cols = listed.nonzero(as_tuple=True)  # row-major order: rows ascending, columns ascending within a row
    return {"indptr": indptr, "indices": cols.to(torch.int32), "partial": partial[rows, cols]}


def from_bsr(indptr: torch.Tensor, indices: torch.Tensor, kv_blocks: int) -> torch.Tensor:
    """indptr [MB + 1], indices [nnz] -> bool [MB, kv_blocks] (the inverse of ``to_bsr`` for the block part)."""
    rows = torch.repeat_interleave(torch.arange(indptr.numel() - 1), (indptr[1:] - indptr[:-1]).long())
    out = torch.zeros(indptr.numel() - 1, kv_blocks, dtype=torch.bool)
    out[rows, indices.long()] = True
    return out


def _group_rows(artifact: Artifact) -> dict[tuple[int, int], list[dict]]:
    """(layer, KV head) -> the effective rows FlashInfer must run as one pattern: the KV head's own row, or the
    rows of its group's query heads."""
    model = artifact.manifest["model"]
    rows, _ = effective_rows(artifact, NAME)
    group = 1 if artifact.head_index_space == "kv" else model["num_heads"] // model["num_kv_heads"]
    out: dict[tuple[int, int], list[dict]] = {}
    for (layer, head), row in sorted(rows.items()):
        out.setdefault((layer, head // group), []).append(row)
    return out


def _signature(row: dict) -> tuple:
    return (row["pattern"], row["block_m"], row["block_n"], *(row[c] for c in PARAM_COLUMNS))


def export_flashinfer(artifact: Artifact, tokens: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(plan JSON object, tensors by name) of the artifact at ``tokens`` (module docstring), or ValueError naming
    the first head or KV group FlashInfer cannot run as our kernel does."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{NAME}: tokens must be a positive int, got {tokens!r}")
    model = artifact.manifest["model"]
    r, c = block_sizes(artifact)
    built: dict[tuple, tuple] = {}
    heads = [[None] * model["num_kv_heads"] for _ in range(model["num_layers"])]
    tensors: dict[str, torch.Tensor] = {}
    for (layer, kv_head), rows in _group_rows(artifact).items():
        results = [_cached(built, row, tokens, r, c) for row in rows]
        _same_in_group(rows, results, layer, kv_head)
        full, partial, mask = results[0]
        lossy = lossy_blocks(partial, mask, tokens, r, c)
        for name, value in to_bsr(full | partial, partial).items():
            tensors[f"layers.{layer}.kv_heads.{kv_head}.{name}"] = value
        heads[layer][kv_head] = {"pattern": rows[0]["pattern"], "window": mask[0], "sink": mask[1],
                                 "dense_from_row": mask[2], "lossy_blocks": int(lossy.sum())}
    plan = {"tokens": tokens, "R": r, "C": c, "num_layers": model["num_layers"], "num_qo_heads": model["num_heads"],
            "num_kv_heads": model["num_kv_heads"], "causal": True, "heads": heads}
    return plan, tensors


def _cached(built: dict, row: dict, tokens: int, r: int, c: int) -> tuple:
    """``_head_blocks`` once per distinct static row (a static index depends on its params and blocks only)."""
    refuse_unplannable(row)
    key = _signature(row)
    if key not in built:
        built[key] = _head_blocks(row, tokens, r, c)
    return built[key]


def _same_in_group(rows: list[dict], results: list[tuple], layer: int, kv_head: int) -> None:
    """FlashInfer plans one pattern per KV head: every query head of the group must compute the same blocks
    under the same token mask."""
    first_full, first_partial, first_mask = results[0]
    for row, (full, partial, mask) in zip(rows[1:], results[1:]):
        if mask != first_mask or not (torch.equal(full, first_full) and torch.equal(partial, first_partial)):
            raise ValueError(f"{NAME}: layer {layer} KV head {kv_head}: query heads {rows[0]['head']} ({rows[0]['pattern']}) "
                             f"and {row['head']} ({row['pattern']}) differ; FlashInfer plans one pattern per KV head")


def flashinfer_file_bytes(plan: dict, tensors: dict[str, torch.Tensor], *, artifact: str = "") -> bytes:
    """safetensors bytes: the tensors, and the plan JSON in the header metadata (the export stays one file)."""
    from safetensors.torch import save

    meta = {"format": FORMAT, "version": VERSION, "plan": json.dumps(plan, sort_keys=True), "artifact": artifact}
    return save({name: t.contiguous() for name, t in tensors.items()}, metadata=meta)


def write_flashinfer(artifact: Artifact, out, tokens: int) -> tuple[Path, dict]:
    """Write the plan file at ``out`` whole or not at all; (path, plan). Nothing is written when a head is refused."""
    plan, tensors = export_flashinfer(artifact, tokens)
    return write_file_atomic(out, flashinfer_file_bytes(plan, tensors, artifact=artifact.path.name)), plan


def load_flashinfer(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(plan, tensors by name) of a file ``write_flashinfer`` wrote; ValueError (one line) for anything else."""
    meta, tensors = read_tagged_safetensors(path, FORMAT)
    plan = parse_json(meta.get("plan", "").encode(), f"{Path(path).name} plan metadata")
    if not isinstance(plan, dict):
        raise ValueError(f"{Path(path).name}: plan metadata must be a JSON object, got {type(plan).__name__}")
    return plan, tensors


def variable_plan_inputs(plan: dict, tensors: dict[str, torch.Tensor], layer: int):
    """One layer as ``VariableBlockSparseAttentionWrapper.plan`` inputs: block_mask_map bool [Hkv, MB, NB],
    block_row_sz int32 [Hkv, MB], block_col_sz int32 [Hkv, NB] (the last block of each shortened to the length)."""
    tokens, r, c, kv_heads = plan["tokens"], plan["R"], plan["C"], plan["num_kv_heads"]
    kv_blocks = num_blocks(tokens, c)
    masks = [from_bsr(tensors[f"layers.{layer}.kv_heads.{h}.indptr"], tensors[f"layers.{layer}.kv_heads.{h}.indices"], kv_blocks)
             for h in range(kv_heads)]
    rows = torch.full((num_blocks(tokens, r),), r, dtype=torch.int32)
    rows[-1] = tokens - r * (rows.numel() - 1)
    cols = torch.full((kv_blocks,), c, dtype=torch.int32)
    cols[-1] = tokens - c * (kv_blocks - 1)
    return torch.stack(masks), rows.expand(kv_heads, -1).clone(), cols.expand(kv_heads, -1).clone()
