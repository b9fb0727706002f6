"""Dynamic index builds without device syncs (static_widths) and their CUDA-graph replays (sparsesearch/graphed.py).

On CPU: a static-width build lists the same blocks and columns as the synced build, only in wider lists. On a
GPU: the build runs under the sync debugger without a sync, a replay equals an eager build on every call
(new q/k, new index: the graph reads its inputs, it does not return a stale result), and the runtime's
output is the same with graphs on and off.
"""

from __future__ import annotations

import pytest
import torch

from sparsesearch.execute import HeadGroup, StaticIndexCache, build_group_index
from sparsesearch.patterns import block_topk, vertical_slash

LISTS = (("full_count", "full_idx"), ("partial_count", "partial_idx"), ("col_count", "col_idx"))
VS = vertical_slash.VerticalSlashParams(vertical_size=24, slash_size=16, last_q=16, force_vertical=2, force_slash=2)
TOPK = block_topk.BlockTopKParams(k_blocks=3, sink_blocks=1)
GROUPS = [("vertical_slash", VS), ("block_topk", TOPK)]


def _qk(n=200, q_heads=4, kv_heads=2, dim=32, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, q_heads, n, dim, generator=gen).to(device, dtype)
    k = torch.randn(2, kv_heads, n, dim, generator=gen).to(device, dtype)
    return q, k


def assert_same_lists(got, want) -> None:
    """The same counts, and the same ids wherever a count reaches (got's lists may be wider)."""
    for count, ids in LISTS:
        a, b = getattr(got, count), getattr(want, count)
        if b is None:
            assert a is None
            continue
        assert torch.equal(a, b), count
        width = getattr(want, ids).shape[-1]
        assert getattr(got, ids).shape[-1] >= width
        live = torch.arange(width, device=b.device) < b[..., None]
        assert torch.equal(torch.where(live, getattr(got, ids)[..., :width], 0), torch.where(live, getattr(want, ids), 0)), ids


@pytest.mark.parametrize("name, params", GROUPS)
@pytest.mark.parametrize("space", ["kv", "query"])
def test_static_widths_list_what_the_synced_build_lists(name, params, space):
    q, k = _qk()
    module = vertical_slash if name == "vertical_slash" else block_topk
    kw = dict(head_space=space, block_m=16, block_n=32)
    qs, ks = (q, k) if space == "kv" else (q, k.repeat_interleave(2, dim=1))
    want = module.build_index(params, qs, ks, **kw)
    got = module.build_index(params, qs, ks, static_widths=True, **kw)
    assert_same_lists(got, want)
    if name == "vertical_slash":  # as wide as the lines can reach, and the verticals
        widths = vertical_slash.list_widths(params.slash_size, -(-200 // 32), 16, 32)
        assert (got.full_idx.shape[-1], got.partial_idx.shape[-1]) == widths
        assert got.col_idx.shape[-1] == 24
    else:
        assert got.full_idx.shape[-1] == got.partial_idx.shape[-1] == -(-200 // 32)  # as wide as the key blocks


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@GPU
@pytest.mark.parametrize("name, params", GROUPS)
def test_static_width_build_has_no_device_sync(name, params):
    q, k = _qk(device="cuda", dtype=torch.bfloat16)
    module = vertical_slash if name == "vertical_slash" else block_topk
    module.build_index(params, q, k, head_space="kv", block_m=16, block_n=32, static_widths=True)  # lazy init outside
    torch.cuda.set_sync_debug_mode("error")
    try:
        module.build_index(params, q, k, head_space="kv", block_m=16, block_n=32, static_widths=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@GPU
@pytest.mark.parametrize("name, params", GROUPS)
@pytest.mark.parametrize("space, heads", [("kv", (1,)), ("query", (0, 3))])
def test_graph_replays_equal_eager_builds_on_new_inputs(name, params, space, heads):
    from sparsesearch.graphed import GraphedIndexCache

    g = HeadGroup(name, params, heads, 16, 32)
    graphs = GraphedIndexCache()
    for seed in range(3):  # the first call captures, the others replay on new q/k
        q, k = _qk(seed=seed, device="cuda", dtype=torch.bfloat16)
        got = graphs.index(g, q, k, space)
        assert_same_lists(got, build_group_index(g, q, k, space))
    assert len(graphs._entries) == 1


@GPU
@pytest.mark.parametrize("name, params", GROUPS)
def test_runtime_cache_takes_the_fused_build_before_a_graph(name, params):
    """Where the fused Triton build takes the inputs it runs eagerly (cheaper than a replay's copies); a
    refused input (head_dim 8 for vertical-slash, 2049 key blocks for block top-k) still goes through a graph."""
    g = HeadGroup(name, params, (0,), 16, 32)
    cache = StaticIndexCache()
    q, k = _qk(device="cuda", dtype=torch.bfloat16)
    assert cache.index(g, q, k, "kv").meta.get("fused") and not cache._graphs._entries
    if name == "vertical_slash":
        q, k = q[..., :8].contiguous(), k[..., :8].contiguous()
    else:
        g = HeadGroup(name, params, (0,), 16, 16)
        q, k = _qk(n=2049 * 16, q_heads=2, kv_heads=1, dim=16, device="cuda", dtype=torch.bfloat16)
    got = cache.index(g, q, k, "kv")
    assert not got.meta.get("fused")
    assert len(cache._graphs._entries) == (1 if q.shape[2] <= 16384 else 0)  # graphs stop at 16K keys


@GPU
def test_runtime_output_is_the_same_with_graphs_on_and_off():
    from sparsesearch.runtime.plan import LayerPlan, Plan
    from sparsesearch.runtime.run import Runner

    groups = (HeadGroup("vertical_slash", VS, (0,), 64, 64), HeadGroup("block_topk", TOPK, (1,), 64, 64))
    plan = Plan(head_space="kv", layers=(LayerPlan(0, "sparse", groups),))
    graphed, eager = Runner(plan), Runner(plan)
    eager._static = StaticIndexCache(graphs=False)
    for seed in range(2):
        q, k = _qk(n=1000, q_heads=4, kv_heads=2, dim=64, seed=seed, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        a = graphed.attend(plan.layers[0], q, k, v)
        b = eager.attend(plan.layers[0], q, k, v)
        assert torch.equal(a, b)
