"""Kernels against the torch oracle (CPU: TRITON_INTERPRET=1 at tiny shapes; GPU when present).

Tolerance follows flash-attention's tests: the kernel's error against the fp32 reference must stay within
twice the error of the same reference computed in the inputs' low precision, plus a small floor.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from indices import dense_causal_index, random_index
from sparsesearch.index import BlockIndex, stack, validate
from sparsesearch.kernels import block_sparse_attention, tail_attention, triangle_attention
from sparsesearch.merge import merge_partials, merge_two
from sparsesearch.kernels.torch_sparse import block_sparse_attention_torch
from sparsesearch.patterns import vertical_slash
from sparsesearch.reference import error_floor, index_mask_fn, masked_attention, predicate_mask_fn, relative_error

FLOOR = {dtype: error_floor(dtype, DEVICE) for dtype in (torch.float16, torch.bfloat16, torch.float32)}


def qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(batch, h, n, dim, generator=gen).to(dtype).to(DEVICE)
    return make(q_heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def assert_close(out, lse, q, k, v, mask_fn):
    """Kernel (out, lse) vs the fp32 oracle, within 2x the low-precision oracle's own error."""
    ref_o, ref_l = masked_attention(q, k, v, mask_fn)
    low_o, _ = masked_attention(q, k, v, mask_fn, upcast=False)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    budget = 2 * relative_error(low_o, ref_o) + FLOOR[q.dtype]
    assert relative_error(out, ref_o) <= budget, (relative_error(out, ref_o), budget)
    empty = torch.isinf(ref_l)
    assert torch.equal(torch.isinf(lse), empty), "empty rows must have lse = -inf exactly where the oracle has"
    assert bool((out[empty] == 0).all()), "empty rows must be zeros"
    torch.testing.assert_close(lse[~empty], ref_l[~empty].float(), atol=budget * 10 + 1e-4, rtol=0)


CASES = [
    # batch, q_heads, kv_heads, q_len, kv_len, dim, block_m, block_n, dtype
    (2, 4, 4, 100, 100, 64, 32, 32, torch.bfloat16),
    (2, 3, 1, 77, 77, 80, 16, 32, torch.float16),
    (1, 8, 2, 130, 130, 128, 32, 16, torch.bfloat16),
    (1, 8, 1, 64, 96, 64, 16, 16, torch.float16),
    (2, 6, 2, 50, 120, 96, 16, 64, torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_hq{}_hk{}_q{}_k{}_d{}_m{}_n{}_{}".format(*c[:8], str(c[8])[6:]))
@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_random_index_matches_oracle(case, head_space):
    batch, q_heads, kv_heads, q_len, kv_len, dim, bm, bn, dtype = case
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype)
    heads = kv_heads if head_space == "kv" else q_heads
    index = random_index(batch, heads, q_len, kv_len, bm, bn, columns=5, head_space=head_space, device=DEVICE)
    validate(index, q_len, kv_len)
    out, lse = block_sparse_attention(q, k, v, index)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    group = q_heads // kv_heads if head_space == "kv" else 1
    assert_close(out, lse, q, k, v, index_mask_fn(index, q_len, kv_len, group))


@pytest.mark.parametrize("dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_all_blocks_is_dense_causal(dim, group):
    """An index listing every causal block reproduces causal SDPA."""
    q, k, v = qkv(1, group, 1, 90, 90, dim, torch.float16, seed=group)
    index = dense_causal_index(1, group, 90, 90, 32, 32, device=DEVICE)
    out, lse = block_sparse_attention(q, k, v, index)
    assert_close(out, lse, q, k, v, None)
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert relative_error(out, sdpa) < 2e-3


def test_window_and_sink_mask_is_token_exact():
    """A-shape semantics in partial blocks: j < sink or pos - j < window, causal (full blocks unmasked)."""
    q, k, v = qkv(2, 4, 2, 150, 150, 64, torch.bfloat16, seed=3)
    index = random_index(2, 2, 150, 150, 32, 32, density=1.1, window=40, sink=5, head_space="kv", device=DEVICE)
    out, lse = block_sparse_attention(q, k, v, index)

    def ashape(b, h, pos, j):
        return (j < 5) | (pos - j < 40)

    assert_close(out, lse, q, k, v, predicate_mask_fn(ashape, 2, 4, 150, 150))


def test_empty_rows_give_zeros_not_nan():
    q, k, v = qkv(1, 2, 2, 70, 70, 64, torch.float16)
    # Query block 0 (rows 0..31) lists only key block 1 (keys 16..31): rows 0..15 admit nothing.
    full = torch.zeros(1, 2, 3, 5, dtype=torch.bool)
    partial = torch.zeros_like(full)
    partial[:, :, 0, 1] = True
    partial[:, 1, 2, 4] = True
    from sparsesearch.index import from_block_masks

    index = from_block_masks(full, partial, 32, 16).to(DEVICE)
    out, lse = block_sparse_attention(q, k, v, index)
    assert_close(out, lse, q, k, v, index_mask_fn(index, 70, 70))
    assert bool(torch.isinf(lse[0, 0, :16]).all()) and bool((out[0, 0, :16] == 0).all())
    assert bool(torch.isinf(lse[0, 0, 32:]).all())  # no blocks at all for later rows of head 0


def varlen_qkv(lens_q, lens_k, q_heads, kv_heads, dtype, seed, dim=64):
    """Packed q [sum(lens_q), Hq, D], k/v [sum(lens_k), Hkv, D] (random, ``dtype``) and their int32 cu_seqlens."""
    cu_q, cu_k = (torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), q_heads, dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    return cu_q, cu_k, q, k, v


def test_varlen_matches_per_sequence():
    lens_q, lens_k = [70, 1, 33], [90, 5, 33]
    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 6, 2, torch.half, seed=7)
    # One index per sequence (its own causal offset), stacked and padded to the longest.
    parts = [random_index(1, 2, lq, lk, 16, 16, columns=4, head_space="kv", seed=b, device=DEVICE)
             for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    index = stack(parts)
    out, lse = block_sparse_attention(q, k, v, index, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == q.shape and lse.shape == (6, 104)
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sub = lambda t, s: t[s].transpose(0, 1)[None]
        one = parts[b]
        mask = index_mask_fn(one, lens_q[b], lens_k[b], group=3)
        assert_close(sub(out, qs), lse[:, qs][None], sub(q, qs), sub(k, ks), sub(v, ks), mask)


def test_expanded_batch_index_and_strided_inputs():
    """An index built once for B=1 drives a batch; q/k/v may be non-contiguous views (e.g. transposes)."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(2, 96, 4, 64, generator=gen).bfloat16().to(DEVICE)
    q = base.transpose(1, 2)  # [B, H, N, D] view with strides of [B, N, H, D]
    k = v = base[:, :, :2].transpose(1, 2)
    index = random_index(1, 2, 96, 96, 32, 32, head_space="kv", device=DEVICE).expand_batch(2)
    out, lse = block_sparse_attention(q, k, v, index)
    assert_close(out, lse, q, k, v, index_mask_fn(index, 96, 96, group=2))


@pytest.mark.parametrize("last", [1, 24, 64, 200])
def test_triangle_matches_predicate(last):
    sink, window, n = 8, 32, 150
    q, k, v = qkv(2, 4, 2, n, n, 64, torch.bfloat16, seed=last)
    split = max(0, n - last)
    full = torch.zeros(2, 2, 5, 5, dtype=torch.bool)
    partial = torch.zeros_like(full)
    from sparsesearch.index import from_block_masks

    qi, ki = torch.arange(5)[:, None], torch.arange(5)[None, :]
    near = (ki <= qi) & ((qi * 32 - (ki + 1) * 32 + 1 < window) | (ki * 32 < sink))  # any key of the block in the mask
    partial[:] = near
    index = from_block_masks(full, partial, 32, 32, head_space="kv", window=window, sink=sink).to(DEVICE)
    out, lse = triangle_attention(q, k, v, index, last)

    def triangle(b, h, pos, j):
        return (j < sink) | (pos - j < window) | (pos >= split)

    assert_close(out, lse, q, k, v, predicate_mask_fn(triangle, 2, 4, n, n))


def test_triangle_varlen_merges_tails_in_place():
    """Varlen triangle: each sequence's last rows (all of a sequence shorter than ``last``, keys past a short
    one's end in empty splits) attend every causal key, merged in place over the streaming rows; given
    out/lse are written and returned."""
    lens_q, lens_k, last = [70, 10, 33], [90, 10, 33], 24
    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, torch.bfloat16, seed=9)
    parts = [random_index(1, 2, lq, lk, 16, 16, head_space="kv", seed=b, device=DEVICE) for b, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    out_buf = torch.full_like(q, float("nan"))
    lse_buf = torch.full((4, 113), float("nan"), device=DEVICE)
    out, lse = triangle_attention(q, k, v, stack(parts), last, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=out_buf, lse=lse_buf)
    assert out.data_ptr() == out_buf.data_ptr() and lse.data_ptr() == lse_buf.data_ptr()
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sub = lambda t, s: t[s].transpose(0, 1)[None]
        streamed = index_mask_fn(parts[b], lens_q[b], lens_k[b], group=2)

        def mask(rows, streamed=streamed, lq=lens_q[b], lk=lens_k[b]):
            tail = (rows >= lq - last)[None, None, :, None]
            causal = torch.arange(lk, device=rows.device)[None, None, None, :] <= (rows + lk - lq)[None, None, :, None]
            return torch.where(tail, causal, streamed(rows))

        assert_close(sub(out, qs), lse[:, qs][None], sub(q, qs), sub(k, ks), sub(v, ks), mask)


def test_tail_varlen_rows_past_short_sequences_are_empty():
    cu = torch.tensor([0, 100, 110], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(110, 2, 64, generator=gen).to(DEVICE)
    k = torch.randn(110, 1, 64, generator=gen).to(DEVICE)
    out, lse = tail_attention(q, k, k, 32, cu_seqlens_q=cu, cu_seqlens_k=cu, splits=3)
    ref, _ = masked_attention(q[:100].transpose(0, 1)[None], k[:100].transpose(0, 1)[None], k[:100].transpose(0, 1)[None])
    assert relative_error(out[0], ref[0, :, -32:]) < FLOOR[torch.float32]
    assert bool(torch.isinf(lse[1, :, 10:]).all()) and bool((out[1, :, 10:] == 0).all())


def test_merge_is_exact_and_handles_empty():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 40, 64, generator=gen)
    k = torch.randn(1, 2, 40, 64, generator=gen)
    v = torch.randn(1, 2, 40, 64, generator=gen)
    cols = torch.arange(40)
    left = lambda rows: (cols[None, :] < 17)[None, None].expand(1, 1, rows.numel(), 40)
    right = lambda rows: (cols[None, :] >= 17)[None, None].expand(1, 1, rows.numel(), 40)
    o_a, l_a = masked_attention(q, k, v, left)
    o_b, l_b = masked_attention(q, k, v, right)
    full_o, full_l = masked_attention(q, k, v, lambda rows: torch.ones(1, 1, rows.numel(), 40, dtype=torch.bool))
    out, lse = merge_two(o_a, l_a, o_b, l_b)
    assert relative_error(out, full_o) < 1e-6 and torch.allclose(lse, full_l, atol=1e-5)
    empty = torch.full_like(l_a, float("-inf"))
    out, lse = merge_partials(torch.stack([o_a * 0, o_a * 0]), torch.stack([empty, empty]))
    assert not torch.isnan(out).any() and bool((out == 0).all()) and bool(torch.isinf(lse).all())


# ---------------------------------------------------------------- bad input: ValueError before any launch
def _good():
    q, k, v = qkv(1, 4, 2, 64, 64, 64, torch.float16)
    return q, k, v, dense_causal_index(1, 4, 64, 64, 32, 32, device=DEVICE)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v, i: (q[..., :48].contiguous(), k, v, i), "head_dim must be one of"),
        (lambda q, k, v, i: (q, k.float(), v, i), "dtype"),
        (lambda q, k, v, i: (q.int(), k, v, i), "dtype must be one of"),
        (lambda q, k, v, i: (q[:, :3], k, v, i), "multiple of KV heads"),
        (lambda q, k, v, i: (q, k, v[:, :, :10], i), "shapes differ"),
        (lambda q, k, v, i: (q, k[:, :, :10], v[:, :, :10], i), "exceeds kv length"),
        (lambda q, k, v, i: (q[:, :, :0], k, v, i), "empty"),
        (lambda q, k, v, i: (q.transpose(-1, -2), k, v, i), "contiguous in head_dim"),
        (lambda q, k, v, i: (q, k, v, dense_causal_index(1, 2, 64, 64, 32, 32, device=DEVICE)), "heads"),
        (lambda q, k, v, i: (q, k, v, dense_causal_index(1, 4, 32, 32, 32, 32, device=DEVICE)), "query blocks"),
        (lambda q, k, v, i: (q, k, v, dense_causal_index(2, 4, 64, 64, 32, 32, device=DEVICE)), "batch"),
    ],
)
def test_bad_input_raises(mutate, message):
    q, k, v, index = mutate(*_good())
    with pytest.raises(ValueError, match=message):
        block_sparse_attention(q, k, v, index)


def test_bad_index_raises():
    with pytest.raises(ValueError, match="block_m must be one of"):
        BlockIndex(torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                   torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32), block_m=48, block_n=64)
    with pytest.raises(ValueError, match="int32"):
        BlockIndex(torch.zeros(1, 1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                   torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32), 64, 64)
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32)
    unsorted = BlockIndex(zeros(1, 1, 2), zeros(1, 1, 2, 1), torch.tensor([[[1, 2]]], dtype=torch.int32),
                          torch.tensor([[[[0, 0], [1, 0]]]], dtype=torch.int32), 32, 32)
    with pytest.raises(ValueError, match="ascending"):
        validate(unsorted, 64)
    over = random_index(1, 1, 64, 64, 32, 32, density=1.1)
    over.partial_idx[0, 0, 0, 0] = 1  # block 1 (keys 32..63) for rows 0..31: above the diagonal
    with pytest.raises(ValueError, match="above the causal diagonal"):
        validate(over, 64)
    cu = torch.tensor([0, 10, 5], dtype=torch.int32)
    q = torch.randn(5, 1, 64)
    with pytest.raises(ValueError, match="non-decreasing"):
        block_sparse_attention(q, q, q, random_index(2, 1, 10, 10, 16, 16), cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("variant", [{"tma": True}], ids=str)
@pytest.mark.parametrize("window", [-1, 30])
@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_launch_variants_are_bitwise_equal(head_space, variant, window):
    """Full tiles as TMA copies (descriptor loads) give the same bits as pointer loads, with a head map,
    partial blocks, gathered columns and a window on the partial blocks."""
    q, k, v = qkv(2, 6, 2, 90, 90, 64, torch.float16, seed=5)
    ids = [1] if head_space == "kv" else [0, 4, 5]
    index = random_index(2, len(ids), 90, 90, 16, 32, columns=3, head_space=head_space, seed=2, device=DEVICE)
    if window > 0:  # full blocks stay unmasked, partial blocks take the window/sink mask
        index = replace(index, window=window, sink=3)
    heads = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    base = {"TILE_N": 32, "num_warps": 4, "num_stages": 1}
    a = block_sparse_attention(q, k, v, index, heads=heads, out=torch.zeros_like(q), lse=torch.zeros(2, 6, 90, device=DEVICE), config=base)
    b = block_sparse_attention(q, k, v, index, heads=heads, out=torch.zeros_like(q), lse=torch.zeros(2, 6, 90, device=DEVICE),
                               config=base | variant)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("varlen", [False, True])
def test_stacked_gqa_heads_are_bitwise_equal(varlen):
    """Programs that stack 2 or 4 query heads of a GQA group (one kv-space index row) give the bits of one head
    per program (on a GPU, that within the MMA's rounding): batch 2 (varlen: uneven lengths), a head map, a
    window, gathered columns and partial blocks past the edge."""
    base = {"TILE_N": 16, "num_warps": 4, "num_stages": 1}
    heads = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    if varlen:
        cu_q, cu_k, q, k, v = varlen_qkv([70, 33], [90, 33], 8, 2, torch.half, seed=3)
        index = stack([random_index(1, 1, lq, lk, 16, 16, columns=3, head_space="kv", seed=b, device=DEVICE)
                       for b, (lq, lk) in enumerate(([70, 90], [33, 33]))])
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        fresh = lambda: dict(out=torch.zeros_like(q), lse=torch.zeros(8, q.shape[0], device=DEVICE))  # noqa: E731
    else:
        q, k, v = qkv(2, 8, 2, 75, 90, 64, torch.float16, seed=6)
        index = replace(random_index(2, 1, 75, 90, 16, 16, columns=5, head_space="kv", seed=4, device=DEVICE), window=40, sink=2)
        kw = {}
        fresh = lambda: dict(out=torch.zeros_like(q), lse=torch.zeros(2, 8, 75, device=DEVICE))  # noqa: E731
    one = block_sparse_attention(q, k, v, index, heads=heads, config=base | {"pack": 1}, **kw, **fresh())
    assert bool((one[0] != 0).any())
    for pack in (2, 4, None):  # None: the launcher's own choice (4 here: 16-row blocks, groups of 4)
        got = block_sparse_attention(q, k, v, index, heads=heads, config=base | ({} if pack is None else {"pack": pack}), **kw, **fresh())
        if DEVICE == "cpu":
            assert torch.equal(one[0], got[0]) and torch.equal(one[1], got[1]), pack
        else:  # 64 stacked rows take warpgroup MMAs, 16 take mma.sync: each rounds its fp32 sums its own way
            torch.testing.assert_close(got[0], one[0], atol=2e-3, rtol=0, msg=f"pack {pack}")
            torch.testing.assert_close(got[1], one[1], atol=1e-4, rtol=1e-5, msg=f"pack {pack}")


@pytest.mark.parametrize("block_m", [64, 128])
def test_narrow_column_tiles_at_128_rows(block_m):
    """At 128 rows per program (2 stacked 64-row heads, or one 128-row block) gathered columns go in tiles half
    as wide as the key tiles: ragged column lists over several such tiles match the oracle."""
    q, k, v = qkv(1, 4, 2, 300, 300, 64, torch.float16, seed=8)
    index = random_index(1, 2, 300, 300, block_m, 64, columns=75, head_space="kv", seed=3, device=DEVICE)
    assert int(index.col_count.max()) > 64  # more than two 32-wide column tiles in some block
    out, lse = block_sparse_attention(q, k, v, index, config={"TILE_N": 64, "num_warps": 4, "num_stages": 1})
    assert_close(out, lse, q, k, v, index_mask_fn(index, 300, 300, group=2))


def test_pack_choice_and_bad_pack():
    """Heads stack up to 128 rows, only for a kv-space index and head_dim <= 128, and only in packs that divide
    the GQA group; an explicit pack that cannot apply is a ValueError before launch."""
    from sparsesearch.kernels.block_sparse import _pack

    kv = random_index(1, 2, 64, 64, 64, 64, head_space="kv", device=DEVICE)
    assert _pack(kv, 4, 128) == 2 and _pack(kv, 3, 128) == 1 and _pack(kv, 4, 256) == 1
    assert _pack(replace(kv, block_m=16), 6, 64) == 2 and _pack(replace(kv, block_m=128), 4, 128) == 1
    assert _pack(random_index(1, 2, 64, 64, 64, 64, columns=2, head_space="kv", device=DEVICE), 4, 128) == 2
    assert _pack(random_index(1, 8, 64, 64, 64, 64, head_space="query", device=DEVICE), 4, 128) == 1
    q, k, v = qkv(1, 8, 2, 64, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="pack=2 needs a kv head space"):
        block_sparse_attention(q, k, v, random_index(1, 8, 64, 64, 16, 16, head_space="query", device=DEVICE), config={"pack": 2})
    with pytest.raises(ValueError, match="GQA group"):
        block_sparse_attention(q, k, v, random_index(1, 2, 64, 64, 16, 16, head_space="kv", device=DEVICE), config={"pack": 8})
    for bad in (0, 3, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            block_sparse_attention(q, k, v, random_index(1, 2, 64, 64, 16, 16, head_space="kv", device=DEVICE), config={"pack": bad})


def vs_lines(batch, heads, q_len, kv_len, n_vert, n_slash, head_space, seed=1, reach=None):
    """Random vertical-slash lines: n_vert distinct columns and n_slash distinct offsets (below ``reach``) per
    head, unsorted."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda n, top: torch.stack([torch.randperm(top, generator=gen)[:n] for _ in range(batch * heads)]).view(batch, heads, n)
    return vertical_slash.VSLines(vertical=pick(n_vert, kv_len).to(DEVICE), slash=pick(n_slash, reach or kv_len).to(DEVICE),
                                  q_len=q_len, kv_len=kv_len, head_space=head_space)


@pytest.mark.parametrize("head_space", ["query", "kv"])
@pytest.mark.parametrize("block_m, block_n, n_slash, reach", [(64, 64, 3, 40), (16, 32, 7, None), (128, 64, 2, 40), (32, 16, 4, None)])
def test_column_table_matches_oracle(head_space, block_m, block_n, n_slash, reach):
    """Columns read from the column table's slabs (index.ColumnTable: clean runs unmasked, the rest masked by
    the slots' bits) equal the oracle, and the launch reads the table: with its bits zeroed the output moves,
    with ``col_table: False`` the column lists give the same keys."""
    q_heads, kv_heads = 4, 2
    q, k, v = qkv(2, q_heads, kv_heads, 300, 333, 64, torch.float16, seed=3)
    heads = kv_heads if head_space == "kv" else q_heads
    # Slashes near the diagonal leave long clean runs (whole unmasked tiles); far ones break runs into masked slots.
    lines = vs_lines(2, heads, 300, 333, 120, n_slash, head_space, reach=reach)
    index = vertical_slash.index_from_lines(lines, block_m=block_m, block_n=block_n)
    validate(index, 300, 333)
    table = index.col_table
    assert bool((table.span > table.clean).any())
    assert int(table.clean.max()) >= 64 if reach else bool((table.clean < table.span - 5).any())
    mask_fn = index_mask_fn(index, 300, 333, group=q_heads // kv_heads if head_space == "kv" else 1)
    out, lse = block_sparse_attention(q, k, v, index)
    assert_close(out, lse, q, k, v, mask_fn)
    listed = block_sparse_attention(q, k, v, index, config={"col_table": False, "TILE_N": min(block_n, 64), "num_warps": 4, "num_stages": 1})
    assert_close(*listed, q, k, v, mask_fn)
    blank = replace(index, col_table=table.map(lambda name, t: torch.zeros_like(t) if name == "bits" else t))
    assert not torch.allclose(block_sparse_attention(q, k, v, blank)[0], out)


@pytest.mark.parametrize("group, heads", [(1, None), (4, None), (4, [5, 0, 7]), (1, [1])])
def test_column_slabs_copy_each_index_heads_rows(group, heads):
    """column_slabs: slot s of index row h of sequence b holds k[b, kv head of h, ids[b, h, s]] (strided k, a
    batch-expanded table, a head map); ids out of range are clamped into it, never read past it."""
    from sparsesearch.kernels.column_slabs import column_slabs

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 90, 2, 80, generator=gen).to(DEVICE).transpose(1, 2)  # [B, Hkv, N, D], strided
    v = torch.randn(2, 2, 90, 80, generator=gen).to(DEVICE)
    rows = 2 * group if heads is None else len(heads)
    ids = torch.randint(0, 90, (1, rows, 45), generator=gen, dtype=torch.int32).to(DEVICE)
    ids[0, 0, :2] = torch.tensor([-4, 500])
    head_map = None if heads is None else torch.tensor(heads, dtype=torch.int32, device=DEVICE)
    kc, vc = column_slabs(k, v, ids.expand(2, -1, -1), head_map, group, 2)
    src = torch.arange(rows, device=DEVICE) if heads is None else head_map.long()
    kv = src // group
    safe = ids.long().clamp(0, 89).expand(2, -1, -1)
    b = torch.arange(2, device=DEVICE)[:, None, None]
    assert torch.equal(kc, k[b, kv[None, :, None], safe]) and torch.equal(vc, v[b, kv[None, :, None], safe])


def test_column_table_with_head_map_expanded_batch_and_fallbacks():
    """The table's slabs follow a head map (each index row's own KV head) and a batch-expanded index; a
    varlen launch, whose frame the table does not describe, reads the column lists instead."""
    q, k, v = qkv(2, 8, 2, 200, 200, 64, torch.bfloat16, seed=5)
    lines = vs_lines(1, 8, 200, 200, 60, 2, "query", seed=2)
    index = vertical_slash.index_from_lines(lines, block_m=32, block_n=32)
    served = torch.tensor([6, 1, 3], dtype=torch.int32, device=DEVICE)
    sub = replace(index, **{n: getattr(index, n)[:, served.long()] for n in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")},
                  col_table=index.col_table.map(lambda _, t: t[:, served.long()]))
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], -1.0, device=DEVICE)
    block_sparse_attention(q, k, v, sub.expand_batch(2), heads=served, out=out, lse=lse)
    want = block_sparse_attention(q, k, v, index.expand_batch(2), config={"col_table": False, "TILE_N": 32, "num_warps": 4, "num_stages": 1})
    for h in range(8):
        if h in served.tolist():
            torch.testing.assert_close(out[:, h], want[0][:, h], atol=2e-2, rtol=0)
        else:
            assert bool((out[:, h] == 0).all())
    cu = torch.tensor([0, 200, 400], dtype=torch.int32, device=DEVICE)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
    got, _ = block_sparse_attention(flat(q), flat(k), flat(v), index.expand_batch(2), cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(got, flat(want[0]), atol=2e-2, rtol=0)


@pytest.mark.parametrize("slots", [1, 31, 32, 77])
def test_pack_bits_round_trips(slots):
    """pack_bits/unpack_bits: bit s % 32 of int32 word s // 32 (bit 31 is the sign bit)."""
    from sparsesearch.index import pack_bits, unpack_bits

    mask = torch.rand(3, 4, slots, generator=torch.Generator().manual_seed(slots)) < 0.5
    words = pack_bits(mask.to(DEVICE))
    assert words.dtype == torch.int32 and words.shape == (3, 4, -(-slots // 32))
    assert torch.equal(unpack_bits(words, slots).cpu(), mask)
    assert pack_bits(torch.ones(64, dtype=torch.bool)).tolist() == [-1, -1]
    assert pack_bits(torch.arange(32) == 31).tolist() == [-(2**31)]


def test_column_table_survives_index_ops_and_validate_catches_a_wrong_one():
    """to/expand_batch/select_q_blocks/stack carry the table (stack pads slots with unused ones) and keep it
    valid; a table naming other keys than the lists, or a clean run over a non-causal slot, is refused."""
    from sparsesearch.index import select_q_blocks

    a = vertical_slash.index_from_lines(vs_lines(1, 2, 100, 100, 20, 2, "kv", seed=3), block_m=16, block_n=16)
    b = vertical_slash.index_from_lines(vs_lines(1, 2, 100, 100, 37, 2, "kv", seed=4), block_m=16, block_n=16)
    both = stack([a, b], dim=1)
    assert both.col_table.ids.shape == (1, 4, 37) and both.col_table.bits.shape == (1, 4, 7, 2)
    validate(both, 100)
    validate(a.expand_batch(3).to("cpu"), 100)
    picked = select_q_blocks(a, torch.tensor([6, 2], device=DEVICE))
    assert torch.equal(picked.col_table.span, a.col_table.span[:, :, [6, 2]])
    assert stack([a, replace(b, col_table=None)], dim=1).col_table is None
    table = a.col_table
    flipped = replace(a, col_table=table.map(lambda n, t: t ^ 1 if n == "bits" else t))
    with pytest.raises(ValueError, match="other keys"):
        validate(flipped, 100)
    assert bool((table.clean > 0).any())
    late = replace(a, col_table=table.map(lambda n, t: torch.where(t > 0, table.ids.shape[-1], t) if n == "clean" else t))
    with pytest.raises(ValueError, match="clean prefix"):
        validate(late, 100)
    with pytest.raises(ValueError, match="col_table bits"):
        replace(a, col_table=table.map(lambda n, t: t[..., :0] if n == "bits" else t))


@pytest.mark.parametrize("head_space", ["query", "kv"])
def test_head_map_launches_fill_one_output(head_space):
    """Two launches over disjoint head groups (one index each) fill a shared output like one launch would."""
    q, k, v = qkv(2, 6, 2, 80, 80, 64, torch.float16, seed=4)
    space = 2 if head_space == "kv" else 6
    groups = [[0], [1]] if head_space == "kv" else [[0, 2, 5], [1, 3, 4]]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 6, 80), float("nan"), device=DEVICE)
    parts = []
    for n, ids in enumerate(groups):
        index = random_index(2, len(ids), 80, 80, 16, 32, columns=3, head_space=head_space, seed=n, device=DEVICE)
        heads = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        block_sparse_attention(q, k, v, index, heads=heads, out=out, lse=lse)
        parts.append((ids, index))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "every head must be written exactly once"
    group = 6 // space
    for ids, index in parts:
        qh = torch.cat([torch.arange(i * group, (i + 1) * group) for i in ids]) if head_space == "kv" else torch.tensor(ids)
        kh = torch.tensor(ids) if head_space == "kv" else torch.tensor(ids) // 3
        sub_k, sub_v = k[:, kh], v[:, kh]
        mask = index_mask_fn(index, 80, 80, group if head_space == "kv" else 1)
        if head_space == "query":  # each query head has its own KV head: compare head by head
            for slot, h in enumerate(ids):
                one = lambda rows, slot=slot: mask(rows)[:, slot : slot + 1]
                assert_close(out[:, h : h + 1], lse[:, h : h + 1], q[:, h : h + 1], k[:, h // 3 : h // 3 + 1], v[:, h // 3 : h // 3 + 1], one)
        else:
            assert_close(out[:, qh], lse[:, qh], q[:, qh], sub_k, sub_v, mask)


def test_head_map_rejects_bad_ids():
    q, k, v = qkv(1, 4, 2, 64, 64, 64, torch.float16)
    index = random_index(1, 2, 64, 64, 32, 32, device=DEVICE)
    with pytest.raises(ValueError, match="distinct ids"):
        block_sparse_attention(q, k, v, index, heads=torch.tensor([0, 0], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="distinct ids"):
        block_sparse_attention(q, k, v, index, heads=torch.tensor([3, 4], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "b{}_hq{}_hk{}_q{}_k{}_d{}_m{}_n{}".format(*c[:8]))
@pytest.mark.parametrize("head_space", ["query", "kv"])
@pytest.mark.parametrize("window", [-1, 37])
def test_torch_backend_matches_oracle(case, head_space, window):
    """The CPU runtime backend obeys the same index semantics (window/sink, columns, GQA, q_len < kv_len)."""
    batch, q_heads, kv_heads, q_len, kv_len, dim, bm, bn, dtype = case
    q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, dim, dtype, seed=9)
    heads = kv_heads if head_space == "kv" else q_heads
    index = random_index(batch, heads, q_len, kv_len, bm, bn, columns=4, window=window, sink=3, head_space=head_space, device=DEVICE)
    out, lse = block_sparse_attention_torch(q, k, v, index)
    group = q_heads // kv_heads if head_space == "kv" else 1
    assert_close(out, lse, q, k, v, index_mask_fn(index, q_len, kv_len, group))
    ref_o, ref_l = block_sparse_attention(q, k, v, index)
    assert relative_error(out, ref_o) < 1e-2


def test_torch_backend_head_map():
    q, k, v = qkv(1, 6, 2, 70, 70, 64, torch.float32, seed=1)
    index = random_index(1, 1, 70, 70, 16, 16, head_space="kv", device=DEVICE)
    out = torch.zeros_like(q)
    lse = torch.zeros(1, 6, 70, device=DEVICE)
    block_sparse_attention_torch(q, k, v, index, heads=torch.tensor([1], dtype=torch.int32), out=out, lse=lse)
    assert bool((out[:, :3] == 0).all()), "heads outside the map stay untouched"
    assert_close(out[:, 3:], lse[:, 3:], q[:, 3:], k[:, 1:], v[:, 1:], index_mask_fn(index, 70, 70, 3))


def test_validate_window_rule_matches_pool_mask():
    """validate accepts exactly the full blocks pool_mask calls full under an A-shape mask (sink + window)."""
    from sparsesearch.index import from_block_masks
    from sparsesearch.reference import pool_mask, predicate_mask_fn

    for sink, window, n, bm, bn in ((3, 47, 200, 16, 16), (100, 1024, 2000, 32, 64), (0, 64, 300, 32, 32)):
        mask = predicate_mask_fn(lambda b, h, pos, j: (j < sink) | (pos - j < window), 1, 1, n, n)(torch.arange(n))
        full, partial = pool_mask(mask, bm, bn)
        validate(from_block_masks(full, partial, bm, bn, window=window, sink=sink), n)
        # One block that some row masks, listed as full, is refused.
        if partial.any():
            bad_full = full.clone()
            qb, kb = partial[0, 0].nonzero()[0].tolist()
            bad_full[0, 0, qb, kb] = True
            bad_partial = partial.clone()
            bad_partial[0, 0, qb, kb] = False
            if (kb + 1) * bn - 1 <= qb * bm and (kb + 1) * bn <= n:  # causal-safe: only the window rejects it
                with pytest.raises(ValueError, match="window/sink"):
                    validate(from_block_masks(bad_full, bad_partial, bm, bn, window=window, sink=sink), n)


def test_varlen_needs_both_cu_seqlens_in_every_launcher():
    q = torch.randn(10, 2, 64, device=DEVICE)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs both cu_seqlens_q and cu_seqlens_k"):
        tail_attention(q, q, q, 4, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="needs both cu_seqlens_q and cu_seqlens_k"):
        block_sparse_attention(q, q, q, random_index(1, 2, 10, 10, 16, 16, device=DEVICE), cu_seqlens_k=cu)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.mem_get_info()[0] < 40 << 30,
                    reason="1M tokens x 32 heads: a CUDA GPU with 40 GiB free")
def test_long_context_offsets_past_int32():
    """q [1, 32, 2^20, 128] contiguous: a head's offset (h x 2^27 elements) passes int32 from head 16 on. The
    last heads' rows from the full launch equal a launch on just their slice (offsets small there); an
    int32 product wrapped to a negative address faulted at 1M (permuted.py, H200)."""
    from sparsesearch.patterns import ashape, triangle

    n, d = 1 << 20, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 8, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    q_tail, k_tail, v_tail = (t[:, -t.shape[1] // 8:].contiguous() for t in (q, k, v))  # heads 28-31, KV head 7
    a = ashape.build_index(ashape.AShapeParams(sink=64, local=256), n, heads=8, block_m=128, block_n=64, head_space="kv", device="cuda")
    a_tail = ashape.build_index(ashape.AShapeParams(sink=64, local=256), n, heads=1, block_m=128, block_n=64, head_space="kv", device="cuda")
    out, lse = block_sparse_attention(q, k, v, a)
    want, want_lse = block_sparse_attention(q_tail, k_tail, v_tail, a_tail)
    assert torch.equal(out[:, 28:], want) and torch.equal(lse[:, 28:], want_lse)
    params = triangle.TriangleParams(sink=64, window=256, last=128)
    t = triangle.build_index(params, n, heads=8, block_m=64, block_n=64, head_space="kv", device="cuda")
    t_tail = triangle.build_index(params, n, heads=1, block_m=64, block_n=64, head_space="kv", device="cuda")
    out, lse = triangle_attention(q, k, v, t, params.last, out=out, lse=lse)
    want, want_lse = triangle_attention(q_tail, k_tail, v_tail, t_tail, params.last)
    stream = slice(-256, -128)  # streaming rows: the same programs, bit for bit
    assert torch.equal(out[:, 28:, stream], want[:, :, stream]) and torch.equal(lse[:, 28:, stream], want_lse[:, :, stream])
    # The dense last rows: split over keys by the launch's size (32 heads vs 4), so merged in another order.
    torch.testing.assert_close(out[:, 28:, -128:], want[:, :, -128:], atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, 28:, -128:], want_lse[:, :, -128:], atol=1e-4, rtol=0)


def test_head_map_is_read_once_until_it_changes():
    """A head map is read on the host (a wait for the device) only the first time it is seen: the runtime
    passes the same tensors every layer. Writing to it, or serving another head count, checks it again."""
    from sparsesearch.kernels import block_sparse as bs

    q, k, v = qkv(1, 4, 2, 64, 64, 64, torch.float16)
    index = random_index(1, 1, 64, 64, 32, 32, device=DEVICE)
    heads = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    reads = []
    real = torch.Tensor.tolist
    heads.tolist = lambda: reads.append(1) or real(heads)
    bs._VALID_HEADS.clear()
    first = block_sparse_attention(q, k, v, index, heads=heads)
    second = block_sparse_attention(q, k, v, index, heads=heads)
    assert len(reads) == 1 and torch.equal(first[0][:, 1], second[0][:, 1])  # only the served head is written
    heads.fill_(3)  # in place: the version counter moves, so the map is read again and refused (2 KV heads)
    with pytest.raises(ValueError, match="distinct ids"):
        block_sparse_attention(q, k, v, replace(index, head_space="kv"), heads=heads)
    assert len(reads) == 2
    # Valid for 4 query heads, not for 2 KV heads: the head count is part of what was checked.
    block_sparse_attention(q, k, v, index, heads=heads)
    with pytest.raises(ValueError, match="distinct ids"):
        block_sparse_attention(q, k, v, replace(index, head_space="kv"), heads=heads)
