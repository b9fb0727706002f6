"""Fused Triton index builds (sparsesearch/kernels/index_build.py, chosen by kernels/dynamic_index.py) against the torch builds they replace.

The fused index must equal the torch ``static_widths=True`` index exactly: every count and every list
entry, padding included. Scores differ between the two only by summation order, so the data is planted
to make them exact in both: q rows are constant over each query block and k rows over each key block
(pooling reproduces them exactly), with entries in multiples of 1/4 of at most 3/4 (exact in bf16 too)
and head_dim 64, so every pooled dot product is a multiple of 1/16 computed without rounding. Such
integer-valued scores tie often, which exercises the tie rule (lower block id first) on every case.
Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from sparsesearch.index import validate
from sparsesearch.kernels.block_sparse import block_sparse_attention
from sparsesearch.kernels.dynamic_index import block_topk_build, vertical_slash_build, vertical_slash_refusal
from sparsesearch.kernels.index_build import pool_blocks
from sparsesearch.patterns import block_topk, vertical_slash

LISTS = ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
DIM = 64


def planted(batch, heads, length, block, seed, dtype=torch.float32):
    """[batch, heads, length, DIM]: rows constant over each block of ``block`` rows, entries in
    {-3, ..., 3} / 4, so block means and their dot products are exact."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-length // block)
    values = torch.randint(-3, 4, (batch, heads, blocks, DIM), generator=gen).float() / 4
    return values.repeat_interleave(block, dim=2)[:, :, :length].to(DEVICE, dtype)


def assert_same_index(got, want):
    """Every list tensor equal, padding included (both builds have static widths)."""
    for name in LISTS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and torch.equal(a, b), name
    assert (got.col_table is None) == (want.col_table is None)
    if got.col_table is not None:  # vertical-slash: the columns restated as table slots (index.ColumnTable)
        for name in ("ids", "bits", "clean", "span"):
            a, b = getattr(got.col_table, name), getattr(want.col_table, name)
            assert a.shape == b.shape and torch.equal(a, b), f"col_table.{name}"
    assert (got.block_m, got.block_n, got.head_space) == (want.block_m, want.block_n, want.head_space)


def topk_pair(params, q, k, space, block_m=16, block_n=32):
    kw = dict(head_space=space, block_m=block_m, block_n=block_n, static_widths=True)
    return block_topk_build(params, q, k, fused=True, **kw), block_topk_build(params, q, k, fused=False, **kw)


CASES = [  # (group, q_len, kv_len, k_blocks, sink_blocks)
    (1, 200, 200, 3, 1),
    (2, 333, 333, 2, 0),
    (4, 133, 333, 4, 2),
    (2, 200, 333, 0, 1),
    (1, 96, 160, 1000, 1),  # k_blocks above every row's open blocks: all of them
    (4, 1, 77, 2, 2),  # a single query row
    (2, 64, 1600, 32, 1),  # the most picks taken one max at a time (index_build.FEW_TAKES) ...
    (2, 64, 1600, 33, 1),  # ... and one more: the bisection top-k
]


@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("group, q_len, kv_len, k_blocks, sink", CASES)
def test_fused_block_topk_equals_torch(space, group, q_len, kv_len, k_blocks, sink):
    kv_heads = 2
    q = planted(2, kv_heads * group, q_len, 16, seed=q_len + group)
    k = planted(2, kv_heads, kv_len, 32, seed=kv_len + 7 * group)
    got, want = topk_pair(block_topk.BlockTopKParams(k_blocks=k_blocks, sink_blocks=sink), q, k, space)
    assert_same_index(got, want)
    assert got.meta["fused"] and torch.equal(got.meta["selection"].blocks, want.meta["selection"].blocks)
    validate(got, q_len, kv_len)


@pytest.mark.slow
@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("q_len, kv_len", [(200, 200), (333, 333), (133, 333)])
@pytest.mark.parametrize("k_blocks", [0, 2, 1000])
@pytest.mark.parametrize("sink", [0, 1, 2])
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (64, 64)])
def test_fused_block_topk_equals_torch_sweep(space, group, q_len, kv_len, k_blocks, sink, block_m, block_n):
    q = planted(2, 2 * group, q_len, block_m, seed=q_len + group)
    k = planted(2, 2, kv_len, block_n, seed=kv_len + 7 * group)
    got, want = topk_pair(block_topk.BlockTopKParams(k_blocks=k_blocks, sink_blocks=sink), q, k, space, block_m, block_n)
    assert_same_index(got, want)


def test_fused_block_topk_bf16_inputs():
    """The runtime's dtype: the planted values are exact in bf16, so the index is the fp32 one."""
    q = planted(2, 4, 200, 16, seed=1, dtype=torch.bfloat16)
    k = planted(2, 2, 200, 32, seed=2, dtype=torch.bfloat16)
    got, want = topk_pair(block_topk.BlockTopKParams(k_blocks=2, sink_blocks=1), q, k, "kv")
    assert_same_index(got, want)


@pytest.mark.parametrize("space", ["query", "kv"])
def test_fused_block_topk_ties_go_to_the_lower_block(space):
    """All keys equal: every open block scores the same, so the k lowest open ids win."""
    q = planted(1, 2, 256, 16, seed=3)
    k = torch.ones(1, 1, 256, DIM, device=DEVICE) / 4
    params = block_topk.BlockTopKParams(k_blocks=2, sink_blocks=1)
    got, want = topk_pair(params, q, k, space)
    assert_same_index(got, want)
    # Query block 15 (rows 240..255): forced sink 0 and diagonal 7, open 1..6 -> the two lowest, 1 and 2.
    assert got.full_idx[0, 0, 15, : got.full_count[0, 0, 15]].tolist() == [0, 1, 2]
    assert got.partial_idx[0, 0, 15, : got.partial_count[0, 0, 15]].tolist() == [7]


def test_fused_block_topk_follows_planted_scores():
    """Not only equal to the reference: a planted favourite block wins over the tie rule's lower ids."""
    q = torch.zeros(1, 1, 256, DIM, device=DEVICE)
    k = torch.zeros(1, 1, 256, DIM, device=DEVICE)
    q[..., 192:, 0] = 1.0
    k[..., 160:192, 0] = 1.0  # key block 5 of 8 (block_n 32)
    index, _ = topk_pair(block_topk.BlockTopKParams(k_blocks=1, sink_blocks=1), q, k, "query")
    assert index.full_idx[0, 0, 12, : index.full_count[0, 0, 12]].tolist() == [0, 5]


def test_pool_blocks_is_the_block_mean():
    x = torch.randn(2, 3, 70, 80).to(DEVICE)
    pooled = pool_blocks(x, 32)
    assert pooled.shape == (2, 3, 128, 3)  # transposed: [B, H, BLOCK_D, blocks]
    assert torch.allclose(pooled[:, :, :80].transpose(-1, -2), block_topk._pool(x, 32), atol=1e-6)
    assert not pooled[:, :, 80:].any()  # padded head dims are 0: they add nothing to a dot


def test_fused_index_drives_the_kernel_like_the_torch_index():
    """Block-sparse attention over the fused index equals attention over the torch index, bit for bit."""
    q = planted(2, 2, 96, 16, seed=11)
    k = planted(2, 1, 200, 32, seed=12)
    v = torch.randn(2, 1, 200, DIM, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    got, want = topk_pair(block_topk.BlockTopKParams(k_blocks=3, sink_blocks=1), q, k, "kv")
    out_fused, lse_fused = block_sparse_attention(q, k, v, got)
    out_torch, lse_torch = block_sparse_attention(q, k, v, want)
    assert torch.equal(out_fused, out_torch) and torch.equal(lse_fused, lse_torch)
    assert bool(torch.isfinite(lse_fused).all())  # every row keeps its diagonal block


def test_dispatch():
    """None: the torch build off CUDA; True refuses what the fused build cannot do, naming why."""
    q, k = planted(1, 2, 64, 16, seed=0).cpu(), planted(1, 2, 64, 16, seed=1).cpu()
    params = block_topk.BlockTopKParams(k_blocks=1, sink_blocks=1)
    assert "fused" not in block_topk_build(params, q, k, static_widths=True, block_m=16, block_n=16).meta
    # Insisting works without static widths too (the fused lists always have them), on the suite's device.
    assert block_topk_build(params, q.to(DEVICE), k.to(DEVICE), block_m=16, block_n=16, fused=True).meta["fused"]
    with pytest.raises(ValueError, match="row_pos"):
        block_topk_build(params, q, k, block_m=16, block_n=16, static_widths=True, fused=True,
                               row_pos=torch.arange(64))
    with pytest.raises(ValueError, match="dtypes"):
        block_topk_build(params, q.long(), k.long(), block_m=16, block_n=16, static_widths=True, fused=True)


def test_benchmark_helpers_on_cpu():
    """benchmarks/index_build.py (GPU only) imports, and its build and comparison helpers are right."""
    from benchmarks import index_build as bench
    from sparsesearch.execute import HeadGroup, build_group_index

    q, k = planted(1, 4, 200, 64, seed=5), planted(1, 2, 200, 64, seed=6)
    g = HeadGroup("block_topk", block_topk.BlockTopKParams(k_blocks=1, sink_blocks=1), (1,), 64, 64)
    assert bench.has_fused(g, q, k) and not bench.has_fused(HeadGroup("triangle", None, (1,), 64, 64), q, k)
    fused = bench.fused_build(g, q, k, fused=True)()
    want = build_group_index(g, q, k, "kv")  # synced widths: narrower lists, same entries
    assert fused.meta["fused"] and fused.heads == 1 and bench.same_lists(fused, want)
    other = block_topk_build(g.params, q[:, 2:], k[:, 1:], head_space="kv", block_m=64, block_n=64)
    moved = block_topk_build(block_topk.BlockTopKParams(k_blocks=0, sink_blocks=0), q[:, 2:], k[:, 1:],
                                   head_space="kv", block_m=64, block_n=64)
    assert bench.same_lists(other, want) and not bench.same_lists(moved, want)
    row = {"pattern": "block_topk", "n": 200, "block_density": 0.5, "index_fused_over_sdpa": None, "index_graph_over_sdpa": 0.1}
    row |= {f"{c}_ms": None if c == "index_fused" else 1.0 for c in bench.COLUMNS}
    lines = bench.table([row]).splitlines()
    assert len(lines) == 2 and all(c in lines[0] for c in bench.COLUMNS) and " - " in lines[1]


# ------------------------------------------------------------------------------------------ vertical-slash
#
# The estimate's line scores are sums of softmax probabilities: no planting makes them exact in two
# implementations. The data is random instead, and each case first checks on the torch scores that the
# top-k boundary (the take-th vs the next value of every head) is far from a tie (1e-4 relative, fp32
# rounding is ~1e-6) and that no diagonal lies that close to the slash floor, trying a few seeds; the
# index must then be equal exactly. Scores of exactly 0 (below the floor, or one row's line) tie in both
# implementations and go to the lower id. Exact ties get their own test (q = 0: uniform rows, so every
# fully visible column and diagonal ties in both implementations).


def boundary_gap(sums, take: int, force: int) -> float:
    """Smallest relative gap, over heads, between the take-th and the next largest of sums [B, H, N] with
    the first ``force`` entries forced (+inf); inf when every entry is taken or the two are both exactly 0."""
    sums = sums.clone()
    sums[..., :force] = float("inf")
    if take >= sums.shape[-1]:
        return float("inf")
    top = sums.sort(dim=-1, descending=True).values
    edge, after = top[..., take - 1], top[..., take]
    gap = (edge - after) / after.abs().clamp(min=1e-30)
    return float(torch.where((edge == 0) & (after == 0), float("inf"), gap).min())


def floor_gap(diag, floor: float) -> float:
    """Smallest relative distance of the discounted diagonal sums [B, H, N] to the slash floor."""
    return float(((diag - floor).abs() / floor).min())


def separated_qk(params, batch, q_heads, kv_heads, q_len, kv_len, space, dtype=torch.float32):
    """Random q, k whose vertical and slash top-k boundaries are not near-ties (see above)."""
    from sparsesearch.patterns._common import last_q_sums

    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        q = (torch.randn(batch, q_heads, q_len, DIM, generator=gen) * 2).to(dtype)
        k = torch.randn(batch, kv_heads, kv_len, DIM, generator=gen).to(dtype)
        _, raw = last_q_sums(q, k, params.last_q, head_space=space, discount=True)
        cols, diag = vertical_slash.line_scores(params, q, k, head_space=space)
        v, s = min(params.vertical_size, kv_len), min(params.slash_size, kv_len)
        gaps = (boundary_gap(cols, v, vertical_slash.forced(params.force_vertical, params.vertical_size)),
                boundary_gap(diag, s, vertical_slash.forced(params.force_slash, params.slash_size)),
                floor_gap(raw, vertical_slash.slash_floor(params.last_q, q, k, space)))
        if min(gaps) > 1e-4:
            return q.to(DEVICE), k.to(DEVICE)
    raise AssertionError("no seed gives separated top-k boundaries; pick other shapes")


def vs_pair(params, q, k, space, block_m=16, block_n=32):
    kw = dict(head_space=space, block_m=block_m, block_n=block_n, static_widths=True)
    return vertical_slash_build(params, q, k, fused=True, **kw), vertical_slash_build(params, q, k, fused=False, **kw)


def assert_same_lines(got, want):
    a, b = got.meta["lines"], want.meta["lines"]
    assert torch.equal(a.vertical, b.vertical) and torch.equal(a.slash, b.slash)
    assert (a.q_len, a.kv_len, a.head_space) == (b.q_len, b.kv_len, b.head_space)


VS_CASES = [  # (group, q_len, kv_len, vertical_size, slash_size, last_q)
    (1, 200, 200, 24, 16, 16),
    (2, 333, 333, 40, 30, 64),
    (4, 133, 333, 24, 16, 16),
    (2, 200, 333, 1000, 8, 16),  # every column a vertical
    (1, 1, 77, 8, 8, 64),  # one query row: last_q cut to it
]


@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("group, q_len, kv_len, vertical, slash, last_q", VS_CASES)
def test_fused_vertical_slash_equals_torch(space, group, q_len, kv_len, vertical, slash, last_q):
    params = vertical_slash.VerticalSlashParams(vertical_size=vertical, slash_size=slash, last_q=last_q,
                                                force_vertical=3, force_slash=2)
    q, k = separated_qk(params, 2, 2 * group, 2, q_len, kv_len, space)
    got, want = vs_pair(params, q, k, space)
    assert_same_index(got, want)
    assert_same_lines(got, want)
    assert got.meta["fused"]
    validate(got, q_len, kv_len)


@pytest.mark.slow
@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("q_len, kv_len", [(200, 200), (333, 333), (133, 333)])
@pytest.mark.parametrize("vertical, slash, force", [(24, 16, 0), (40, 30, 5), (1000, 1000, 30)])
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (64, 64)])
def test_fused_vertical_slash_equals_torch_sweep(space, group, q_len, kv_len, vertical, slash, force, block_m, block_n):
    params = vertical_slash.VerticalSlashParams(vertical_size=vertical, slash_size=slash, last_q=64,
                                                force_vertical=force, force_slash=force)
    q, k = separated_qk(params, 2, 2 * group, 2, q_len, kv_len, space)
    got, want = vs_pair(params, q, k, space, block_m, block_n)
    assert_same_index(got, want)
    assert_same_lines(got, want)


@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("vertical, slash, force", [(10, 8, 2), (3, 10, 0), (10, 1, 1)])
def test_fused_vertical_slash_chunked_top_equals_torch(monkeypatch, space, vertical, slash, force):
    """Keys past one program's lanes: per-chunk candidates, then their top-k, equal to the torch build
    (chunks of 64 keys here stand in for VS_TOP_LANES = 32768; the last chunk is short)."""
    from sparsesearch.kernels import index_build

    monkeypatch.setattr(index_build, "VS_TOP_LANES", 64)
    params = vertical_slash.VerticalSlashParams(vertical_size=vertical, slash_size=slash, last_q=16,
                                                force_vertical=force, force_slash=force)
    q, k = separated_qk(params, 2, 4, 2, 300, 333, space)
    got, want = vs_pair(params, q, k, space)
    assert_same_index(got, want)
    assert_same_lines(got, want)


@pytest.mark.parametrize("space", ["query", "kv"])
@pytest.mark.parametrize("block_m, block_n, slash", [(16, 32, 3), (32, 16, 2), (64, 64, 30)])
def test_fused_vertical_slash_walks_tiles_and_merges_stats(monkeypatch, space, block_m, block_n, slash):
    """Long key axes: the index pass walks key blocks and verticals a tile at a time, and the row stats of
    many chunks merge over several steps (tiles of 4, chunks of 64 keys and merge steps of 2 chunks here
    stand in for 1024, 1024 and 16); lists at their narrow static widths, equal to the torch build."""
    from sparsesearch.kernels import index_build

    monkeypatch.setattr(index_build, "VS_INDEX_TILE", 4)
    monkeypatch.setattr(index_build, "VS_CHUNK", 64)
    monkeypatch.setattr(index_build, "VS_MERGE_TILE", 2)
    # 70 verticals: three tiles of the column walk, which never goes below 32 lanes (one table word per 32).
    params = vertical_slash.VerticalSlashParams(vertical_size=70, slash_size=slash, last_q=16, force_vertical=2, force_slash=1)
    q, k = separated_qk(params, 2, 4, 2, 300, 333, space)
    got, want = vs_pair(params, q, k, space, block_m, block_n)
    assert_same_index(got, want)
    assert_same_lines(got, want)
    kv_blocks = -(-333 // block_n)
    assert (got.full_idx.shape[-1], got.partial_idx.shape[-1]) == vertical_slash.list_widths(slash, kv_blocks, block_m, block_n)
    assert got.partial_idx.shape[-1] < kv_blocks


def test_list_widths_bound_every_count():
    """The static widths hold every query block's lists: random lines over shapes and offsets."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        block_m, block_n = (16, 32, 64)[torch.randint(3, (1,), generator=gen)], (16, 32, 64)[torch.randint(3, (1,), generator=gen)]
        kv_len = int(torch.randint(64, 600, (1,), generator=gen))
        q_len = int(torch.randint(1, kv_len + 1, (1,), generator=gen))
        n_slash = int(torch.randint(1, 12, (1,), generator=gen))
        slash = torch.randperm(kv_len, generator=gen)[:n_slash].sort().values.view(1, 1, -1)
        vertical = torch.randperm(kv_len, generator=gen)[:5].sort().values.view(1, 1, -1)
        lines = vertical_slash.VSLines(vertical, slash, q_len, kv_len, "query")
        index = vertical_slash.index_from_lines(lines, block_m=block_m, block_n=block_n)
        full_w, part_w = vertical_slash.list_widths(n_slash, -(-kv_len // block_n), block_m, block_n)
        assert int(index.full_count.max()) <= full_w and int(index.partial_count.max()) <= part_w


@pytest.mark.parametrize("space", ["query", "kv"])
def test_fused_vertical_slash_reduces_candidates_in_stages(monkeypatch, space):
    """More candidates than one program holds (6 chunks x 20 lines = 120 > 64 lanes): a middle stage keeps
    each group's best before the merge (128K keys and > 8K lines at VS_TOP_LANES = 32768), still equal to the
    torch build."""
    from sparsesearch.kernels import index_build

    monkeypatch.setattr(index_build, "VS_TOP_LANES", 64)
    launched = []

    class Spy:  # records the grids of the middle stage's launches
        def __getitem__(self, grid, kernel=index_build._vs_top_reduce):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(index_build, "_vs_top_reduce", Spy())
    params = vertical_slash.VerticalSlashParams(vertical_size=20, slash_size=12, last_q=16, force_vertical=3, force_slash=3)
    q, k = separated_qk(params, 2, 4, 2, 300, 333, space)
    got, want = vs_pair(params, q, k, space)
    assert launched and launched[0][2] == 2  # 120 candidates in two groups of 64, then 40 to merge
    assert_same_index(got, want)
    assert_same_lines(got, want)


def test_fused_vertical_slash_refuses_too_many_candidates(monkeypatch):
    from sparsesearch.kernels import index_build

    monkeypatch.setattr(index_build, "VS_TOP_LANES", 64)
    params = vertical_slash.VerticalSlashParams(vertical_size=40, slash_size=8, last_q=16)
    q, k = torch.randn(1, 2, 300, DIM, device=DEVICE), torch.randn(1, 2, 333, DIM, device=DEVICE)
    assert "takes at most 32" in vertical_slash_refusal(params, q, k)


def test_fused_vertical_slash_bf16_inputs():
    params = vertical_slash.VerticalSlashParams(vertical_size=24, slash_size=16, last_q=16, force_vertical=2, force_slash=2)
    q, k = separated_qk(params, 2, 4, 2, 200, 200, "kv", dtype=torch.bfloat16)
    got, want = vs_pair(params, q, k, "kv")
    assert_same_index(got, want)


@pytest.mark.parametrize("space", ["query", "kv"])
def test_fused_vertical_slash_ties_go_to_the_lower_line(space):
    """q = 0: every row is uniform, so all columns and offsets that every estimate row sees tie; the
    lowest ids win after the forced ones (which are the lowest too)."""
    params = vertical_slash.VerticalSlashParams(vertical_size=6, slash_size=5, last_q=16, force_vertical=2, force_slash=1)
    q, k = torch.zeros(1, 2, 160, DIM), torch.randn(1, 1, 160, DIM, generator=torch.Generator().manual_seed(0))
    q, k = q.to(DEVICE), k.to(DEVICE)
    got, want = vs_pair(params, q, k, space)
    assert_same_index(got, want)
    assert_same_lines(got, want)
    lines = got.meta["lines"]
    assert lines.vertical[0, 0].tolist() == list(range(6)) and lines.slash[0, 0].tolist() == list(range(5))


def test_fused_vertical_slash_index_drives_the_kernel_like_the_torch_index():
    params = vertical_slash.VerticalSlashParams(vertical_size=24, slash_size=2, last_q=16, force_vertical=2, force_slash=1)
    q, k = separated_qk(params, 2, 2, 1, 96, 200, "kv")
    v = torch.randn(2, 1, 200, DIM, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    got, want = vs_pair(params, q, k, "kv")
    out_fused, lse_fused = block_sparse_attention(q, k, v, got)
    out_torch, lse_torch = block_sparse_attention(q, k, v, want)
    assert torch.equal(out_fused, out_torch) and torch.equal(lse_fused, lse_torch)
    assert int(got.col_count.sum()) > 0  # the gathered-column path ran


def test_vertical_slash_dispatch():
    params = vertical_slash.VerticalSlashParams(vertical_size=8, slash_size=8, last_q=128)
    q, k = torch.randn(1, 2, 200, DIM), torch.randn(1, 2, 200, DIM)
    assert "fused" not in vertical_slash_build(params, q, k, static_widths=True, block_m=16, block_n=16).meta
    with pytest.raises(ValueError, match="last_q 128"):
        vertical_slash_build(params, q, k, block_m=16, block_n=16, static_widths=True, fused=True)
    with pytest.raises(ValueError, match="head_dim 8"):
        vertical_slash_build(params, q[..., :8], k[..., :8], block_m=16, block_n=16, static_widths=True, fused=True)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled (not interpreted) kernels need a GPU")


@GPU
def test_unasked_fused_build_takes_wide_key_axes():
    """fused=None on CUDA: the fused builds (static widths asked or not) at every key axis they take: block
    top-k up to MAX_KEY_BLOCKS (past that the torch build, and fused=True says why it cannot), vertical-slash
    at any length."""
    from sparsesearch.kernels.index_build import MAX_KEY_BLOCKS

    q, k = planted(1, 2, 64, 16, seed=0).cuda(), planted(1, 1, MAX_KEY_BLOCKS * 16, 16, seed=1).cuda()
    params = block_topk.BlockTopKParams(k_blocks=2, sink_blocks=1)
    kw = dict(head_space="kv", block_m=16, block_n=16)
    assert block_topk_build(params, q, k, **kw).meta["fused"]
    assert block_topk_build(params, q, k, static_widths=True, **kw).meta["fused"]
    long_k = planted(1, 1, (MAX_KEY_BLOCKS + 1) * 16, 16, seed=1).cuda()
    assert "fused" not in block_topk_build(params, q, long_k, **kw).meta
    with pytest.raises(ValueError, match=f"{MAX_KEY_BLOCKS + 1} key blocks"):
        block_topk_build(params, q, long_k, fused=True, **kw)
    vs = vertical_slash.VerticalSlashParams(vertical_size=8, slash_size=8, last_q=16)
    assert vertical_slash_build(vs, q, k, **kw).meta["fused"]  # 2048 key blocks: a chunked top-k
    # Vertical-slash walks key blocks in tiles at narrow widths: no key-axis limit.
    got = vertical_slash_build(vs, q, long_k, static_widths=True, **kw)
    assert got.meta["fused"] and got.full_idx.shape[-1] == 8 * 2
    assert_same_index(got, vertical_slash_build(vs, q, long_k, static_widths=True, fused=False, **kw))


@GPU
@pytest.mark.parametrize("space", ["query", "kv"])
def test_fused_builds_on_gpu_equal_torch(space):
    """The runtime's shapes on the compiled kernels: bf16, head_dim 128, GQA 4, blocks 64 x 64, 2K tokens."""
    q = planted(1, 8, 2048, 64, seed=21, dtype=torch.bfloat16).cuda()
    k = torch.cat([planted(1, 2, 2048, 64, seed=22), torch.zeros(1, 2, 2048, 128 - DIM, device=DEVICE)], -1).to("cuda", torch.bfloat16)
    q = torch.cat([q, torch.zeros_like(q)], -1)  # head_dim 128, the planted half carries the scores
    kw = dict(head_space=space, static_widths=True)
    params = block_topk.BlockTopKParams(k_blocks=3, sink_blocks=1)
    assert_same_index(block_topk_build(params, q, k, **kw), block_topk_build(params, q, k, fused=False, **kw))
    vs = vertical_slash.VerticalSlashParams(vertical_size=64, slash_size=128, last_q=64, force_vertical=30, force_slash=64)
    q, k = separated_qk(vs, 1, 8, 2, 1024, 1024, space)
    q, k = q.cuda(), k.cuda()
    got, want = vertical_slash_build(vs, q, k, **kw), vertical_slash_build(vs, q, k, fused=False, **kw)
    assert got.meta["fused"]
    assert_same_index(got, want)
