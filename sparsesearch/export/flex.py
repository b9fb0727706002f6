"""FlexAttention BlockMask from an artifact: the blocks our kernels compute, per query head, for one layer.

``flex_block_mask(artifact, q, k, layer, block=128)`` builds each head's BlockIndex with its pattern's own
``build_index`` (dynamic patterns estimate from ``q``/``k``; heads with equal static params share one
build) and packs them with ``BlockMask.from_kv_blocks``. It never calls ``create_block_mask`` and never
builds a token x token mask: everything is block level, [B, H, QB, KB], plus per-head [B, H, kv_len]
column flags when vertical_slash gathers columns.

What the mask admits is what the kernels compute (index.py semantics, query rows bottom-right aligned,
``pos = q_idx + kv_len - q_len``):

* index *full* blocks -> FlexAttention full blocks (no mask_mod);
* index *partial* blocks -> partial blocks; mask_mod = causal and the token mask of the head's index
  (``window < 0`` or ``pos - kv < window`` or ``kv < sink``: ashape and triangle);
* gathered columns (vertical_slash verticals outside every listed block) -> the key blocks holding them
  become partial blocks ("column blocks") whose mask_mod admits only causal column keys;
* triangle: rows at or after ``split_row`` attend every causal key (the split-K kernel's dense rows), so
  their query blocks list every causal block and the mask_mod lets those rows through the window test.

mask_mod alone is also exact everywhere (it looks up a per-block code table), so FlexAttention's eager
path, which ignores the block lists and evaluates mask_mod on every pair, gives the same result.

Block sizes: each head's index is built with its row's block_m / block_n, exactly as the runtime does;
the mask tables live at the finest block size in play (``code_block``), and FlexAttention's tiles
(``block``, default 128) are pooled from them, so the tile size never changes which keys are admitted.

Tensors (``flex_tensors``; the CLI saves them per layer in a .safetensors file as ``layers.{L}.{name}``):

======================  ================  ================================================================
name                    dtype, shape      meaning
======================  ================  ================================================================
kv_num_blocks           int32 [B, H, QT]  FlexAttention partial tiles per query tile (mask_mod applies)
kv_indices              int32 [B,H,QT,P]  their key-tile ids, ascending, 0-padded
full_kv_num_blocks      int32 [B, H, QT]  FlexAttention full tiles (no mask_mod)
full_kv_indices         int32 [B,H,QT,F]
code_full_count / _idx  int32             mask table at code_block: index full blocks,
code_partial_count/_idx int32             index partial blocks (token mask applies),
code_col_count / _idx   int32             blocks reached only through gathered columns
columns                 bool  [B, H, Nk]  gathered column keys (only when some head has them)
window, sink            int32 [H]         token mask of partial blocks (window -1: off)
dense_from_row          int32 [H]         first query row attending every causal key (q_len: none)
seq_lengths             int64 [2]         (q_len, kv_len)
block_size              int64 [1]         FlexAttention tile (Q and KV)
code_block              int64 [2]         (block_m, block_n) of the mask table
======================  ================  ================================================================

Turning a saved layer into a BlockMask: ``block_mask_from_tensors(load_flex(path)[layer])``. By hand: pad
the last dim of kv_indices / full_kv_indices with zeros to ceil(kv_len / block) and call
``BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
BLOCK_SIZE=block, mask_mod=..., seq_lengths=(q_len, kv_len))`` with a mask_mod that looks up the code
table (full: admit; partial: causal and token mask; column block: causal and ``columns``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..artifacts.columns import PARAM_COLUMNS, params_from_row
from ..artifacts.io import Artifact
from ..execute import HeadGroup, build_group_index, static_index
from ..index import BLOCK_SIZES, BlockIndex, num_blocks, pack_lists, to_block_masks
from ..patterns._common import query_block_bounds
from ..patterns.registry import REGISTRY
from ._common import effective_rows, read_tagged_safetensors, write_file_atomic

FORMAT = "sparsesearch-flex"
FULL, PARTIAL, COLUMN = 1, 2, 3


# ------------------------------------------------------------------------------------------- building


def _layer_rows(artifact: Artifact, layer: int) -> list[dict]:
    """Rows of one layer, one per head of the artifact's head space, in head order (as the runtime reads
    them: TriangleMix layers are triangle, heads without a row dense)."""
    model = artifact.manifest["model"]
    if not isinstance(layer, int) or not 0 <= layer < model["num_layers"]:
        raise ValueError(f"layer must be in [0, {model['num_layers']}), got {layer!r}")
    rows, _ = effective_rows(artifact, "flex")
    heads = model["num_heads"] if artifact.head_index_space == "query" else model["num_kv_heads"]
    out = []
    for head in range(heads):
        row = rows[(layer, head)]
        if row["boundary"] != "none":
            raise ValueError(f"layer {layer} head {head}: boundary {row['boundary']!r} (token permutation) has no FlexAttention export")
        out.append(row)
    return out


def _union_columns(index: BlockIndex, kv_len: int) -> torch.Tensor:
    """bool [B, H, kv_len]: every key gathered as a column by any query block (no [QB, Nk] tensor)."""
    out = torch.zeros(*index.full_count.shape[:2], kv_len + 1, dtype=torch.bool, device=index.device)
    if index.col_count is None:
        return out[..., :kv_len]
    valid = torch.arange(index.col_idx.shape[-1], device=index.device) < index.col_count.unsqueeze(-1)
    target = torch.where(valid, index.col_idx.long(), torch.full_like(index.col_idx, kv_len, dtype=torch.long))
    out.scatter_(-1, target.flatten(2), True)
    return out[..., :kv_len]


def _column_blocks(
    listed: torch.Tensor, columns: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key blocks each query block reaches only through gathered columns, and how many columns that is.

    listed bool [B, H, QB, KB] (full | partial), columns bool [B, H, Nk]. A column counts for query block m
    when it is causal for m's last row and its block is not listed for m (index.py's column rule).
    Returns (column blocks bool [B, H, QB, KB], column count int32 [B, H, QB]). Memory O(QB x columns).
    """
    batch, heads, q_blocks, kv_blocks = listed.shape
    count, ids = pack_lists(columns)  # [B, H], [B, H, U]
    ids = ids.long()
    valid = torch.arange(ids.shape[-1], device=ids.device) < count.unsqueeze(-1)
    _, last = query_block_bounds(q_len, kv_len, block_m, ids.device)
    blk = (ids // block_n).clamp(max=kv_blocks - 1)
    covered = listed.gather(-1, blk[:, :, None, :].expand(batch, heads, q_blocks, -1))
    keep = valid[:, :, None, :] & ~covered & (ids[:, :, None, :] <= last[None, None, :, None])
    out = torch.zeros(batch, heads, q_blocks, kv_blocks + 1, dtype=torch.bool, device=ids.device)
    out.scatter_(-1, torch.where(keep, blk[:, :, None, :], kv_blocks), True)
    return out[..., :kv_blocks], keep.sum(-1, dtype=torch.int32)


def _head_index(row: dict, q, k, head: int, space: str, geometry: tuple) -> BlockIndex:
    """The head's index exactly as the runtime builds it (execute.py): the row's pattern, params and block
    sizes; a static pattern's for batch 1 (it is the same for every batch row)."""
    q_len, kv_len, device = geometry
    g = HeadGroup(row["pattern"], params_from_row(row), (head,), row["block_m"], row["block_n"])
    if not REGISTRY[g.pattern].DYNAMIC:
        return static_index(g, q_len, kv_len, space, device)
    if q is None:
        raise ValueError(
            f"layer {row['layer']} head {head} uses {row['pattern']}, which is estimated from Q and K: "
            "give q and k (CLI: --prompt SPEC --model M captures them from the model on one prompt, or --qk FILE)"
        )
    return build_group_index(g, q, k, space)


def _upsample(mask: torch.Tensor, rq: int, rk: int, q_blocks: int, kv_blocks: int) -> torch.Tensor:
    """Block mask [..., QB, KB] at (bm, bn) -> [..., q_blocks, kv_blocks] at (bm / rq, bn / rk)."""
    return mask.repeat_interleave(rq, dim=-2).repeat_interleave(rk, dim=-1)[..., :q_blocks, :kv_blocks]


def _reachable(window: int, sink: int, dense_from: int, q_len: int, kv_len: int, cq: int, ck: int, device) -> torch.Tensor:
    """bool [QB, KB] at (cq, ck): the block holds some (row, key) the token mask of a partial block admits."""
    first, last = query_block_bounds(q_len, kv_len, cq, device)
    lo = torch.arange(num_blocks(kv_len, ck), device=device, dtype=torch.int64)[None, :] * ck
    hi = torch.clamp(lo + ck - 1, max=kv_len - 1)
    first, last = first[:, None], last[:, None]
    causal = lo <= last
    token = torch.ones_like(causal) if window < 0 else (first - hi < window) | (lo < sink)
    dense_rows = (last - (kv_len - q_len) >= dense_from)
    return causal & (token | dense_rows)


def flex_tensors(
    artifact: Artifact,
    layer: int,
    *,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
    block: int = 128,
) -> dict[str, torch.Tensor]:
    """Block lists and mask tables of one layer in query-head space (see the module docstring).

    q [B, Hq, Nq, D] and k [B, Hkv, Nk, D] (post-RoPE) are needed when the layer has a dynamic pattern
    (vertical_slash, block_topk); for static layers ``q_len`` (and ``kv_len``, default q_len) suffice, B = 1.
    Each head's index uses the row's own block_m / block_n (what the kernels run); ``block`` is only
    FlexAttention's tile, so any of 16..128 reproduces the same mask.
    """
    model = artifact.manifest["model"]
    q_heads, kv_heads = model["num_heads"], model["num_kv_heads"]
    group = q_heads // kv_heads
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {list(BLOCK_SIZES)}, got {block}")
    if (q is None) != (k is None):
        raise ValueError("give both q and k, or neither")
    if q is not None:
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0]:
            raise ValueError(f"q must be [B, Hq, Nq, D] and k [B, Hkv, Nk, D], got {tuple(q.shape)} and {tuple(k.shape)}")
        if q.shape[1] != q_heads or k.shape[1] != kv_heads:
            raise ValueError(f"the model has {q_heads} query and {kv_heads} KV heads, q and k have {q.shape[1]} and {k.shape[1]}")
        batch, q_len, kv_len, device = q.shape[0], q.shape[2], k.shape[2], q.device
    else:
        if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
            raise ValueError(f"q_len must be a positive int when q and k are not given, got {q_len!r}")
        batch, device = 1, torch.device("cpu")
        kv_len = q_len if kv_len is None else kv_len
    if isinstance(kv_len, bool) or not isinstance(kv_len, int) or kv_len < q_len:
        raise ValueError(f"kv_len must be an int >= q_len ({q_len}), got {kv_len!r}")
    rows = _layer_rows(artifact, layer)
    space = artifact.head_index_space
    # Mask tables live at the finest block size in play (all sizes are powers of two, so it divides the rest).
    cq = min([block] + [r["block_m"] for r in rows])
    ck = min([block] + [r["block_n"] for r in rows])
    fine = (num_blocks(q_len, cq), num_blocks(kv_len, ck))

    full = torch.zeros(batch, q_heads, *fine, dtype=torch.bool, device=device)
    partial = torch.zeros_like(full)
    colblk = torch.zeros_like(full)
    columns = None
    window = torch.full((q_heads,), -1, dtype=torch.int32)
    sink = torch.zeros(q_heads, dtype=torch.int32)
    dense_from = torch.full((q_heads,), q_len, dtype=torch.int32)
    shared: dict[tuple, tuple] = {}
    for head, row in enumerate(rows):
        targets = [head] if space == "query" else list(range(head * group, (head + 1) * group))
        # Static patterns depend only on their params and blocks: heads with equal rows share one build.
        signature = None if REGISTRY[row["pattern"]].DYNAMIC else (row["pattern"], row["block_m"], row["block_n"], *(row[c] for c in PARAM_COLUMNS))
        built = shared.get(signature) if signature is not None else None
        if built is None:
            index = _head_index(row, q, k, head, space, (q_len, kv_len, device))
            built = _pack_head(index, row, q_len, kv_len, cq, ck)
            if signature is not None:
                shared[signature] = built
        f, p, c, cols, (w, s, d) = built
        full[:, targets], partial[:, targets], colblk[:, targets] = f, p, c
        if cols is not None:
            if columns is None:
                columns = torch.zeros(batch, q_heads, kv_len, dtype=torch.bool, device=device)
            columns[:, targets] = cols
        window[targets], sink[targets], dense_from[targets] = w, s, d

    flex_full, flex_partial = _pool(full, partial | colblk, q_len, kv_len, cq, ck, block)
    out = {}
    for prefix, mask in (("kv", flex_partial), ("full_kv", flex_full)):
        count, idx = pack_lists(mask)
        out[f"{prefix}_num_blocks"], out[f"{prefix}_indices"] = count, idx
    for prefix, mask in (("code_full", full), ("code_partial", partial), ("code_col", colblk)):
        count, idx = pack_lists(mask)
        out[f"{prefix}_count"], out[f"{prefix}_idx"] = count, idx
    out.update({
        "window": window.to(device), "sink": sink.to(device), "dense_from_row": dense_from.to(device),
        "seq_lengths": torch.tensor([q_len, kv_len], dtype=torch.int64, device=device),
        "block_size": torch.tensor([block], dtype=torch.int64, device=device),
        "code_block": torch.tensor([cq, ck], dtype=torch.int64, device=device),
    })
    if columns is not None:
        out["columns"] = columns
    return out


def captured_flex(artifact: Artifact, model, sample, *, block: int = 128, info=None) -> dict[int, dict[str, torch.Tensor]]:
    """``flex_tensors`` of every layer on one prompt's own post-RoPE q/k, captured from ``model`` as it runs the
    prompt (models.capture_qkv, one layer at a time, so only one layer's q/k is held): what a dynamic head's
    block lists are on that prompt. sample: a data Sample (input_ids [N]). Returns {layer: tensors}."""
    from ..models import capture_qkv

    per_layer: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(layer: int, cap) -> None:
        per_layer[layer] = flex_tensors(artifact, layer, q=cap.q, k=cap.k, block=block)

    device = next(model.parameters()).device
    with torch.no_grad():
        capture_qkv(model, sample.input_ids[None].to(device), on_layer=on_layer, to_cpu=True, info=info)
    return per_layer


def flex_bytes(artifact: Artifact, q_len: int, kv_len: int | None = None, block: int = 128) -> int:
    """A lower bound on the memory ``flex_tensors`` takes for one layer at these lengths: per query head, its
    full / partial / column block masks at the finest block size in play (1 byte a cell each) and the sort
    that packs them into lists (int32 keys, int32 values, int64 positions: 16 bytes a cell). What the lists
    keep depends on the patterns and is not counted, so a refusal on this bound is never wrong."""
    heads = artifact.heads
    cq = min([block, *heads["block_m"].astype(int).tolist()])
    ck = min([block, *heads["block_n"].astype(int).tolist()])
    kv_len = q_len if kv_len is None else kv_len
    cells = num_blocks(q_len, cq) * num_blocks(kv_len, ck)
    return artifact.manifest["model"]["num_heads"] * cells * (3 + 16)


def _pool(full: torch.Tensor, listed: torch.Tensor, q_len: int, kv_len: int, cq: int, ck: int, block: int):
    """Fine block masks [B, H, QB, KB] at (cq, ck) -> FlexAttention's (block, block) tiles: full when every
    fine block of the tile is full (fine blocks past kv_len are not), partial when any is listed otherwise."""
    batch, heads, fq, fk = full.shape
    q_tiles, kv_tiles = num_blocks(q_len, block), num_blocks(kv_len, block)
    rq, rk = block // cq, block // ck
    padded_full = torch.ones(batch, heads, q_tiles * rq, kv_tiles * rk, dtype=torch.bool, device=full.device)
    padded_full[..., :fq, :fk] = full
    padded_full[..., fk:] = False  # fine blocks past kv_len
    padded_any = torch.zeros_like(padded_full)
    padded_any[..., :fq, :fk] = full | listed
    shape = (batch, heads, q_tiles, rq, kv_tiles, rk)
    tile_full = padded_full.view(shape).all(5).all(3)
    tile_any = padded_any.view(shape).any(5).any(3)
    return tile_full, tile_any & ~tile_full


def _pack_head(index: BlockIndex, row: dict, q_len: int, kv_len: int, cq: int, ck: int):
    """Fine (cq, ck) masks of one head: (full, partial, column blocks [B', 1, QB, KB], columns [B', 1, Nk] or
    None, (window, sink, dense_from_row))."""
    bm, bn = index.block_m, index.block_n
    fine = (num_blocks(q_len, cq), num_blocks(kv_len, ck))
    full_r, partial_r = to_block_masks(index, num_blocks(kv_len, bn))  # [B', 1, QB, KB]: one head's lists
    columns = None
    if index.col_count is not None and bool((index.col_count > 0).any()):
        columns = _union_columns(index, kv_len)
        _, count = _column_blocks(full_r | partial_r, columns, q_len, kv_len, bm, bn)
        if not torch.equal(count, index.col_count.to(count.dtype)):
            raise ValueError(
                f"layer {row['layer']} head {row['head']}: the index's gathered columns differ between query blocks "
                "beyond what causality and block coverage explain; FlexAttention export cannot carry them"
            )
    full = _upsample(full_r, bm // cq, bn // ck, *fine)
    partial = _upsample(partial_r, bm // cq, bn // ck, *fine)
    dense_from = q_len
    if row["pattern"] == "triangle":
        from sparsesearch.patterns import dense

        dense_from = int(index.meta["split_row"])
        d_full, d_partial = to_block_masks(dense.build_index(None, q_len, kv_len, block_m=cq, block_n=ck, device=full.device), fine[1])
        first_row = torch.arange(fine[0], device=full.device) * cq
        last_row = torch.clamp(first_row + cq, max=q_len) - 1
        merged_full = full | (d_full & (first_row >= dense_from)[:, None])
        partial = (full | partial | ((d_full | d_partial) & (last_row >= dense_from)[:, None])) & ~merged_full
        full = merged_full
    # A fine block cut from a bigger partial one may hold nothing its token mask admits: drop it.
    partial = partial & _reachable(index.window, index.sink, dense_from, q_len, kv_len, cq, ck, full.device)
    colblk = torch.zeros_like(full)
    if columns is not None:
        colblk, _ = _column_blocks(full | partial, columns, q_len, kv_len, cq, ck)
    return full, partial, colblk, columns, (index.window, index.sink, dense_from)


# ------------------------------------------------------------------------------------------ BlockMask


def block_mask_from_tensors(tensors: dict[str, torch.Tensor], device: torch.device | str | None = None):
    """A FlexAttention BlockMask (with its exact mask_mod) from ``flex_tensors`` output or a saved layer.

    device: where the attention runs (default: where the tensors are). Every table the mask_mod reads
    moves there, because FlexAttention evaluates it with index tensors on the attention's device and
    a CPU table indexed by CUDA indices fails (saved layers load on the CPU)."""
    from torch.nn.attention.flex_attention import BlockMask

    if device is not None:
        tensors = {name: t.to(device) for name, t in tensors.items()}
    q_len, kv_len = (int(x) for x in tensors["seq_lengths"].tolist())
    block = int(tensors["block_size"].item())
    cq, ck = (int(x) for x in tensors["code_block"].tolist())
    q_tiles, kv_tiles = num_blocks(q_len, block), num_blocks(kv_len, block)
    # The code table covers every tile FlexAttention may visit, padding included.
    rows_c, cols_c = q_tiles * block // cq, kv_tiles * block // ck

    def dense_blocks(name: str) -> torch.Tensor:
        count, idx = tensors[f"{name}_count"], tensors[f"{name}_idx"]
        index = BlockIndex(count, idx, torch.zeros_like(count), torch.zeros_like(idx[..., :1]), cq, ck)
        mask = to_block_masks(index, cols_c)[0]
        out = torch.zeros(*mask.shape[:2], rows_c, cols_c, dtype=torch.bool, device=mask.device)
        out[:, :, : mask.shape[2]] = mask
        return out

    code_full, code_partial, code_col = dense_blocks("code_full"), dense_blocks("code_partial"), dense_blocks("code_col")
    code = torch.zeros(code_full.shape, dtype=torch.uint8, device=code_full.device)
    code[code_partial] = PARTIAL
    code[code_col] = COLUMN
    code[code_full] = FULL
    heads = code.shape[1]
    columns = tensors.get("columns")
    if columns is None:
        columns = torch.zeros(code.shape[0], heads, 1, dtype=torch.bool, device=code.device)
    padded = torch.zeros(columns.shape[0], heads, cols_c * ck, dtype=torch.bool, device=code.device)
    padded[..., : columns.shape[-1]] = columns
    window = tensors["window"].to(code.device).long()
    sink = tensors["sink"].to(code.device).long()
    dense_from = tensors["dense_from_row"].to(code.device).long()
    offset = kv_len - q_len
    # A batch-1 table (static patterns) serves every batch entry.
    code_b = (lambda b: b) if code.shape[0] > 1 else (lambda b: 0)
    cols_b = (lambda b: b) if padded.shape[0] > 1 else (lambda b: 0)

    def mask_mod(b, h, q_idx, kv_idx):
        c = code[code_b(b), h, q_idx // cq, kv_idx // ck]
        pos = q_idx + offset
        causal = kv_idx <= pos
        w = window[h]
        token = (w < 0) | (pos - kv_idx < w) | (kv_idx < sink[h]) | (q_idx >= dense_from[h])
        col = padded[cols_b(b), h, kv_idx]
        return (c == FULL) | ((c == PARTIAL) & causal & token) | ((c == COLUMN) & causal & col)

    mask_mod.__name__ = "sparsesearch_index"

    def widen(idx: torch.Tensor) -> torch.Tensor:
        return F.pad(idx, (0, kv_tiles - idx.shape[-1])).contiguous() if idx.shape[-1] < kv_tiles else idx[..., :kv_tiles].contiguous()

    return BlockMask.from_kv_blocks(
        tensors["kv_num_blocks"].contiguous(), widen(tensors["kv_indices"]),
        tensors["full_kv_num_blocks"].contiguous(), widen(tensors["full_kv_indices"]),
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
    )


def flex_block_mask(artifact: Artifact, q: torch.Tensor, k: torch.Tensor, layer: int, *, block: int = 128):
    """BlockMask of ``layer`` for q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (query-head space, GQA via enable_gqa),
    on q's device."""
    return block_mask_from_tensors(flex_tensors(artifact, layer, q=q, k=k, block=block), device=q.device)


# --------------------------------------------------------------------------------------------- files


def flex_file_bytes(per_layer: dict[int, dict[str, torch.Tensor]], *, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of ``{layer: flex_tensors(...)}`` with keys ``layers.{L}.{name}``."""
    from safetensors.torch import save

    flat = {f"layers.{layer}.{name}": t.detach().cpu().contiguous() for layer, tensors in sorted(per_layer.items()) for name, t in tensors.items()}
    meta = {"format": FORMAT, "version": "1", "layers": ",".join(str(layer) for layer in sorted(per_layer))}
    meta.update(metadata or {})
    return save(flat, metadata=meta)


def write_flex(per_layer: dict[int, dict[str, torch.Tensor]], out, *, metadata: dict[str, str] | None = None) -> Path:
    return write_file_atomic(out, flex_file_bytes(per_layer, metadata=metadata))


def load_flex(path) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: tensors} from a file ``write_flex`` wrote (``block_mask_from_tensors`` turns one into a BlockMask)."""
    _, tensors = read_tagged_safetensors(path, FORMAT)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        _, layer, name = key.split(".", 2)
        out.setdefault(int(layer), {})[name] = tensor
    return out
