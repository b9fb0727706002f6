"""Index-driven block-sparse flash-attention forward (Triton).

One program computes one query block of one query head, or of 2-4 heads of a GQA group stacked into one
tile when a kv-space index gives them the same lists (each K/V tile loaded then serves them all). It walks
three lists from the BlockIndex: full key blocks (no mask at all), partial key blocks (causal, kv-length
and optional window/sink mask) and gathered key columns (single tokens, causal), all merged into one
online softmax. K and V are read through the KV head of the query head's GQA group: they are never
repeated in memory.

Layouts: dense q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] (torch SDPA and transformers order; any strides with
a contiguous last dim). Varlen q [Tq, Hq, D], k/v [Tk, Hkv, D] with int32 cu_seqlens. Queries are
bottom-right aligned (row i sits at key position i + kv_len - q_len), or, for a permuted modality region,
at row_pos[i]. A modality region is read in place through int32 row/column maps (index.RegionMaps): Q loads,
O/lse stores and K/V loads go through them, causality compares original positions, and the full key
blocks of an increasing column map that are one run of consecutive keys are re-addressed as plain slabs
of the original K/V before the launch (region_runs.py; the rest become partial blocks); a grid head's
lines are index arithmetic (index.GridLines). An index whose columns come with a column table
(index.ColumnTable, vertical-slash) has them read from contiguous per-head slabs of the table's K/V rows
(column_slabs.py) as plain (TMA) tiles, unmasked over each block's clean run, instead of gathered token by
token. Without any of these the flags are constexpr off and the kernel is the plain one. On a Hopper GPU a dense
kv-space launch with 64-blocks (full + partial lists, window/sink, a column table, a head map; q/k/v/out with
16-byte strides) goes to the persistent warp-specialized Gluon kernel of block_sparse_ws.py instead (launch config
key ``ws``); regions, grid lines and varlen stay here. Outputs: out like q; lse fp32
(natural log) [B, Hq, Nq] dense or [Hq, Tq] varlen; a row with no admitted key gives out 0, lse -inf.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..index import BlockIndex, GridLines, RegionMaps, num_blocks
from ._common import (
    LOG2E, bhn_strides, block_d, check_layout, check_lines, check_region_maps, dot_f32, index_strides, interpreting,
    load_kv_tile, online_update,
)
from .block_sparse_ws import block_sparse_ws_attention, tma_layout_ok, ws_eligible
from .column_slabs import column_slabs, table_operands
from .launch_table import tuned_config
from .region_runs import fold_runs


@triton.jit
def _slab_tile(KC_DESC, VC_DESC, kc_base, vc_base, slab, start, slots, offs_d, in_span, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, TABLE_TMA: tl.constexpr):
    """K^T [BLOCK_D, TILE_N] and V [TILE_N, BLOCK_D] of slab rows ``slots`` (= start + 0 .. TILE_N) of a column
    table's K/V slabs (the head's from row ``slab``): one TMA box each, or pointer loads, masked to ``in_span``
    when MASKED (a TMA box past the span reads the next head's slots or zeros: the caller's mask drops them)."""
    if TABLE_TMA:
        row = (slab + start).to(tl.int32)
        kt = KC_DESC.load([row, 0]).T
        vt = VC_DESC.load([row, 0])
    else:
        kt = load_kv_tile(kc_base, slots, HEAD_DIM, offs_d, in_span, HEAD_DIM, BLOCK_D, MASKED, True)
        vt = load_kv_tile(vc_base, slots, HEAD_DIM, offs_d, in_span, HEAD_DIM, BLOCK_D, MASKED, False)
    return kt, vt


# Index pointers, list strides, lengths and grid-line arguments change with every candidate a search times (list
# widths follow the budget), and Triton specialises ints on ==1 and %16: a cold modal search compiled 110 variants of
# this kernel. None of these feeds a vectorised load or a tile shape, so they stay generic; the Q/K/V/O strides and
# the row/column maps, which are read a tile at a time and vectorise on alignment, stay specialised
# (benchmarks/compile_keys.py: 16 keys -> 7).
_GENERIC_ARGS = (
    "FULL_CNT", "FULL_IDX", "PART_CNT", "PART_IDX", "COL_CNT", "COL_IDX", "CU_Q", "CU_K", "HEAD_MAP", "LINE_CNT",
    "q_len_max", "kv_len_max", "window", "sink", "heads_per_batch", "pos_shift",
    "g_stride", "g_row_phase", "g_row_lines", "g_col_phase", "stride_lb", "stride_lh",
    "stride_cb", "stride_ch", "stride_cm", "stride_fb", "stride_fh", "stride_fm",
    "stride_pb", "stride_ph", "stride_pm", "stride_gb", "stride_gh", "stride_gm",
    "TAB_IDS", "TAB_BITS", "TAB_CLEAN", "TAB_SPAN", "n_slots", "idx_heads",
    "stride_ib", "stride_ih", "stride_wb", "stride_wh", "stride_wm", "stride_tb", "stride_th", "stride_tm",
)


@triton.jit(do_not_specialize=_GENERIC_ARGS)
def _block_sparse_fwd(
    Q, K, V, O, LSE, K_DESC, V_DESC,
    FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, COL_CNT, COL_IDX,
    CU_Q, CU_K, HEAD_MAP, ROW_POS, ROW_MAP, COL_MAP, LINE_CNT,
    TAB_IDS, TAB_BITS, TAB_CLEAN, TAB_SPAN, KC, VC, KC_DESC, VC_DESC, n_slots, idx_heads,
    qk_scale, q_len_max, kv_len_max, window, sink, heads_per_batch, pos_shift,
    g_stride, g_row_phase, g_row_lines, g_col_phase,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh, stride_ln,
    stride_cb, stride_ch, stride_cm,
    stride_fb, stride_fh, stride_fm,
    stride_pb, stride_ph, stride_pm,
    stride_gb, stride_gh, stride_gm,
    stride_ib, stride_ih, stride_wb, stride_wh, stride_wm, stride_tb, stride_th, stride_tm,
    GROUP: tl.constexpr, INDEX_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_N: tl.constexpr, VARLEN: tl.constexpr, HAS_COLS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
    USE_HEAD_MAP: tl.constexpr, HAS_ROW_POS: tl.constexpr,
    HAS_ROW_MAP: tl.constexpr, HAS_COL_MAP: tl.constexpr, STORE_MAPPED: tl.constexpr,
    FULL_STARTS: tl.constexpr, USE_TMA: tl.constexpr, GRID: tl.constexpr, GRID_COLS: tl.constexpr, PACK: tl.constexpr,
    COL_TILE: tl.constexpr, COL_TABLE: tl.constexpr, TABLE_TMA: tl.constexpr, PART_TILE: tl.constexpr,
):
    # Heaviest (last) query blocks first: under causal-like patterns they have the most key blocks.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    # A program serves PACK consecutive query heads of one GQA group (one kv-space index row): their rows are
    # stacked into one PACK * BLOCK_M tile, so each K/V tile loaded serves all of them.
    packs_per_batch = heads_per_batch // PACK
    b = pid_bh // packs_per_batch
    r = (pid_bh % packs_per_batch) * PACK
    if USE_HEAD_MAP:
        # This launch serves a subset of heads: index head `slot` is head HEAD_MAP[slot] of its space.
        if INDEX_PER_KV:
            slot = r // GROUP
            h = tl.load(HEAD_MAP + slot) * GROUP + r % GROUP
        else:
            slot = r
            h = tl.load(HEAD_MAP + slot)
        idx_h = slot
        kv_h = h // GROUP
    else:
        h = r
        kv_h = h // GROUP
        if INDEX_PER_KV:
            idx_h = kv_h
        else:
            idx_h = h
    if VARLEN:
        q_start = tl.load(CU_Q + b)
        q_len = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        kv_len = tl.load(CU_K + b + 1) - k_start
    else:
        q_start = 0
        q_len = q_len_max
        k_start = 0
        kv_len = kv_len_max
    if m_block * BLOCK_M >= q_len:
        return

    if PACK > 1:
        offs_p = tl.arange(0, PACK * BLOCK_M)
        offs_m = m_block * BLOCK_M + offs_p % BLOCK_M
        h_rows = h + offs_p // BLOCK_M  # each stacked row's query head
    else:
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        h_rows = h
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TILE_N)
    offs_c = tl.arange(0, COL_TILE)  # single-token columns (gathered ids, grid lines) go COL_TILE at a time
    row_ok = offs_m < q_len
    if HAS_ROW_MAP:
        # Permuted rows read in place: row i of the region is row ROW_MAP[i] of q (and of out/lse).
        q_rows = tl.load(ROW_MAP + offs_m, mask=row_ok, other=0)
    else:
        q_rows = offs_m
    if HAS_ROW_POS:
        # A permuted region: each row's frontier among the keys (-1: none yet; padded rows too).
        pos = tl.load(ROW_POS + offs_m, mask=row_ok, other=-1)
    elif HAS_ROW_MAP and not HAS_COL_MAP:
        pos = q_rows + pos_shift  # rows permuted, keys in place: the frontier is the original position
    else:
        pos = offs_m + (kv_len - q_len)
    if HAS_COL_MAP:
        # Permuted keys: causality compares original positions (the permutation need not keep order).
        q_orig = tl.where(row_ok, q_rows + pos_shift, -1)
    store_ok = row_ok
    if GRID:
        # A grid head's lines (index.GridLines): a horizontal-line row computes the band only here; the
        # launcher's split-K pass over all its keys writes it.
        line_row = ((offs_m + g_stride - g_row_phase) % g_stride == 0) & (g_row_lines > 0)
        store_ok = row_ok & (line_row == 0)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + (h_rows.to(tl.int64) * stride_qh + (q_start + q_rows).to(tl.int64) * stride_qn)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kn
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vn

    m_i = tl.full([PACK * BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([PACK * BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([PACK * BLOCK_M, BLOCK_D], dtype=tl.float32)
    never = offs_t < 0  # placeholder column mask for unmasked tiles
    cnt_off = b.to(tl.int64) * stride_cb + idx_h.to(tl.int64) * stride_ch + m_block * stride_cm
    SPLIT: tl.constexpr = BLOCK_N // TILE_N

    n_full = tl.load(FULL_CNT + cnt_off)
    full_base = FULL_IDX + b.to(tl.int64) * stride_fb + idx_h.to(tl.int64) * stride_fh + m_block * stride_fm
    n_part = tl.load(PART_CNT + cnt_off)
    part_base = PART_IDX + b.to(tl.int64) * stride_pb + idx_h.to(tl.int64) * stride_ph + m_block * stride_pm
    if GRID_COLS:
        # Vertical-line keys below col_hi come as strided columns; partial blocks mask them.
        n_line = tl.load(LINE_CNT + m_block)
        col_hi = g_col_phase + g_stride * n_line
    # Full blocks: in range and wholly causal for every valid row, so no mask is computed.
    if USE_TMA:
        # Contiguous dense K/V seen as [rows, D]: each full tile is one bulk (TMA) copy of TILE_N whole rows,
        # issued without per-thread address math; measured on an H200 at 32K: +8% dense, +2-6% at
        # 5-25% block top-k (benchmarks/RESULTS.md, launch tuning).
        row0 = (b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh) // stride_kn
        for t in range(0, n_full * SPLIT):
            entry = tl.load(full_base + t // SPLIT)
            if FULL_STARTS:
                j0 = entry + (t % SPLIT) * TILE_N  # a run's first row in the original keys (region_runs.py)
            else:
                j0 = entry * BLOCK_N + (t % SPLIT) * TILE_N
            r = (row0 + j0).to(tl.int32)
            kt = K_DESC.load([r, 0]).T
            vt = V_DESC.load([r, 0])
            m_i, l_i, acc = online_update(q, kt, vt, never, m_i, l_i, acc, qk_scale, False, DOT_F32)
    else:
        for t in range(0, n_full * SPLIT):
            entry = tl.load(full_base + t // SPLIT)
            if FULL_STARTS:
                cols = entry + (t % SPLIT) * TILE_N + offs_t
            else:
                cols = entry * BLOCK_N + (t % SPLIT) * TILE_N + offs_t
                if HAS_COL_MAP:
                    cols = tl.load(COL_MAP + cols)  # a map that is not increasing: every tile gathered
            kt = load_kv_tile(k_base, cols, stride_kn, offs_d, never, HEAD_DIM, BLOCK_D, False, True)
            vt = load_kv_tile(v_base, cols, stride_vn, offs_d, never, HEAD_DIM, BLOCK_D, False, False)
            m_i, l_i, acc = online_update(q, kt, vt, never, m_i, l_i, acc, qk_scale, False, DOT_F32)

    # Partial blocks: causal + kv bound, plus the index's window/sink token mask when it has one.
    PART_SPLIT: tl.constexpr = BLOCK_N // PART_TILE
    offs_pt = tl.arange(0, PART_TILE)
    for t in range(0, n_part * PART_SPLIT):
        kb = tl.load(part_base + t // PART_SPLIT)
        cols = kb * BLOCK_N + (t % PART_SPLIT) * PART_TILE + offs_pt
        col_ok = cols < kv_len
        if HAS_COL_MAP:
            k_cols = tl.load(COL_MAP + cols, mask=col_ok, other=0)
            ok = col_ok[None, :] & (k_cols[None, :] <= q_orig[:, None])
        else:
            k_cols = cols
            ok = col_ok[None, :] & (cols[None, :] <= pos[:, None])
        kt = load_kv_tile(k_base, k_cols, stride_kn, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, True)
        vt = load_kv_tile(v_base, k_cols, stride_vn, offs_d, col_ok, HEAD_DIM, BLOCK_D, True, False)
        if HAS_WINDOW:
            ok = ok & (((pos[:, None] - cols[None, :]) < window) | (cols[None, :] < sink))
        if GRID_COLS:
            ok = ok & ~((cols[None, :] < col_hi) & ((cols[None, :] + g_stride - g_col_phase) % g_stride == 0))
        m_i, l_i, acc = online_update(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, DOT_F32)

    # Gathered columns (vertical lines outside every listed block), COL_TILE at a time.
    if HAS_COLS:
        n_col = tl.load(COL_CNT + cnt_off)
        col_base = COL_IDX + b.to(tl.int64) * stride_gb + idx_h.to(tl.int64) * stride_gh + m_block * stride_gm
        # Each tile's ids are loaded one step ahead, so its K/V gathers do not wait on a dependent id load
        # (H200, 32K, 4000 vertical lines: efficiency 0.47 -> 0.54; benchmarks/results/tune/).
        cols_next = tl.load(col_base + offs_c, mask=offs_c < n_col, other=0)
        for start in range(0, n_col, COL_TILE):
            live = start + offs_c < n_col
            cols = cols_next
            ahead = start + COL_TILE + offs_c
            cols_next = tl.load(col_base + ahead, mask=ahead < n_col, other=0)
            if HAS_COL_MAP:
                k_cols = tl.load(COL_MAP + cols, mask=live, other=0)
                ok = live[None, :] & (k_cols[None, :] <= q_orig[:, None])
            else:
                k_cols = cols
                ok = live[None, :] & (cols[None, :] <= pos[:, None])
            kt = load_kv_tile(k_base, k_cols, stride_kn, offs_d, live, HEAD_DIM, BLOCK_D, True, True)
            vt = load_kv_tile(v_base, k_cols, stride_vn, offs_d, live, HEAD_DIM, BLOCK_D, True, False)
            m_i, l_i, acc = online_update(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, DOT_F32)

    if COL_TABLE:
        # The columns as slots of the head's table (index.ColumnTable): the launcher copied the slots' K/V rows
        # into a contiguous [n_slots, D] slab per index head, so a tile of slots is one contiguous (TMA) load
        # instead of TILE_N scattered rows. The leading clean run needs no mask; past it, the slots' bits and
        # causality mask the tile.
        t_off = b.to(tl.int64) * stride_tb + idx_h.to(tl.int64) * stride_th + m_block * stride_tm
        n_span = tl.minimum(tl.load(TAB_SPAN + t_off), n_slots)  # bounds-safe on a malformed table too
        n_clean = tl.minimum(tl.load(TAB_CLEAN + t_off), n_span)
        ids_base = TAB_IDS + b.to(tl.int64) * stride_ib + idx_h.to(tl.int64) * stride_ih
        bits_base = TAB_BITS + b.to(tl.int64) * stride_wb + idx_h.to(tl.int64) * stride_wh + m_block * stride_wm
        slab = (b.to(tl.int64) * idx_heads + idx_h) * n_slots  # the slab's first row in [B * H * n_slots, D]
        kc_base = KC + slab * HEAD_DIM
        vc_base = VC + slab * HEAD_DIM
        clean_end = n_clean // TILE_N * TILE_N
        for start in range(0, clean_end, TILE_N):
            kt, vt = _slab_tile(KC_DESC, VC_DESC, kc_base, vc_base, slab, start, start + offs_t, offs_d, never, HEAD_DIM, BLOCK_D, False, TABLE_TMA)
            m_i, l_i, acc = online_update(q, kt, vt, never, m_i, l_i, acc, qk_scale, False, DOT_F32)
        for start in range(clean_end, n_span, TILE_N):
            slots = start + offs_t
            in_span = slots < n_span
            words = tl.load(bits_base + slots // 32, mask=in_span, other=0)
            used = in_span & (((words >> (slots % 32)) & 1) != 0)
            ids = tl.load(ids_base + slots, mask=used, other=0)
            ok = used[None, :] & (ids[None, :] <= pos[:, None])
            kt, vt = _slab_tile(KC_DESC, VC_DESC, kc_base, vc_base, slab, start, slots, offs_d, in_span, HEAD_DIM, BLOCK_D, True, TABLE_TMA)
            m_i, l_i, acc = online_update(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, DOT_F32)

    if GRID_COLS:
        # The vertical lines' keys: col_phase + stride * i, addresses by arithmetic (no id loads).
        for start in range(0, n_line, COL_TILE):
            live = start + offs_c < n_line
            cols = g_col_phase + g_stride * (start + offs_c)
            ok = live[None, :] & (cols[None, :] <= pos[:, None])
            kt = load_kv_tile(k_base, cols, stride_kn, offs_d, live, HEAD_DIM, BLOCK_D, True, True)
            vt = load_kv_tile(v_base, cols, stride_vn, offs_d, live, HEAD_DIM, BLOCK_D, True, False)
            m_i, l_i, acc = online_update(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, DOT_F32)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # m_i is in log2 units of the scaled scores; lse is reported in natural log.
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    if STORE_MAPPED:
        o_rows = q_rows  # written in original positions: no un-permute pass
    else:
        o_rows = offs_m
    o_ptrs = O + b.to(tl.int64) * stride_ob + (h_rows.to(tl.int64) * stride_oh + (q_start + o_rows).to(tl.int64) * stride_on)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=store_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    l_ptrs = LSE + b.to(tl.int64) * stride_lb + h_rows.to(tl.int64) * stride_lh + (q_start + o_rows).to(tl.int64) * stride_ln
    tl.store(l_ptrs, lse, mask=store_ok)


def _launch_config(block_m: int, block_n: int, head_dim: int, device: torch.device) -> dict:
    """Tile width, pipelining and TMA loads for the device; one fixed choice under the CPU interpreter.

    Measured on an H200 (benchmarks/tune_kernel.py, bf16, d=128, 32K, see benchmarks/RESULTS.md): 64-wide
    key tiles, 4 warps and 2 stages win by a wide margin (0.89 efficiency dense, 0.82 at 25% density with
    128-row blocks) over 8 warps / 3 stages (0.71): Q (32 KiB) + 2 x (K + V) tiles (64 KiB) fit two CTAs per
    SM, a third stage drops that to one. head_dim 256 (Gemma 3) keeps the 64-wide key tile but one stage: 0.70-0.85
    efficiency at 8K and 32K against 0.61-0.76 for the 32-wide, two-stage tile it had (Run 34); 8 warps lose there
    too (0.34-0.56).
    Full-block tiles through TMA (Hopper and later) beat pointer loads at that config; a heads-first grid
    order and one loop over full and partial blocks were slower (session 6 tuning rows). Where
    ``sparsesearch tune-kernels`` has measured this GPU (launch_table.py), its tile width, warps and stages
    replace these.
    """
    return dict(_device_config(block_n, head_dim, device, interpreting()))


@functools.cache
def _device_config(block_n: int, head_dim: int, device: torch.device, interpret: bool, tuned: bool = True) -> dict:
    """``_launch_config``'s answer, once per key: reading the device's capability costs host time on every
    launch otherwise (about 20 us of a 0.23 ms call, H200). ``tuned`` False: the defaults, ignoring the launch table
    (what the tuner compares against)."""
    tile_n = min(block_n, 64)
    if interpret:
        return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 1}
    major = torch.cuda.get_device_capability(device)[0]
    stages = 2 if head_dim <= 128 else 1
    config = {"TILE_N": tile_n, "num_warps": 4, "num_stages": stages, "tma": major >= 9, "ws": major == 9}
    measured = tuned_config(torch.cuda.get_device_name(device), block_n, head_dim) if tuned else None
    return config if measured is None else {**config, **measured}


def _pack(index: BlockIndex, group: int, head_dim: int) -> int:
    """Query heads of one GQA group stacked into each program: up to 128 rows (block_m x pack) when one
    kv-space index row serves them all, so every K/V tile loaded feeds twice (or 4x) the rows.

    Measured on an H200 (benchmarks/tune_kernel.py --pack, bf16, d=128, 64 x 64 blocks, see RESULTS.md):
    block top-k at 32K 0.62/0.67/0.71 -> 0.73/0.80/0.85 efficiency at 5/10/25%, at 128K 0.72/0.75/0.74 ->
    0.89/0.94/0.98. Gathered columns and a grid head's strided line columns go half as wide then (COL_TILE).
    Not past head_dim 128, whose accumulator alone would fill the register file at 128 rows.
    """
    if index.head_space != "kv" or head_dim > 128:
        return 1
    pack = max(1, 128 // index.block_m)
    while group % pack:
        pack //= 2
    return pack


def _tma_eligible(k: torch.Tensor, v: torch.Tensor, varlen: bool, scattered: bool) -> bool:
    """Whether full tiles can be TMA copies: dense contiguous K/V with 16-byte aligned bases and power-of-two
    rows (a descriptor's box), row ids that fit the descriptor's int32 coordinates, and keys in place or in
    runs (not ``scattered``: a column map that is not increasing)."""
    head_dim = k.shape[-1]
    return (
        not varlen and not scattered and head_dim & (head_dim - 1) == 0
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k, v)) and k.numel() // head_dim < 2**31
    )


def _row_descriptor(t: torch.Tensor, tile_n: int):
    """A TMA descriptor over contiguous [B, H, N, D] seen as [B*H*N, D], tiles of tile_n whole rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = t.view(-1, t.shape[-1])
    return TensorDescriptor.from_tensor(flat, [tile_n, t.shape[-1]])


def check_index(index: BlockIndex, batch: int, index_heads: int, q_len_max: int, device: torch.device) -> None:
    """Raise ValueError when an index cannot drive attention over these inputs (index_heads: rows it needs)."""
    if index.heads != index_heads:
        raise ValueError(f"index has {index.heads} heads but head_space={index.head_space!r} needs {index_heads} here")
    if index.batch != batch:
        raise ValueError(f"index batch {index.batch} differs from input batch {batch} (use index.expand_batch)")
    need = num_blocks(q_len_max, index.block_m)
    if index.q_blocks < need:
        raise ValueError(f"index has {index.q_blocks} query blocks, {need} needed for {q_len_max} queries at block_m={index.block_m}")
    if index.device != device:
        raise ValueError(f"index is on {index.device}, q on {device}")
    counts = [index.full_count, index.partial_count] + ([index.col_count] if index.col_count is not None else [])
    if len({tuple(c.stride()) for c in counts}) != 1:
        raise ValueError("index count tensors must share strides (build them together or call .contiguous())")


# Head maps already found valid, keyed by device, storage address, version counter, length, stride and head count.
# Each entry holds its tensor, so no other tensor can take that address while the entry lives; writing to it bumps
# the version. The device is in the key because a host and a device address can be the same number.
_VALID_HEADS: dict[tuple, torch.Tensor] = {}


def _check_head_map(heads: torch.Tensor | None, space_heads: int, device: torch.device) -> int | None:
    """Number of heads a head map serves (None without one); ValueError when it is malformed. Reading the ids
    waits for the device, so a map seen before unchanged is not read again (the runtime passes the same
    per-group tensors every layer: 40 waits of one 8B-stack prefill, RESULTS.md)."""
    if heads is None:
        return None
    if heads.dim() != 1 or heads.dtype != torch.int32 or heads.device != device:
        raise ValueError(f"heads must be a 1-D int32 tensor on {device}, got {heads.dtype} {tuple(heads.shape)} on {heads.device}")
    key = (heads.device, heads.data_ptr(), heads._version, heads.numel(), heads.stride(0), space_heads)
    if key in _VALID_HEADS:
        return heads.numel()
    ids = heads.tolist()
    if not ids or min(ids) < 0 or max(ids) >= space_heads or len(set(ids)) != len(ids):
        raise ValueError(f"heads must be distinct ids in [0, {space_heads}), got {ids}")
    if heads.untyped_storage().nbytes() <= 4096:  # never keep a large tensor alive through a view of it
        if len(_VALID_HEADS) >= 1024:
            _VALID_HEADS.clear()
        _VALID_HEADS[key] = heads
    return len(ids)


def _check_out(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a {dtype} tensor (unit stride in its last dim) of shape {tuple(shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: BlockIndex,
    *,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    heads: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: dict | None = None,
    row_pos: torch.Tensor | None = None,
    maps: RegionMaps | None = None,
    lines: GridLines | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of q over the keys the index admits.

    Dense: q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] -> out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq].
    Varlen (cu_seqlens given): q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens int32 [B + 1]
    -> out [Tq, Hq, D], lse fp32 [Hq, Tq]. The index has B = number of sequences.
    heads: int32 [Hs] ids (in the index's head space) of the heads this launch computes; index row i is
    head heads[i]. Other heads of out/lse are left untouched, so one launch per pattern group can fill a
    shared output (pass out and lse, shaped as returned). None: every head, index rows in head order.
    config: launch overrides (TILE_N, num_warps, num_stages, tma, pack: query heads stacked per program, kv
    head space only; col_table: False reads the column lists even when the index has a table; ws: True sends a
    launch it takes to block_sparse_ws.py, the device default on Hopper, absent = the Triton kernel) for tuning;
    None picks per device and index. The column table serves dense launches in the plain frame only: with
    cu_seqlens, row_pos, maps or lines the column lists are read.
    row_pos: int64 [Nq_r], a permuted modality region's frame (dense layout; patterns/boundary.py): row i
    admits keys j <= row_pos[i] instead of the bottom-right causal rule; Nq_r may exceed Nk_r.
    maps (dense layout; index.RegionMaps, made by kernels.region_maps or boundary.Region.maps): a region
    read in place — region row i is q row row_map[i], region key j is k/v row col_map[j]; the index lives in
    those region coordinates, and maps.row_pos is its frame (row_pos itself stays None). With col_map,
    causality compares original positions (col_map[j] <= row_map[i] + Nk - Nq), so the maps need not keep
    order; with an increasing col_map the full blocks that are one run load as plain (TMA) tiles and the
    few that straddle a gap are gathered as partial blocks (one small pass per launch). The window/sink
    frame is row_pos, else (row_map only) the original position, else bottom-right in region coordinates.
    out/lse given with Nq rows: written at row_map[i] (original positions); None or Nq_r rows: compact.
    lines: a grid head's stride/phase by index arithmetic (index.GridLines, built with its index by
    patterns/grid.py build_lines_index): the index covers every row with key blocks in original
    coordinates, plus strided vertical-line columns; the horizontal-line rows are computed apart, split over
    keys, and written over the index pass.
    """
    check_region_maps(q, k, maps, row_pos, cu_seqlens_q is not None or cu_seqlens_k is not None)
    layout = check_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, row_pos)
    return attend_in_layout(q, k, v, index, layout, scale=scale, heads=heads, out=out, lse=lse, config=config,
                            row_pos=row_pos, maps=maps, lines=lines)


def attend_in_layout(q, k, v, index: BlockIndex, layout, *, scale: float | None = None, heads: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None, config: dict | None = None,
                     row_pos: torch.Tensor | None = None, maps: RegionMaps | None = None,
                     lines: GridLines | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse_attention`` past its layout check: ``layout`` is check_layout's answer for these q/k/v
    (and cu_seqlens, row_pos), so a caller that launches more than one kernel over the same inputs (the
    triangle) validates them once; on varlen inputs that check syncs with the device."""
    varlen, batch, q_heads, kv_heads = layout.varlen, layout.batch, layout.q_heads, layout.kv_heads
    q_len_max, kv_len_max = (layout.q_len_max, layout.kv_len_max) if maps is None else (maps.rows, maps.keys)
    row_map, col_map = (None, None) if maps is None else (maps.row_map, maps.col_map)
    row_pos = row_pos if maps is None else maps.row_pos
    check_lines(q, k, lines, index.q_blocks, maps, varlen)
    space_heads = kv_heads if index.head_space == "kv" else q_heads
    served = _check_head_map(heads, space_heads, q.device)
    check_index(index, batch, space_heads if served is None else served, q_len_max, q.device)
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    store_mapped = maps is not None and row_map is not None and out is not None and out.shape[2] == q.shape[2]
    out_shape = q.shape if maps is None or store_mapped else (batch, q_heads, q_len_max, head_dim)
    lse_shape = (q_heads, q.shape[0]) if varlen else (batch, q_heads, out_shape[2])
    out = _check_out("out", out, out_shape, q.dtype, q.device) if out is not None else q.new_empty(out_shape)
    lse = _check_out("lse", lse, lse_shape, torch.float32, q.device) if lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    sq, sk, sv, so = (bhn_strides(t, varlen) for t in (q, k, v, out))
    sl = (0, lse.stride(0), lse.stride(1)) if varlen else lse.stride()
    if q_len_max == 0:
        return out, lse
    dummy = index.full_idx
    heads_per_batch = q_heads if served is None else served * (q_heads // kv_heads if index.head_space == "kv" else 1)
    launch = dict(config or _launch_config(index.block_m, index.block_n, head_dim, q.device))
    # config["col_table"] False: the column lists even when the index has a table (A/B timing of the two paths).
    use_table = launch.pop("col_table", True)
    # Hopper, dense kv-space launches (ws_eligible): the persistent warp-specialized kernel (block_sparse_ws.py) does
    # the same work with the per-program fixed cost hidden under the next item's loads.
    if launch.pop("ws", False) and maps is None and row_pos is None and lines is None and not varlen \
            and tma_layout_ok(out) and lse.is_contiguous() \
            and ws_eligible(q, k, v, index, table=use_table):
        return block_sparse_ws_attention(q, k, v, index, scale=scale, out=out, lse=lse, heads=heads if served is not None else None)
    table = index.col_table if use_table else None
    if table is not None and (varlen or maps is not None or row_pos is not None or lines is not None):
        table = None  # the table is in the plain bottom-right frame; these launches read the column lists
    has_cols = index.col_count is not None and table is None
    full_starts = col_map is not None and maps.increasing
    tma = bool(launch.pop("tma", False))
    use_tma = tma and _tma_eligible(k, v, varlen, col_map is not None and not full_starts)
    full_count, full_idx, partial_count, partial_idx = index.full_count, index.full_idx, index.partial_count, index.partial_idx
    col_count = index.col_count
    if full_starts:
        # Full blocks that are one run of the map become plain slabs of the original keys (region_runs.py).
        for lists in (full_idx, partial_idx):
            index_strides(lists)  # fold_runs reads them with a unit last stride, as the kernel does
        full_count, full_idx, partial_count, partial_idx = fold_runs(index, col_map)
        col_count = None if col_count is None else col_count.contiguous()  # counts share one stride set
    group = q_heads // kv_heads
    pack = launch.pop("pack", None)
    pack = _pack(index, group, head_dim) if pack is None else pack
    if not isinstance(pack, int) or pack < 1 or pack & (pack - 1):
        raise ValueError(f"pack must be a power of two >= 1 (query heads per program), got {pack!r}")
    if pack > 1 and (index.head_space != "kv" or group % pack):
        raise ValueError(f"pack={pack} needs a kv head space index and a GQA group ({group}) it divides")
    # 128 rows (stacked or one 128-row block) against a full-width column tile spill registers in the gather loop
    # (H200, 32K: 0.51 -> 0.31 vertical-heavy at 2 x 64 rows); half-width tiles run it at 0.54 and the planted
    # 1000v/2048s index at 0.64 -> 0.75.
    wide = index.block_m * pack >= 128
    launch.setdefault("COL_TILE", max(16, launch["TILE_N"] // 2) if wide else launch["TILE_N"])
    # The same at 128 rows for a region's partial blocks (row_pos frame; in place: a map load, then a gather and an
    # original-position compare per tile): 64-wide tiles spilled 94 registers in place and 34 on copies, H200 64 x 64
    # 2D A-shape regions; half-width tiles cut in-place time 5-9% (4.44 -> 4.21 ms video x video at 32K).
    region = maps is not None or row_pos is not None
    launch.setdefault("PART_TILE", max(16, launch["TILE_N"] // 2) if wide and region else launch["TILE_N"])
    k_desc, v_desc = (_row_descriptor(t, launch["TILE_N"]) for t in (k, v)) if use_tma else (k, v)
    if table is not None:
        kc, vc = column_slabs(k, v, table.ids, heads, 1 if index.head_space == "kv" else group, batch)
        table_tma = tma and _tma_eligible(kc, vc, False, False)
        kc_desc, vc_desc = (_row_descriptor(t, launch["TILE_N"]) for t in (kc, vc)) if table_tma else (kc, vc)
        table, table_strides = table_operands(table)
        table_args = (table.ids, table.bits, table.clean, table.span, kc, vc, kc_desc, vc_desc, table.ids.shape[-1], index.heads)
    else:
        table_tma = False
        table_args = (full_count,) * 4 + (k, v, k, v, 0, 0)
        table_strides = (0,) * 8
    grid = (num_blocks(q_len_max, index.block_m), batch * heads_per_batch // pack)
    _block_sparse_fwd[grid](
        q, k, v, out, lse, k_desc, v_desc,
        full_count, full_idx, partial_count, partial_idx,
        col_count if has_cols else full_count, index.col_idx if has_cols else dummy,
        layout.cu_q, layout.cu_k, heads if served is not None else full_count,
        row_pos if row_pos is not None else full_count,
        row_map if row_map is not None else full_count, col_map if col_map is not None else full_count,
        lines.line_cols if lines is not None and lines.line_cols is not None else full_count,
        *table_args,
        scale * LOG2E, q_len_max, kv_len_max, index.window, index.sink, heads_per_batch,
        0 if maps is None else maps.pos_shift,
        *((lines.stride, lines.row_phase, lines.row_lines, lines.col_phase) if lines is not None else (1, 0, 0, 0)),
        *sq, *sk, *sv, *so, *sl,
        *index_strides(full_count), *index_strides(full_idx),
        *index_strides(partial_idx), *index_strides(index.col_idx), *table_strides,
        GROUP=group, INDEX_PER_KV=index.head_space == "kv",
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=index.block_m, BLOCK_N=index.block_n,
        VARLEN=varlen, HAS_COLS=has_cols, HAS_WINDOW=index.window >= 0, DOT_F32=dot_f32(q.dtype),
        USE_HEAD_MAP=served is not None, HAS_ROW_POS=row_pos is not None,
        HAS_ROW_MAP=row_map is not None, HAS_COL_MAP=col_map is not None, STORE_MAPPED=store_mapped,
        FULL_STARTS=full_starts, USE_TMA=use_tma, GRID=lines is not None, GRID_COLS=lines is not None and lines.line_cols is not None, PACK=pack,
        COL_TABLE=table is not None, TABLE_TMA=table_tma, **launch,
    )
    if lines is not None and lines.row_lines:
        _line_rows(q, k, v, lines, heads, index.head_space, scale, out, lse)
    return out, lse


def _line_rows(q, k, v, lines: GridLines, heads: torch.Tensor | None, head_space: str, scale: float, out, lse) -> None:
    """A grid head's horizontal-line rows over every causal key, written over the index pass's band-only
    rows: split over keys (one such row sees the whole context; a single program per row block would be
    the launch's critical path, H200 32K: 4.5 ms against 2.1 for the rest)."""
    from .triangle import line_rows_attention  # triangle builds on this module

    group = q.shape[1] // k.shape[1]
    if heads is None:
        q_heads = torch.arange(q.shape[1], device=q.device)
    elif head_space == "kv":
        q_heads = (heads.long()[:, None] * group + torch.arange(group, device=q.device)).flatten()
    else:
        q_heads = heads.long()
    line_rows_attention(q, k, v, lines.row_phase, lines.stride, lines.row_lines, q_heads.to(torch.int32), scale=scale, out=out, lse=lse)
