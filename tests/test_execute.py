"""The executor (sparsesearch/execute.py): head groups -> index -> launch, shared by search, runtime,
export and check. Its numerics are covered where it is used (test_runtime, test_boundary, test_export,
test_calibrate); these tests pin what it adds: one build path per group and the static-index cache."""

from __future__ import annotations

import pytest
import torch

import itertools

import torch.nn.functional as F

from sparsesearch.execute import HeadGroup, StaticIndexCache, build_group_index, dense_heads, query_heads, static_index
from sparsesearch.patterns import ashape, vertical_slash


def _qk(q_heads=4, kv_heads=2, n=96, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, q_heads, n, dim, generator=gen), torch.randn(1, kv_heads, n, dim, generator=gen)


def test_query_heads_of_each_space():
    assert query_heads((1, 3), "query", 2) == [1, 3]
    assert query_heads((1, 3), "kv", 2) == [2, 3, 6, 7]


@pytest.mark.parametrize("space, heads", [("query", (1, 2)), ("kv", (1,))])
def test_dynamic_group_estimates_from_its_own_heads(space, heads):
    q, k = _qk()
    params = vertical_slash.VerticalSlashParams(vertical_size=8, slash_size=8, last_q=16, force_vertical=2, force_slash=2)
    got = build_group_index(HeadGroup("vertical_slash", params, heads, 16, 16), q, k, space)
    q_ids = torch.tensor(query_heads(heads, space, 2))
    kv_ids = torch.tensor(heads) if space == "kv" else q_ids // 2
    want = vertical_slash.build_index(params, q[:, q_ids], k[:, kv_ids], head_space=space, block_m=16, block_n=16)
    for name in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_static_group_is_built_from_the_shape():
    q, k = _qk()
    g = HeadGroup("ashape", ashape.AShapeParams(sink=4, local=32), (0, 1), 16, 32)
    got = build_group_index(g, q, k, "kv")
    want = ashape.build_index(g.params, 96, 96, heads=2, block_m=16, block_n=32, head_space="kv")
    assert torch.equal(got.full_idx, want.full_idx) and torch.equal(got.partial_idx, want.partial_idx)
    with pytest.raises(ValueError, match="estimated from q and k"):
        static_index(HeadGroup("block_topk", None, (0,), 16, 16), 96, 96, "kv", "cpu")


def test_patterns_without_a_region_form_refuse_a_frame():
    q, k = _qk()
    with pytest.raises(ValueError, match="grid has no region form"):
        build_group_index(HeadGroup("grid", None, (0,), 16, 16), q, k, "kv", torch.arange(96))


def test_static_cache_reuses_static_indices_only_and_stays_bounded():
    q, k = _qk()
    cache = StaticIndexCache(limit=2)
    g = HeadGroup("ashape", ashape.AShapeParams(sink=4, local=32), (0, 1), 16, 16)
    assert cache.index(g, q, k, "kv") is cache.index(g, q, k, "kv")
    dyn = HeadGroup("vertical_slash", vertical_slash.VerticalSlashParams(8, 8, 16, 2, 2), (0, 1), 16, 16)
    assert cache.index(dyn, q, k, "kv") is not cache.index(dyn, q, k, "kv")
    first = cache.index(g, q, k, "kv")
    for local in (8, 16):  # two more static groups evict the oldest entry
        cache.index(HeadGroup("ashape", ashape.AShapeParams(sink=4, local=local), (0, 1), 16, 16), q, k, "kv")
    assert cache.index(g, q, k, "kv") is not first


def test_device_ids_are_made_once_per_ids_device_and_dtype():
    """The runtime's per-launch head ids come from one shared tensor per (ids, device, dtype): copying a host
    list to a CUDA device would wait for the stream every launch."""
    from sparsesearch.execute import device_ids

    a = device_ids((3, 1, 2), torch.device("cpu"))
    assert a is device_ids((3, 1, 2), torch.device("cpu")) and a.dtype == torch.int64 and a.tolist() == [3, 1, 2]
    b = device_ids((3, 1, 2), torch.device("cpu"), torch.int32)
    assert b is not a and b.dtype == torch.int32 and b.tolist() == [3, 1, 2]
    assert device_ids((1, 2), torch.device("cpu")) is not a


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 1), (8, 2), (6, 3), (4, 4)])
def test_dense_heads_writes_exactly_its_heads_for_every_subset(q_heads, kv_heads):
    """Every subset of heads (one run, several runs, unequal per KV head, unsorted): SDPA's output on those
    heads, the others untouched, into the runtime's [B, N, H, D]-backed view."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 33, 16, generator=gen) for h in (q_heads, kv_heads, kv_heads))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=q_heads != kv_heads)
    for r in range(1, q_heads + 1):
        for heads in itertools.combinations(range(q_heads), r):
            out = torch.zeros(2, 33, q_heads, 16).transpose(1, 2)
            dense_heads(q, k, v, list(reversed(heads)), 0.3, out)
            torch.testing.assert_close(out[:, list(heads)], ref[:, list(heads)], atol=1e-5, rtol=1e-5)
            rest = [h for h in range(q_heads) if h not in heads]
            assert (out[:, rest] == 0).all()
