"""Index-driven block-sparse attention in plain torch: the CPU backend of the runtime.

Same contract as ``block_sparse_attention`` (dense layout): the keys a BlockIndex admits, GQA without
repeating K/V in memory, an optional head map, rows with no key -> (0, -inf). Query blocks are processed
in chunks whose gathered keys stay under a memory budget, so no n x n matrix exists at any time. The
Triton kernel under TRITON_INTERPRET=1 is exact but far too slow for whole-model runs on a CPU; this
backend is what the runtime uses when the tensors live on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..index import BlockIndex, GridLines, RegionMaps, explicit_lines, num_blocks
from ..patterns._common import row_positions
from ._common import check_lines, check_qkv, check_region_maps, check_row_pos

CHUNK_BYTES = 256 * 2**20  # fp32 scores per chunk of query blocks
DENSE_SHARE = 0.5  # list width (keys) over kv_len above which a chunk runs as a masked matmul
# torch's fused CPU attention (returns lse too); with an additive mask it is ~6x the unfused score / mask /
# logsumexp / exp passes at 4K keys (2 cores), which made the wide path 6x slower than dense SDPA
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def block_sparse_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: BlockIndex,
    *,
    scale: float | None = None,
    heads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    row_pos: torch.Tensor | None = None,
    maps: RegionMaps | None = None,
    lines: GridLines | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> out [B, Hq, Nq, D] (q dtype), lse fp32 [B, Hq, Nq].

    heads: int32 [Hs] index-space head ids this call computes (index row i = head heads[i]); others untouched.
    row_pos: int64 [Nq_r], a permuted modality region's frame — row i admits keys j <= row_pos[i] (-1: none;
    patterns/boundary.py); None: the bottom-right causal frame.
    maps: a region read in place (index.RegionMaps), as in ``block_sparse_attention``: query rows and keys
    are gathered chunk by chunk through the maps (never a whole permuted copy), causality compares
    original positions when col_map is given, and out/lse given with Nq rows are written at row_map[i];
    None or Nq_r rows: compact.
    lines: a grid head read in place by arithmetic (``block_sparse_attention``); run here as its index with
    explicit line columns (index.explicit_lines), then the horizontal-line rows over every causal key.
    """
    check_region_maps(q, k, maps, row_pos, varlen=False)
    row_map, col_map = (None, None) if maps is None else (maps.row_map, maps.col_map)
    row_pos = row_pos if maps is None else maps.row_pos
    if lines is not None:
        check_lines(q, k, lines, index.q_blocks, maps, varlen=False)
        out, lse = block_sparse_attention_torch(q, k, v, explicit_lines(index, lines), scale=scale, heads=heads, out=out, lse=lse)
        if lines.row_lines:  # the band-only results of the line rows are overwritten
            _line_rows(q, k, v, lines, index, heads, scale, out, lse)
        return out, lse
    check_qkv(q, k, v, varlen=False, region=row_pos is not None or maps is not None)
    if maps is None:
        check_row_pos(q, k, row_pos)
    batch, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q_len, kv_len = (q.shape[2], k.shape[2]) if maps is None else (maps.rows, maps.keys)
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    space = kv_heads if index.head_space == "kv" else q_heads
    ids = torch.arange(space) if heads is None else heads.long().cpu()
    if index.heads != ids.numel() or index.batch != batch:
        raise ValueError(f"index is [B={index.batch}, H={index.heads}], inputs need [B={batch}, H={ids.numel()}]")
    if index.q_blocks < num_blocks(q_len, index.block_m):
        raise ValueError(f"index has {index.q_blocks} query blocks, {num_blocks(q_len, index.block_m)} needed")
    # Query heads each index row serves, and the KV head of each: [R, per_row].
    per_row = group if index.head_space == "kv" else 1
    q_ids = (ids[:, None] * per_row + torch.arange(per_row)[None, :]) if index.head_space == "kv" else ids[:, None]
    q_ids = q_ids.to(q.device)
    kv_ids = q_ids // group
    store_mapped = row_map is not None and out is not None and out.shape[2] == q.shape[2]
    out_rows = q.shape[2] if maps is None or store_mapped else q_len
    out = q.new_empty(batch, q_heads, out_rows, dim) if out is None else out
    lse = torch.empty(batch, q_heads, out_rows, dtype=torch.float32, device=q.device) if lse is None else lse

    bm, bn = index.block_m, index.block_n
    kb_total = num_blocks(kv_len, bn)
    k_tok = torch.nn.functional.pad(k, (0, 0, 0, 1))  # a zero token for padded slots
    v_tok = torch.nn.functional.pad(v, (0, 0, 0, 1))
    q_blocks = num_blocks(q_len, bm)
    frame = _frame(q, k, q_len, kv_len, q_blocks * bm, (kb_total + 1) * bn, row_pos, row_map, col_map, store_mapped)
    if col_map is None:
        # K/V as blocks, one zero block appended as the target of padding slots.
        pad = (kb_total + 1) * bn - kv_len
        k_blk = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(batch, kv_heads, kb_total + 1, bn, dim)
        v_blk = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(batch, kv_heads, kb_total + 1, bn, dim)
    else:
        k_blk = v_blk = None  # keys come through the column map, token by token
    widths = (index.full_idx.shape[-1] + index.partial_idx.shape[-1]) * bn + (0 if index.col_idx is None else index.col_idx.shape[-1])
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, 4 * batch * q_ids.numel() * bm * widths))
    # Wide lists (most keys listed): a masked matmul over all keys beats gathering them block by block.
    # Not under a map: it would need every key in region order, a whole permuted copy.
    wide = widths >= DENSE_SHARE * kv_len and maps is None
    if wide:
        k_sel, v_sel = k.index_select(1, kv_ids.flatten()), v.index_select(1, kv_ids.flatten())  # [B, S, Nk, D]
        rows_per_chunk = max(1, CHUNK_BYTES // max(1, 4 * batch * q_ids.numel() * bm * kv_len))
    for start in range(0, q_blocks, rows_per_chunk):
        stop = min(q_blocks, start + rows_per_chunk)
        if wide:
            _chunk_masked(q, k_sel, v_sel, index, q_ids, start, stop, q_len, kv_len, frame.positions, scale, out, lse)
        else:
            _chunk(q, (k_blk, v_blk, k_tok, v_tok), index, q_ids, kv_ids, start, stop, q_len, kv_len, frame, scale, kb_total, out, lse)
    return out, lse


@dataclass(frozen=True)
class _Frame:
    """Where the rows and keys of one call live. positions int64 [QB*bm]: each row's frontier in the key
    frame (window/sink and, without a column map, causality), -1 past q_len; q_src / o_rows int64 [q_len]:
    the q row each row reads and the out row it writes; key_src int64 [(KB+1)*bn] or None: the k/v row of
    each key slot (Nk, a zero token, past kv_len); q_orig int64 [QB*bm] or None: original positions for
    causality under a column map (-1 past q_len)."""

    positions: torch.Tensor
    q_src: torch.Tensor
    o_rows: torch.Tensor
    key_src: torch.Tensor | None
    q_orig: torch.Tensor | None


def _frame(q, k, q_len, kv_len, rows_padded, keys_padded, row_pos, row_map, col_map, store_mapped) -> _Frame:
    device = q.device
    shift = k.shape[2] - q.shape[2]
    q_src = torch.arange(q_len, device=device) if row_map is None else row_map.long()
    positions = torch.full((rows_padded,), -1, dtype=torch.int64, device=device)
    if row_pos is None and row_map is not None and col_map is None:
        positions[:q_len] = q_src + shift  # rows permuted, keys in place: the frontier is the original position
    else:
        positions[:q_len] = row_positions(q_len, kv_len, device, row_pos)
    key_src = q_orig = None
    if col_map is not None:
        key_src = torch.full((keys_padded,), k.shape[2], dtype=torch.int64, device=device)
        key_src[:kv_len] = col_map.long()
        q_orig = torch.full((rows_padded,), -1, dtype=torch.int64, device=device)
        q_orig[:q_len] = q_src + shift
    o_rows = q_src if store_mapped else torch.arange(q_len, device=device)
    return _Frame(positions, q_src, o_rows, key_src, q_orig)


def _lists(count: torch.Tensor, idx: torch.Tensor, pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids [.., W] with `pad_value` past each count, and the validity mask."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < count.unsqueeze(-1)
    return torch.where(valid, idx.long(), torch.full_like(idx, pad_value, dtype=torch.long)), valid


def _chunk(q, kv, index, q_ids, kv_ids, start, stop, q_len, kv_len, frame: _Frame, scale, kb_total, out, lse):
    """Attention of query blocks [start, stop) for every served head. Shapes: R index rows, G query heads
    per row. kv: (k_blk, v_blk) [B, Hkv, KB+1, bn, D] (None under a column map) and (k_tok, v_tok)
    [B, Hkv, Nk+1, D]."""
    k_blk, v_blk, k_tok, v_tok = kv
    batch, dim = q.shape[0], q.shape[-1]
    bm, bn = index.block_m, index.block_n
    sl = slice(start, stop)
    full, full_ok = _lists(index.full_count[:, :, sl], index.full_idx[:, :, sl], kb_total)
    part, part_ok = _lists(index.partial_count[:, :, sl], index.partial_idx[:, :, sl], kb_total)
    blocks = torch.cat([full, part], dim=-1)  # [B, R, C, W]
    is_partial = torch.cat([torch.zeros_like(full_ok), part_ok], dim=-1)
    rows_, per_row = q_ids.shape
    n_chunk = stop - start
    # Gather key blocks per (batch, served query head): [B, R, G, C, W*bn, D].
    b_ix = torch.arange(batch, device=q.device)[:, None, None, None, None]
    kvh = kv_ids[None, :, :, None, None]
    key_pos = (blocks[..., None] * bn + torch.arange(bn, device=q.device)).flatten(-2)  # [B, R, C, W*bn]
    if frame.key_src is None:
        blk = blocks[:, :, None, :, :]
        keys = k_blk[b_ix, kvh, blk].flatten(-3, -2)
        vals = v_blk[b_ix, kvh, blk].flatten(-3, -2)
    else:
        src = frame.key_src[key_pos][:, :, None]  # the permuted keys, read where they lie
        keys, vals = k_tok[b_ix, kvh, src], v_tok[b_ix, kvh, src]
    key_partial = is_partial[..., None].expand(*is_partial.shape, bn).flatten(-2)
    key_ok = key_pos < kv_len  # padding slots point at block kb_total, past kv_len
    if index.col_count is not None:
        cols, col_ok = _lists(index.col_count[:, :, sl], index.col_idx[:, :, sl], kv_len)
        col = cols[:, :, None] if frame.key_src is None else frame.key_src[cols][:, :, None]
        keys = torch.cat([keys, k_tok[b_ix, kvh, col]], dim=-2)
        vals = torch.cat([vals, v_tok[b_ix, kvh, col]], dim=-2)
        key_pos = torch.cat([key_pos, cols], dim=-1)
        key_partial = torch.cat([key_partial, torch.zeros_like(col_ok)], dim=-1)
        key_ok = torch.cat([key_ok, col_ok], dim=-1)
    # Queries of the chunk: [B, R, G, C, bm, D] (rows past q_len padded with zeros, dropped at the end).
    row0, row1 = start * bm, min(q_len, stop * bm)
    q_rows = torch.zeros(batch, rows_, per_row, n_chunk * bm, dim, dtype=torch.float32, device=q.device)
    q_rows[..., : row1 - row0, :] = q[b_ix[..., 0], q_ids[None, :, :, None], frame.q_src[row0:row1]].float()
    q_rows = q_rows.view(batch, rows_, per_row, n_chunk, bm, dim)
    pos = frame.positions[start * bm : stop * bm].view(n_chunk, bm)
    kp = key_pos[:, :, None, :, None, :]
    if frame.key_src is None:
        ok = key_ok[:, :, None, :, None, :] & (kp <= pos[None, None, None, :, :, None])
    else:  # causality in original positions: the column map need not keep order
        q_orig = frame.q_orig[start * bm : stop * bm].view(n_chunk, bm)
        k_orig = frame.key_src[key_pos.clamp(max=frame.key_src.numel() - 1)][:, :, None, :, None, :]
        ok = key_ok[:, :, None, :, None, :] & (k_orig <= q_orig[None, None, None, :, :, None])
    if index.window >= 0:
        token = ((pos[None, None, None, :, :, None] - kp) < index.window) | (kp < index.sink)
        ok = ok & (~key_partial[:, :, None, :, None, :] | token)
    # keys/vals [B, R, G, C, K, D]: one gathered key set per (head, query block); ok [B, R, 1, C, bm, K]
    res, row_lse = masked_attention(q_rows, keys.float(), vals.float(), ok.expand(*q_rows.shape[:-1], ok.shape[-1]), scale)
    res = res.reshape(batch, rows_, per_row, n_chunk * bm, dim)
    row_lse = row_lse.reshape(batch, rows_, per_row, n_chunk * bm)
    n_rows = row1 - row0
    heads_flat = q_ids.reshape(-1)
    dst = frame.o_rows[row0:row1]
    out[:, heads_flat[:, None], dst] = res[..., :n_rows, :].reshape(batch, -1, n_rows, dim).to(out.dtype)
    lse[:, heads_flat[:, None], dst] = row_lse[..., :n_rows].reshape(batch, -1, n_rows)


def _chunk_masked(q, k_sel, v_sel, index, q_ids, start, stop, q_len, kv_len, positions, scale, out, lse):
    """Query blocks [start, stop) against every key with the index's admitted set as a mask: (rows x Nk)
    scores per head, the same size as the oracle's chunks. k_sel/v_sel [B, S, Nk, D]: each served query
    head's KV head, in q_ids order."""
    batch = q.shape[0]
    bm, bn = index.block_m, index.block_n
    rows_, per_row = q_ids.shape
    sl = slice(start, stop)
    n_chunk = stop - start
    kb_total = num_blocks(kv_len, bn)
    kb = torch.arange(kv_len, device=q.device) // bn
    full, full_ok = _lists(index.full_count[:, :, sl], index.full_idx[:, :, sl], kb_total)
    part, part_ok = _lists(index.partial_count[:, :, sl], index.partial_idx[:, :, sl], kb_total)
    # Block-level membership [B, R, C, KB+1] (slot KB+... catches padding), then per key [B, R, C, Nk].
    in_full = torch.zeros(batch, rows_, n_chunk, kb_total + 1, dtype=torch.bool, device=q.device)
    in_full.scatter_(-1, full, full_ok)
    in_part = torch.zeros_like(in_full)
    in_part.scatter_(-1, part, part_ok)
    key_full, key_part = in_full[..., kb], in_part[..., kb]
    row0, row1 = start * bm, min(q_len, stop * bm)
    pos = positions[row0 : stop * bm]  # [C*bm]
    cols = torch.arange(kv_len, device=q.device)
    causal = cols[None, :] <= pos[:, None]  # [C*bm, Nk]
    token = causal
    if index.window >= 0:
        token = causal & (((pos[:, None] - cols[None, :]) < index.window) | (cols[None, :] < index.sink))
    expand = lambda m: m.repeat_interleave(bm, dim=2)  # [B, R, C, Nk] -> [B, R, C*bm, Nk]
    ok = (expand(key_full) & causal) | (expand(key_part) & token)
    if index.col_count is not None:
        cidx, c_ok = _lists(index.col_count[:, :, sl], index.col_idx[:, :, sl], kv_len)
        in_col = torch.zeros(batch, rows_, n_chunk, kv_len + 1, dtype=torch.bool, device=q.device)
        in_col.scatter_(-1, cidx, c_ok)
        ok = ok | (expand(in_col[..., :kv_len]) & causal)
    ok = ok[:, :, None].expand(batch, rows_, per_row, *ok.shape[2:]).reshape(batch, rows_ * per_row, -1, kv_len)
    heads_flat = q_ids.reshape(-1)
    n_rows = row1 - row0
    q_rows = q[:, heads_flat, row0:row1].float()
    res, row_lse = masked_attention(q_rows, k_sel.float(), v_sel.float(), ok[:, :, :n_rows], scale)
    out[:, heads_flat, row0:row1] = res.to(out.dtype)
    lse[:, heads_flat, row0:row1] = row_lse


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q [..., M, D] over k/v [..., K, D] where allowed bool [..., M, K] -> (out [..., M, D], lse [..., M]);
    rows with no admitted key: out 0, lse -inf. On a CPU through torch's fused kernel with an additive mask
    (leading dims flattened into its batch); elsewhere scores, one exp and a normalisation."""
    lead, m = q.shape[:-2], q.shape[-2]
    empty = ~allowed.any(-1)
    if _CPU_FLASH is not None and not q.is_cuda:
        flat = lambda t: t.reshape(-1, 1, *t.shape[-2:])  # noqa: E731
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        res, row_lse = _CPU_FLASH(flat(q), flat(k), flat(v), 0.0, False, attn_mask=flat(bias), scale=scale)[:2]
        res, row_lse = res.reshape(*lead, m, q.shape[-1]), row_lse.float().reshape(*lead, m)
        return res.masked_fill(empty[..., None], 0.0), row_lse.masked_fill(empty, float("-inf"))
    scores = (q @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # a row with no key: exp(-inf) = 0 below
    probs = scores.sub_(top).exp_()
    total = probs.sum(-1, keepdim=True)
    res = (probs @ v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return res, (top + total.log()).squeeze(-1)


def _line_rows(q, k, v, lines: GridLines, index: BlockIndex, heads: torch.Tensor | None, scale: float | None, out, lse) -> None:
    """A grid head's horizontal-line rows over every causal key (as an index listing every key block as
    partial, read through a row map: keys in place, causal by original position)."""
    rows = lines.rows(q.device)
    blocks = num_blocks(lines.kv_len, index.block_n)
    shape = (index.batch, index.heads, num_blocks(rows.numel(), index.block_m))
    every = torch.arange(blocks, dtype=torch.int32, device=q.device).expand(*shape, blocks)
    none = torch.zeros(shape, dtype=torch.int32, device=q.device)
    dense = BlockIndex(none, none[..., None], torch.full(shape, blocks, dtype=torch.int32, device=q.device), every,
                       index.block_m, index.block_n, index.head_space)
    maps = RegionMaps(rows.to(torch.int32), None, None, q.shape[2], k.shape[2])  # distinct, in range: line rows
    block_sparse_attention_torch(q, k, v, dense, scale=scale, heads=heads, out=out, lse=lse, maps=maps)
