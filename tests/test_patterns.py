"""Pattern modules against the oracle: predicate -> dense mask -> pooled blocks (reference.py).

CPU, small shapes, deterministic. Lengths are not block multiples, block_m != block_n is covered, queries
may be fewer than keys (bottom-right aligned), batch 2, GQA in both head spaces.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsesearch import index as bi
from sparsesearch import reference as ref
from sparsesearch.patterns import REGISTRY, _common, ashape, block_topk, dense, grid, index_density, triangle
from sparsesearch.patterns import vertical_slash as vs

LENGTHS = [(200, 200), (333, 333), (150, 333), (1, 77)]
BLOCKS = [(16, 16), (32, 64), (64, 16), (64, 64)]
BATCH = 2


# ------------------------------------------------------------------------------------------- helpers


def predicate_mask(predicate, heads: int, q_len: int, kv_len: int, batch: int = BATCH) -> torch.Tensor:
    """[B, H, q_len, kv_len] token mask of a predicate (causality included)."""
    return ref.predicate_mask_fn(predicate, batch, heads, q_len, kv_len)(torch.arange(q_len)).contiguous()


def index_mask(index: bi.BlockIndex, q_len: int, kv_len: int, group: int = 1) -> torch.Tensor:
    return ref.index_mask_fn(index, q_len, kv_len, group)(torch.arange(q_len))


def block_masks(index: bi.BlockIndex, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return bi.to_block_masks(index, bi.num_blocks(kv_len, index.block_n))


def block_geometry(q_len: int, kv_len: int, block_m: int, block_n: int):
    """first/last row positions [QB, 1] and key block ids [1, KB] (int64)."""
    first, last = _common.query_block_bounds(q_len, kv_len, block_m)
    kb = torch.arange(bi.num_blocks(kv_len, block_n))[None, :]
    return first[:, None], last[:, None], kb


def wholly_causal(q_len: int, kv_len: int, block_m: int, block_n: int) -> torch.Tensor:
    first, _, kb = block_geometry(q_len, kv_len, block_m, block_n)
    top = (kb + 1) * block_n - 1
    return (top <= first) & (top < kv_len)


def brute_entries(blocks: torch.Tensor, q_len: int, kv_len: int, block_m: int, block_n: int, row_stop=None) -> int:
    """Causal token entries inside listed blocks [..., QB, KB], counted on a dense token grid."""
    tokens = blocks.repeat_interleave(block_m, -2)[..., :q_len, :].repeat_interleave(block_n, -1)[..., :kv_len]
    pos = torch.arange(q_len)[:, None] + kv_len - q_len
    keep = torch.arange(kv_len)[None, :] <= pos
    if row_stop is not None:
        keep = keep & (torch.arange(q_len)[:, None] < row_stop)
    return int((tokens & keep).sum())


def expected_stream_blocks(mask: torch.Tensor, sink: int, local: int, q_len: int, kv_len: int, bm: int, bn: int):
    """pool_mask of an A-shape mask, with index.validate's full-block rule applied.

    A full block must lie wholly in the sink or wholly in every row's window; a block fully admitted only
    because the sink covers one part and the window the rest is listed as partial (its token mask admits
    all of it, so the token-level mask is still exact).
    """
    every, some = ref.pool_mask(mask, bm, bn)
    _, last, kb = block_geometry(q_len, kv_len, bm, bn)
    rule = ((kb + 1) * bn <= sink) | (last - kb * bn < local)
    full = every & rule
    return full, (every | some) & ~full


# --------------------------------------------------------------------------------------------- dense


@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_dense_exact(q_len, kv_len, block_m, block_n):
    index = dense.build_index(dense.DenseParams(), q_len, kv_len, batch=BATCH, heads=2, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    mask = predicate_mask(dense.predicate(), 2, q_len, kv_len)
    every, some = ref.pool_mask(mask, block_m, block_n)
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full, every) and torch.equal(partial, some)
    assert torch.equal(index_mask(index, q_len, kv_len), mask)
    assert dense.predicate().__name__ == "causal"
    assert dense.density(dense.DenseParams(), q_len, kv_len=kv_len) == 1.0
    assert index_density(index, q_len, kv_len) == pytest.approx(1.0)


# -------------------------------------------------------------------------------------------- ashape

ASHAPE_PARAMS = [(0, 1), (4, 16), (64, 100), (7, 1000), (130, 33), (3, 47)]


@pytest.mark.parametrize("sink,local", ASHAPE_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_ashape_exact(sink, local, q_len, kv_len, block_m, block_n):
    params = ashape.AShapeParams(sink=sink, local=local)
    index = ashape.build_index(params, q_len, kv_len, batch=BATCH, heads=2, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    assert (index.window, index.sink) == (local, sink)
    mask = predicate_mask(ashape.predicate(params), 2, q_len, kv_len)
    want_full, want_partial = expected_stream_blocks(mask, sink, local, q_len, kv_len, block_m, block_n)
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full, want_full) and torch.equal(partial, want_partial)
    assert torch.equal(index_mask(index, q_len, kv_len), mask)


@pytest.mark.parametrize("sink,local", ASHAPE_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
def test_ashape_pool_mask_differs_only_on_sink_window_straddle(sink, local, q_len, kv_len):
    """Against the unmodified pool_mask, only blocks split between sink and window move from full to partial."""
    params = ashape.AShapeParams(sink=sink, local=local)
    index = ashape.build_index(params, q_len, kv_len, block_m=16, block_n=16)
    every, some = ref.pool_mask(predicate_mask(ashape.predicate(params), 1, q_len, kv_len, batch=1), 16, 16)
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full | partial, every | some)
    moved = every & ~full
    _, last, kb = block_geometry(q_len, kv_len, 16, 16)
    straddle = (kb * 16 < sink) & ((kb + 1) * 16 > sink) & (last - kb * 16 >= local)
    assert not bool((moved & ~straddle).any())


def test_ashape_straddle_block_is_partial():
    # Rows at positions 15..17, key block 0 = keys 0..15: keys 0..7 are sink, 8..15 in every row's window.
    params = ashape.AShapeParams(sink=8, local=10)
    index = ashape.build_index(params, 3, 18, block_m=16, block_n=16)
    bi.validate(index, 3, 18)
    mask = predicate_mask(ashape.predicate(params), 1, 3, 18, batch=1)
    every, _ = ref.pool_mask(mask, 16, 16)
    full, partial = block_masks(index, 18)
    assert bool(every[0, 0, 0, 0]) and bool(partial[0, 0, 0, 0]) and not bool(full[0, 0, 0, 0])
    assert torch.equal(index_mask(index, 3, 18), mask)


def test_ashape_name_and_density_brute_force():
    params = ashape.AShapeParams(sink=5, local=40)
    assert ashape.predicate(params).__name__ == "ashape_5_40"
    for q_len, kv_len, bm, bn in [(200, 200, 16, 16), (333, 333, 32, 64), (150, 333, 64, 16)]:
        mask = predicate_mask(ashape.predicate(params), 1, q_len, kv_len, batch=1)
        every, some = ref.pool_mask(mask, bm, bn)
        want = brute_entries(every | some, q_len, kv_len, bm, bn) / _common.causal_entries(q_len, kv_len)
        got = ashape.density(params, q_len, kv_len=kv_len, block_m=bm, block_n=bn)
        assert got == pytest.approx(want, abs=1e-12)
        assert 0.0 < got <= 1.0
    # A tiny window at long length: well below dense.
    assert ashape.density(ashape.AShapeParams(sink=64, local=64), 4096) < 0.1


# ------------------------------------------------------------------------------------------ triangle

TRIANGLE_PARAMS = [(4, 16, 1), (8, 63, 40), (0, 1, 128), (16, 100, 500)]


@pytest.mark.parametrize("sink,window,last", TRIANGLE_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_triangle_streaming_part_exact(sink, window, last, q_len, kv_len, block_m, block_n):
    params = triangle.TriangleParams(sink=sink, window=window, last=last)
    split = triangle.split_row(params, q_len)
    assert split == max(0, q_len - last)
    index = triangle.build_index(params, q_len, kv_len, batch=BATCH, heads=2, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    assert index.meta["split_row"] == split
    stream = predicate_mask(ashape.predicate(ashape.AShapeParams(sink, window)), 2, q_len, kv_len)
    tri = predicate_mask(triangle.predicate(params, kv_len), 2, q_len, kv_len)
    # The predicate: streaming before the split, dense causal after it.
    causal = predicate_mask(dense.predicate(), 2, q_len, kv_len)
    assert torch.equal(tri[:, :, :split], stream[:, :, :split])
    assert torch.equal(tri[:, :, split:], causal[:, :, split:])
    # Blocks: A-shape lists where the block has a streaming row, nothing where all rows are dense.
    want_full, want_partial = expected_stream_blocks(stream, sink, window, q_len, kv_len, block_m, block_n)
    streaming = (torch.arange(index.q_blocks) * block_m < split)[:, None]
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full, want_full & streaming) and torch.equal(partial, want_partial & streaming)
    assert torch.equal(index_mask(index, q_len, kv_len)[:, :, :split], tri[:, :, :split])


def test_triangle_density_brute_force():
    params = triangle.TriangleParams(sink=4, window=32, last=50)
    assert triangle.predicate(params, 300).__name__ == "triangle_4_32_50"
    for q_len, kv_len, bm, bn in [(300, 300, 16, 16), (250, 333, 64, 32)]:
        split = triangle.split_row(params, q_len)
        stream = predicate_mask(ashape.predicate(ashape.AShapeParams(4, 32)), 1, q_len, kv_len, batch=1)
        every, some = ref.pool_mask(stream, bm, bn)
        computed = brute_entries(every | some, q_len, kv_len, bm, bn, row_stop=split)
        computed += _common.causal_entries(q_len, kv_len, row_start=split)
        want = computed / _common.causal_entries(q_len, kv_len)
        assert triangle.density(params, q_len, kv_len=kv_len, block_m=bm, block_n=bn) == pytest.approx(want, abs=1e-12)
    assert triangle.density(triangle.TriangleParams(last=1000), 500) == 1.0


# ---------------------------------------------------------------------------------------------- grid

GRID_PARAMS = [
    (7, 3, True, True, True, 5),
    (16, 0, True, False, False, 1),
    (1, 0, False, False, True, 1),
    (50, 49, False, True, False, 64),
    (3, 1, False, False, False, 2),
    (24, 5, False, True, True, 16),
    (9, 4, False, False, False, 17),
    (11, 0, False, True, False, 8),
]


@pytest.mark.parametrize("stride,phase,hline,vline,slash,local", GRID_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_grid_block_cover(stride, phase, hline, vline, slash, local, q_len, kv_len, block_m, block_n):
    params = grid.GridParams(stride, phase, hline, vline, slash, local)
    index = grid.build_index(params, q_len, kv_len, batch=BATCH, heads=2, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    mask = predicate_mask(grid.predicate(params), 2, q_len, kv_len)
    every, some = ref.pool_mask(mask, block_m, block_n)
    full, partial = block_masks(index, kv_len)
    cover = every | some
    assert torch.equal(full | partial, cover)
    assert torch.equal(full, cover & wholly_causal(q_len, kv_len, block_m, block_n))
    admitted = index_mask(index, q_len, kv_len)
    assert not bool((mask & ~admitted).any())
    want = brute_entries(cover[0, 0], q_len, kv_len, block_m, block_n) / _common.causal_entries(q_len, kv_len)
    assert grid.density(params, q_len, kv_len=kv_len, block_m=block_m, block_n=block_n) == pytest.approx(want, abs=1e-12)


def test_grid_predicate_lines():
    params = grid.GridParams(stride=6, phase=2, use_hline=True, use_vline=False, use_slash=False, local=1)
    mask = _common.predicate_grid(grid.predicate(params), 30)
    assert grid.predicate(params).__name__ == "grid_6_2_h_1"
    rows = torch.arange(30)
    assert torch.equal(mask.sum(-1), torch.where(rows % 6 == 2, rows + 1, torch.ones_like(rows)))
    vparams = grid.GridParams(stride=6, phase=2, use_hline=False, use_vline=True, use_slash=False, local=1)
    vmask = _common.predicate_grid(grid.predicate(vparams), 30)
    assert bool(vmask[29, 2::6].all()) and int(vmask[29].sum()) == 5 + 1


def test_grid_estimate_stride_phase():
    torch.manual_seed(0)
    batch, q_heads, kv_heads, q_len, kv_len, dim = 2, 4, 2, 200, 333, 32
    q = torch.randn(batch, q_heads, q_len, dim) * 0.1
    k = torch.randn(batch, kv_heads, kv_len, dim) * 0.1
    q[..., 0] = 4.0
    plants = [(8, 3), (12, 7)]  # (stride, phase) per KV head
    for h, (stride, phase) in enumerate(plants):
        k[:, h, phase::stride, 0] = 4.0
    for head_space, group in (("kv", 1), ("query", 2)):
        stride, phase, score = grid.estimate_stride_phase(q, k, [4, 6, 8, 12, 16, 24], last_q=64, head_space=head_space)
        for h in range(stride.shape[1]):
            want = plants[h // group]
            assert stride[:, h].tolist() == [want[0]] * batch and phase[:, h].tolist() == [want[1]] * batch
        assert bool((score > 2.0).all())


# ---------------------------------------------------------------------------------------- block_topk


def random_qk(batch, q_heads, kv_heads, q_len, kv_len, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, q_heads, q_len, dim, generator=gen), torch.randn(batch, kv_heads, kv_len, dim, generator=gen)


DYN_LENGTHS = [(200, 200), (333, 333), (100, 333)]


@pytest.mark.parametrize("k_blocks,sink_blocks", [(0, 0), (2, 1), (5, 2), (100, 1)])
@pytest.mark.parametrize("q_len,kv_len", DYN_LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_block_topk_index(k_blocks, sink_blocks, q_len, kv_len, block_m, block_n, head_space):
    params = block_topk.BlockTopKParams(k_blocks=k_blocks, sink_blocks=sink_blocks)
    q, k = random_qk(BATCH, 4, 2, q_len, kv_len, seed=q_len + block_m)
    index = block_topk.build_index(params, q, k, head_space=head_space, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    assert index.head_space == head_space and index.heads == (2 if head_space == "kv" else 4)
    selection = index.meta["selection"]
    # Union = pooled predicate, full = wholly causal part, token mask exact (listed blocks are computed whole).
    mask = predicate_mask(block_topk.predicate(params, selection), index.heads, q_len, kv_len)
    every, some = ref.pool_mask(mask, block_m, block_n)
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full | partial, every | some)
    assert torch.equal(full, (full | partial) & wholly_causal(q_len, kv_len, block_m, block_n))
    assert torch.equal(index_mask(index, q_len, kv_len), mask)
    group = 2 if head_space == "kv" else 1
    per_query = predicate_mask(block_topk.predicate(params, selection, group), 4, q_len, kv_len)
    assert torch.equal(index_mask(index, q_len, kv_len, group), per_query)
    # Forced blocks present, budget respected.
    first, last, kb = block_geometry(q_len, kv_len, block_m, block_n)
    causal = kb * block_n <= last
    forced = ((kb < sink_blocks) | (kb >= first // block_n)) & causal
    assert bool((full | partial)[..., forced].all())
    others = (causal & ~forced).sum(-1)
    want_count = forced.sum(-1) + torch.clamp(others, max=k_blocks)
    assert torch.equal(index.computed_blocks(), want_count.expand_as(index.computed_blocks()))
    # Density is data-independent: the arithmetic matches the built index.
    got = block_topk.density(params, q_len, kv_len=kv_len, block_m=block_m, block_n=block_n)
    assert got == pytest.approx(index_density(index, q_len, kv_len), abs=1e-12)
    assert 0.0 < got <= 1.0


def test_block_topk_ties_go_to_lower_block():
    params = block_topk.BlockTopKParams(k_blocks=2, sink_blocks=0)
    q, k = torch.zeros(1, 1, 160, 8), torch.zeros(1, 1, 160, 8)
    index = block_topk.build_index(params, q, k, block_m=16, block_n=16)
    full, partial = block_masks(index, 160)
    for m in range(3, 10):
        picked = torch.nonzero((full | partial)[0, 0, m]).flatten().tolist()
        assert picked == [0, 1, m]


@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_block_topk_planted_blocks(head_space):
    torch.manual_seed(0)
    batch, q_heads, kv_heads, length, block, dim = 2, 4, 2, 256, 32, 32
    q = torch.randn(batch, q_heads, length, dim) * 0.1
    k = torch.randn(batch, kv_heads, length, dim) * 0.1
    blocks = length // block
    targets = {}
    for g in range(kv_heads):
        for m in range(2, blocks):
            t = 1 + (m + g) % (m - 1)  # in [1, m - 1]: neither sink nor diagonal
            targets[g, m] = t
            q[:, g * 2: g * 2 + 2, m * block:(m + 1) * block, 8 + m] += 3.0
            k[:, g, t * block:(t + 1) * block, 8 + m] += 3.0
    params = block_topk.BlockTopKParams(k_blocks=1, sink_blocks=1)
    index = block_topk.build_index(params, q, k, head_space=head_space, block_m=block, block_n=block)
    full, partial = block_masks(index, length)
    listed = full | partial
    group = 2 if head_space == "query" else 1
    for h in range(index.heads):
        for m in range(2, blocks):
            want = sorted({0, targets[h // group, m], m})
            for b in range(batch):
                assert torch.nonzero(listed[b, h, m]).flatten().tolist() == want


# ------------------------------------------------------------------------------------ vertical_slash


def brute_last_q_sums(q, k, last_q, head_space):
    """Column and diagonal sums by explicit loops (the slow twin of _common.last_q_sums)."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    rows = min(last_q, q_len)
    kk = k.repeat_interleave(group, 1)
    scores = q[:, :, -rows:] @ kk.transpose(-1, -2) / math.sqrt(dim)
    pos = torch.arange(kv_len - rows, kv_len)
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > pos[:, None], float("-inf"))
    probs = scores.softmax(-1)
    cols = probs.sum(-2)
    diag = torch.zeros(batch, q_heads, kv_len)
    for r in range(rows):
        for j in range(int(pos[r]) + 1):
            diag[:, :, int(pos[r]) - j] += probs[:, :, r, j]
    if head_space == "kv":
        cols = cols.view(batch, kv_heads, group, kv_len).sum(2)
        diag = diag.view(batch, kv_heads, group, kv_len).sum(2)
    return cols, diag


@pytest.mark.parametrize("head_space", ["query", "kv"])
@pytest.mark.parametrize("q_len,kv_len,last_q", [(40, 40, 16), (20, 57, 64), (57, 57, 8)])
def test_last_q_sums_brute_force(head_space, q_len, kv_len, last_q):
    q, k = random_qk(2, 4, 2, q_len, kv_len, dim=16, seed=3)
    cols, diag = _common.last_q_sums(q, k, last_q, head_space=head_space)
    want_cols, want_diag = brute_last_q_sums(q, k, last_q, head_space)
    torch.testing.assert_close(cols, want_cols)
    torch.testing.assert_close(diag, want_diag)


VS_PARAMS = [(1, 1, 64, 0, 0), (6, 10, 32, 4, 4), (40, 20, 64, 30, 5), (1000, 6096, 64, 30, 100)]


@pytest.mark.parametrize("vertical,slash,last_q,force_v,force_s", VS_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", DYN_LENGTHS)
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_vertical_slash_index(vertical, slash, last_q, force_v, force_s, q_len, kv_len, block_m, block_n, head_space):
    params = vs.VerticalSlashParams(vertical, slash, last_q, force_v, force_s)
    q, k = random_qk(BATCH, 4, 2, q_len, kv_len, seed=kv_len + block_n)
    index = vs.build_index(params, q, k, head_space=head_space, block_m=block_m, block_n=block_n)
    bi.validate(index, q_len, kv_len)
    lines = index.meta["lines"]
    heads = 2 if head_space == "kv" else 4
    assert index.heads == heads and index.window == -1
    # Budgets, and forced lines: at most half of each budget (vs.forced).
    n_vertical, n_slash = min(vertical, kv_len), min(slash, kv_len)
    assert lines.vertical.shape == (BATCH, heads, n_vertical) and lines.slash.shape == (BATCH, heads, n_slash)
    fv, fs = min(vs.forced(force_v, vertical), kv_len), min(vs.forced(force_s, slash), kv_len)
    assert fv == min(force_v, max(1, vertical // 2), kv_len) and fs == min(force_s, max(1, slash // 2), kv_len)
    assert bool((lines.vertical[..., :fv] == torch.arange(fv)).all())
    assert bool((lines.slash[..., :fs] == torch.arange(fs)).all())
    # Blocks: exactly the cover of the slash lines; full = wholly causal part.
    slash_mask = predicate_mask(vs.slash_predicate(lines), heads, q_len, kv_len)
    every, some = ref.pool_mask(slash_mask, block_m, block_n)
    full, partial = block_masks(index, kv_len)
    assert torch.equal(full | partial, every | some)
    assert torch.equal(full, (full | partial) & wholly_causal(q_len, kv_len, block_m, block_n))
    # Columns: the verticals causal for the block's last row and outside every listed block.
    _, last, _ = block_geometry(q_len, kv_len, block_m, block_n)
    is_vertical = torch.zeros(BATCH, heads, kv_len, dtype=torch.bool).scatter_(-1, lines.vertical, True)
    covered = (full | partial).repeat_interleave(block_n, -1)[..., :kv_len]
    causal_cols = torch.arange(kv_len)[None, :] <= last
    assert torch.equal(bi.to_column_mask(index, kv_len), is_vertical[:, :, None] & causal_cols & ~covered)
    # Token level: the index admits every predicate token (superset), in both head spaces.
    mask = predicate_mask(vs.predicate(params, lines), heads, q_len, kv_len)
    assert not bool((mask & ~index_mask(index, q_len, kv_len)).any())
    group = 2 if head_space == "kv" else 1
    per_query = predicate_mask(vs.predicate(params, lines, group), 4, q_len, kv_len)
    assert not bool((per_query & ~index_mask(index, q_len, kv_len, group)).any())
    # Density from the index equals a brute-force count; the data-free bound is above it.
    entries = brute_entries(full | partial, q_len, kv_len, block_m, block_n)
    entries += int(bi.to_column_mask(index, kv_len).repeat_interleave(block_m, -2)[..., :q_len, :]
                   .logical_and(predicate_mask(dense.predicate(), heads, q_len, kv_len)).sum())
    want = entries / (BATCH * heads * _common.causal_entries(q_len, kv_len))
    got = vs.density(params, q_len, kv_len=kv_len, block_m=block_m, block_n=block_n, index=index)
    assert got == pytest.approx(want, abs=1e-12) and 0.0 < got <= 1.0
    assert vs.density(params, q_len, kv_len=kv_len, block_m=block_m, block_n=block_n) >= got - 1e-12


def planted_vs(batch, q_heads, kv_heads, q_len, kv_len, seed=0):
    """Q/K whose last-queries attention has one strong slash per KV head and two strong vertical columns.

    Slash at offset d: rotary-style planes, q at position p is R(p θ) u and key j is R((j + d) θ) u, so their
    product is a sum of cos(θ_f (p - j - d)): with incommensurate θ it peaks only at p - j = d (logit ~12).
    Verticals: one extra direction shared by every query and the two planted keys (logit ~10).
    """
    gen = torch.Generator().manual_seed(seed)
    planes = 24
    dim = 2 * planes + 8
    scale = 1.0 / math.sqrt(dim)
    theta = torch.linspace(0.3, 3.0, planes)
    q = torch.randn(batch, q_heads, q_len, dim, generator=gen) * 0.05
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen) * 0.05
    rope_amp = math.sqrt(12.0 / (planes * scale))  # peak logit 12
    line_amp = math.sqrt(10.0 / scale)  # vertical logit 10
    q_pos = torch.arange(kv_len - q_len, kv_len, dtype=torch.float32)[:, None] * theta
    group = q_heads // kv_heads
    slashes, verticals = [], []
    for g in range(kv_heads):
        d, cols = 150 + 17 * g, [57 + g, 211 - g]
        slashes.append(d)
        verticals.append(cols)
        k_pos = (torch.arange(kv_len, dtype=torch.float32)[:, None] + d) * theta
        heads = slice(g * group, (g + 1) * group)
        q[:, heads, :, : 2 * planes] += torch.stack([q_pos.cos(), q_pos.sin()], -1).flatten(-2) * rope_amp
        k[:, g, :, : 2 * planes] += torch.stack([k_pos.cos(), k_pos.sin()], -1).flatten(-2) * rope_amp
        q[:, heads, :, 2 * planes] += line_amp
        k[:, g, cols, 2 * planes] += line_amp
    return q, k, slashes, verticals


@pytest.mark.parametrize("head_space", ["query", "kv"])
@pytest.mark.parametrize("q_len,kv_len", [(333, 333), (200, 333)])
def test_vertical_slash_planted_lines_recovered(head_space, q_len, kv_len):
    q, k, slashes, verticals = planted_vs(BATCH, 4, 2, q_len, kv_len)
    # Budgets of 8 with 4 forced (half, vs.forced): the forced prefix plus the planted lines among the rest.
    params = vs.VerticalSlashParams(vertical_size=8, slash_size=8, last_q=64, force_vertical=4, force_slash=4)
    index = vs.build_index(params, q, k, head_space=head_space, block_m=32, block_n=32)
    lines = index.meta["lines"]
    group = 2 if head_space == "query" else 1
    for b in range(BATCH):
        for h in range(index.heads):
            g = h // group
            vertical, slash = lines.vertical[b, h].tolist(), lines.slash[b, h].tolist()
            assert vertical[:4] == [0, 1, 2, 3] and set(verticals[g]) <= set(vertical)
            assert slash[:4] == [0, 1, 2, 3] and slashes[g] in slash
    # The planted diagonal's blocks are listed for every query block that reaches it.
    full, partial = block_masks(index, kv_len)
    first, last, kb = block_geometry(q_len, kv_len, 32, 32)
    for h in range(index.heads):
        d = slashes[h // group]
        touched = (kb * 32 <= last - d) & ((kb + 1) * 32 - 1 >= first - d)
        assert bool((full | partial)[:, h][:, touched].all())


def test_vertical_slash_kv_estimate_sums_group():
    q, k = random_qk(1, 4, 2, 100, 100, dim=16, seed=5)
    cols_q, diag_q = _common.last_q_sums(q, k, 32, head_space="query")
    cols_kv, diag_kv = _common.last_q_sums(q, k, 32, head_space="kv")
    torch.testing.assert_close(cols_kv, cols_q.view(1, 2, 2, 100).sum(2))
    torch.testing.assert_close(diag_kv, diag_q.view(1, 2, 2, 100).sum(2))


# ------------------------------------------------------------------------------------- params, shared


@pytest.mark.parametrize(
    "factory,field",
    [
        (lambda: ashape.AShapeParams(sink=-3, local=8), "sink"),
        (lambda: ashape.AShapeParams(sink=4, local=0), "local"),
        (lambda: ashape.AShapeParams(sink=1.5, local=8), "sink"),
        (lambda: triangle.TriangleParams(sink=-1), "sink"),
        (lambda: triangle.TriangleParams(window=0), "window"),
        (lambda: triangle.TriangleParams(last=0), "last"),
        (lambda: grid.GridParams(stride=0), "stride"),
        (lambda: grid.GridParams(stride=4, phase=4), "phase"),
        (lambda: grid.GridParams(stride=4, phase=-1), "phase"),
        (lambda: grid.GridParams(stride=4, use_hline=1), "use_hline"),
        (lambda: grid.GridParams(stride=4, local=0), "local"),
        (lambda: block_topk.BlockTopKParams(k_blocks=-1), "k_blocks"),
        (lambda: block_topk.BlockTopKParams(sink_blocks=-2), "sink_blocks"),
        (lambda: vs.VerticalSlashParams(vertical_size=0), "vertical_size"),
        (lambda: vs.VerticalSlashParams(slash_size=-5), "slash_size"),
        (lambda: vs.VerticalSlashParams(last_q=0), "last_q"),
        (lambda: vs.VerticalSlashParams(force_vertical=-1), "force_vertical"),
        (lambda: vs.VerticalSlashParams(force_slash=True), "force_slash"),
    ],
)
def test_bad_params_name_the_field(factory, field):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        factory()


def test_bad_message_shows_value():
    with pytest.raises(ValueError, match=r"sink must be >= 0, got -3"):
        ashape.AShapeParams(sink=-3)


def test_bad_lengths_and_shapes():
    with pytest.raises(ValueError, match="q_len"):
        dense.build_index(dense.DenseParams(), 10, 5)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        block_topk.build_index(block_topk.BlockTopKParams(), torch.zeros(1, 3, 8, 4), torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="head_space"):
        vs.build_index(vs.VerticalSlashParams(), torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), head_space="keys")


def test_registry_and_density_ranges():
    assert set(REGISTRY) == {"dense", "ashape", "block_topk", "vertical_slash", "triangle", "grid"}
    cases = {
        "dense": dense.DenseParams(),
        "ashape": ashape.AShapeParams(128, 1024),
        "triangle": triangle.TriangleParams(8, 512, 128),
        "grid": grid.GridParams(196, 0, True, True, False, 1024),
        "block_topk": block_topk.BlockTopKParams(16, 1),
        "vertical_slash": vs.VerticalSlashParams(1000, 6096),
    }
    for name, params in cases.items():
        module = REGISTRY[name]
        for length in (100, 4096, 20000):
            value = module.density(params, length)
            assert 0.0 <= value <= 1.0, (name, length, value)
    assert dense.density(dense.DenseParams(), 777) == 1.0


def test_static_index_is_device_and_batch_agnostic():
    index = ashape.build_index(ashape.AShapeParams(4, 32), 100, batch=3, heads=5, block_m=16, block_n=32, head_space="kv")
    assert (index.batch, index.heads, index.head_space) == (3, 5, "kv")
    assert index.full_count.dtype == torch.int32 and index.device.type == "cpu"


def test_pack_candidates_dedupes_and_sorts():
    ids = torch.tensor([[5, 1, 5, 3, 0], [2, 2, 2, 2, 2]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, False, True, True]])
    count, out = _common.pack_candidates(ids, valid, 8)
    assert count.tolist() == [3, 1]
    assert out.tolist() == [[1, 3, 5], [2, 0, 0]]


def test_demos_run(capsys):
    for module in REGISTRY.values():
        module.main()
    assert "#" in capsys.readouterr().out
