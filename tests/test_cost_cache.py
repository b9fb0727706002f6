"""The measured-cost cache trusts only times measured by this torch, Triton and kernel version."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sparsesearch.kernels.version import cache_env, kernel_version
from sparsesearch.search.cost import TIMING, MeasuredCost


def test_cache_round_trips_under_its_stamp(tmp_path):
    path = tmp_path / "costs.json"
    first = MeasuredCost(cache_path=path)
    first._cache["H200|(1, 4, 512, 64)|ashape"] = 0.25
    first._write()
    stored = json.loads(path.read_text())
    assert stored["env"] == {**cache_env(), "timing": TIMING} and set(stored["env"]) == {"torch", "triton", "kernels", "timing"}
    assert MeasuredCost(cache_path=path)._cache == {"H200|(1, 4, 512, 64)|ashape": 0.25}


@pytest.mark.parametrize("content", [
    {"env": {**cache_env(), "triton": "0.0.1"}, "costs": {"k": 1.0}},   # another Triton
    {"env": {**cache_env(), "kernels": "0" * 16}, "costs": {"k": 1.0}},  # older kernels
    {"H100|(1, 4, 512, 64)|ashape": 1.0},                                # the unstamped layout before
    {"env": {**cache_env("NVIDIA H100 80GB HBM3"), "timing": TIMING}, "costs": {"k": 1.0}},  # another GPU
    {"env": cache_env("NVIDIA H200"), "costs": {"k": 1.0}},  # timed with CUDA events, host gaps included (before Run 37)
])
def test_foreign_or_stale_cache_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match="ignoring cost cache"):
        costs = MeasuredCost(cache_path=path, device_name="NVIDIA H200")
    assert costs._cache == {}
    costs._write()  # the next write replaces it with this install's stamp
    assert json.loads(path.read_text())["env"] == {**cache_env("NVIDIA H200"), "timing": TIMING}


def test_unreadable_cache_is_ignored_and_a_missing_one_is_silent(tmp_path, recwarn):
    assert MeasuredCost(cache_path=tmp_path / "none.json")._cache == {}
    assert not recwarn.list
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert MeasuredCost(cache_path=tmp_path / "bad.json")._cache == {}


def test_kernel_version_follows_the_kernel_sources(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = kernel_version(tmp_path)
    assert len(before) == 16 and kernel_version(tmp_path) == before
    (tmp_path / "a.py").write_text("x = 2\n")
    assert kernel_version(tmp_path) != before
    assert kernel_version() == cache_env()["kernels"]


def _launch(full, partial, cols, programs):
    return [1.0, float(full), float(partial), float(cols), float(programs)]


def _line(f):
    """A kernel's time as the table models it: launch floor + per block + per column block + per program."""
    return 0.02 + 0.004 * f[1] + 0.006 * f[2] + 0.003 * f[3] + 0.0005 * f[4]


def test_cost_table_interpolates_inside_what_it_measured_and_nowhere_else():
    from sparsesearch.search.cost import NEIGHBOURS, CostTable

    table = CostTable()
    grid = [_launch(full, partial, cols, programs) for full, partial, cols, programs in
            [(100, 20, 0, 64), (400, 40, 8, 64), (900, 60, 16, 128), (1600, 80, 4, 256), (200, 90, 12, 256),
             (1200, 30, 2, 128), (700, 10, 10, 192), (50, 70, 6, 96), (1500, 50, 14, 64), (300, 55, 3, 224),
             (1100, 85, 15, 80), (600, 5, 9, 160), (1300, 65, 11, 240)]]
    inside = _launch(800, 45, 7, 150)
    for i, f in enumerate(grid):
        if i + 1 < NEIGHBOURS:
            assert table.predict("fam", inside) is None  # too few points for a local fit
        table.add("fam", f, _line(f) * (1.01 if i % 2 else 0.99))  # 1% timing noise
    got = table.predict("fam", inside)
    assert got is not None and abs(got - _line(inside)) < 0.05 * _line(inside)
    assert table.predict("fam", _launch(3000, 45, 7, 150)) is None  # more blocks than any measured launch
    assert table.predict("fam", _launch(800, 45, 7, 512)) is None  # a longer sequence than measured
    assert table.predict("other", inside) is None  # another family learns nothing from this one


def test_cost_table_refuses_a_fit_that_does_not_explain_its_points():
    from sparsesearch.search.cost import CostTable

    table = CostTable()
    for i in range(12):
        f = _launch(100 * (i + 1), 10 * (i % 5), i % 3, 64 * (1 + i % 4))
        table.add("fam", f, _line(f) * (3.0 if i == 5 else 1.0))  # one launch 3x off the line, among the nearest
    assert table.predict("fam", _launch(550, 20, 1, 128)) is None


def test_cost_table_prices_a_launch_it_measured_at_its_own_time():
    """A warm cache: the same launch again costs no timing, with one point or beside points no line fits."""
    from sparsesearch.search.cost import CostTable

    table = CostTable()
    f = _launch(550, 20, 1, 128)
    table.add("fam", f, 0.40)
    assert table.predict("fam", f) == 0.40
    table.add("fam", f, 0.46)
    table.add("fam", f, 0.41)
    assert table.predict("fam", f) == 0.41  # the median of its measurements
    for i in range(12):
        g = _launch(100 * (i + 1), 10 * (i % 5), i % 3, 64 * (1 + i % 4))
        table.add("fam", g, _line(g) * (3.0 if i == 5 else 1.0))
    assert table.predict("fam", f) == 0.41 and table.predict("fam", _launch(551, 20, 1, 128)) is None
    assert table.predict("other", f) is None


def test_cost_table_points_persist_under_the_stamp_and_a_copy_loads(tmp_path):
    costs = MeasuredCost(cache_path=tmp_path / "costs.json")
    costs.table.add("H200|block_topk|32x128|torch.bfloat16|128x128", _launch(1, 2, 0, 4), 0.5)
    costs._write()
    assert MeasuredCost(cache_path=tmp_path / "costs.json").table.points == costs.table.points
    costs.save_to(tmp_path / "artifact" / "costs.json")
    assert MeasuredCost(cache_path=tmp_path / "artifact" / "costs.json").table.points == costs.table.points
    stale = json.loads((tmp_path / "costs.json").read_text())
    stale["env"]["kernels"] = "0" * 16
    (tmp_path / "costs.json").write_text(json.dumps(stale))
    with pytest.warns(UserWarning, match="ignoring cost cache"):
        assert MeasuredCost(cache_path=tmp_path / "costs.json").table.points == {}


def test_exit_flush_does_not_keep_instances_alive(tmp_path):
    """The at-exit flush holds a weak reference: a dropped instance is collected, a live one is flushed."""
    import gc
    import weakref

    from sparsesearch.search.cost import _flush_if_alive

    dropped = MeasuredCost(cache_path=tmp_path / "a.json")
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None
    _flush_if_alive(ref)  # the exit hook of a collected instance does nothing
    live = MeasuredCost(cache_path=tmp_path / "b.json")
    live._cache["k"], live._dirty = 1.0, True
    _flush_if_alive(weakref.ref(live))
    assert json.loads((tmp_path / "b.json").read_text())["costs"] == {"k": 1.0}


def _layer(dim=64, n=96, heads=4, kv_heads=1, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, dim, generator=gen).to(device)
    k, v = (torch.randn(1, kv_heads, n, dim, generator=gen).to(device) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("head_space, heads", [("query", 4), ("kv", 1)])
def test_measured_dense_price_is_the_runtimes_sdpa_split_per_head(tmp_path, monkeypatch, head_space, heads):
    # calibrate prices a dense head as the runtime runs it (torch SDPA over the layer), once per shape
    from sparsesearch.calibrate import dense_cost
    from sparsesearch.search.space import load_space

    outs = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(MeasuredCost, "_time", lambda self, run: (outs.append(run()), 2.0)[1])
    costs = MeasuredCost(cache_path=tmp_path / "c.json")
    q, k, v = _layer()
    for _ in range(2):
        price = dense_cost(q, k, v, load_space(), costs, head_space, None)
        assert price.dtype == torch.float64 and price.tolist() == [2.0 / heads] * heads
    assert costs.timed == 1 and len(outs) == 1  # the second layer of this shape reads the cache
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(outs[0], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times SDPA on a GPU")
def test_measured_dense_price_on_a_gpu(tmp_path):
    costs = MeasuredCost(cache_path=tmp_path / "c.json")
    q, k, v = (t.half() for t in _layer(n=2048, device="cuda"))
    per_head = costs.dense_ms(q, k, v, "query", 0.125)
    assert per_head.shape == (4,) and 0 < float(per_head[0]) < 50 and costs.timed == 1
    assert costs.dense_ms(q, k, v, "kv", 0.125).tolist() == [float(per_head.sum())] and costs.timed == 1


# The layer prices calibrate saves beside each head's (calibrate.mix_cost / split_cost), from stood-in timings:
# - mix: one A-shape launch over every head (2.0), SDPA over the layer (4.0), the runtime's call with half the heads
#   sparse (5.0): per-head prices say (2 x 2.0 + 2 x 4.0) / 4 = 3.0, so the layer pays 2.0 more when it mixes;
# - split: one A-shape launch over the 4 heads (2.0), then one launch per head (5.0 in all): 3 launches more cost
#   3.0, so each launch past a layer's first costs 1.0.
@pytest.mark.parametrize("price, times, want", [("mix_cost", [2.0, 4.0, 5.0], 2.0), ("split_cost", [2.0, 5.0], 1.0)])
def test_a_layer_price_is_the_runtimes_call_over_its_per_head_prices(tmp_path, monkeypatch, price, times, want):
    import sparsesearch.calibrate as cal
    from sparsesearch.search.cost import AnalyticCost

    of, times = getattr(cal, price), iter(times)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(MeasuredCost, "_time", lambda self, run: (run(), next(times))[1])  # runs each call on the CPU
    costs = MeasuredCost(cache_path=tmp_path / "c.json")
    q, k, v = _layer()
    assert of(q, k, v, costs, "query", None) == pytest.approx(want)
    timed = costs.timed
    assert of(q, k, v, costs, "query", None) == pytest.approx(want) and costs.timed == timed  # cached per shape
    assert of(q, k, v, costs, "kv", None) == 0.0  # one KV head: the layer cannot mix, and runs one launch
    assert of(q, k, v, AnalyticCost(), "query", None) == 0.0  # the analytic model has neither: a CPU's allocations are what they were


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times the runtime's calls on a GPU")
@pytest.mark.parametrize("price", ["mix_ms", "split_ms"])
def test_measured_layer_prices_on_a_gpu(tmp_path, price):
    costs = MeasuredCost(cache_path=tmp_path / "c.json")
    q, k, v = (t.half() for t in _layer(n=4096, device="cuda"))
    got = getattr(costs, price)(q, k, v, "query", 0.125)
    assert 0 <= got < 50 and getattr(costs, price)(q, k, v, "query", 0.125) == got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on a GPU")
def test_a_launch_is_priced_by_its_kernels_not_the_hosts_gaps(tmp_path):
    """Two tiny kernels with 5 ms of host work between them: CUDA events around the call measure the host's
    5 ms, the profiler's device time only the kernels (what `pareto` costs points by). Event timing made every
    short sparse launch cost as much as SDPA (SmolLM2 at 8K, RESULTS Run 37)."""
    import time

    from sparsesearch.search.cost import _event_ms

    x = torch.zeros(1024, device="cuda")

    def call() -> None:
        x.add_(1)
        time.sleep(0.005)
        x.add_(1)

    assert _event_ms(call, 3) >= 4.5
    assert 0 < MeasuredCost(cache_path=tmp_path / "c.json")._time(call) < 1.0


def test_a_launch_is_timed_once_learned_by_the_table_and_a_dynamic_build_timed_like_it(tmp_path, monkeypatch):
    """cost_ms on the CPU with the timer stubbed: a static launch is timed once (then the exact key answers), its
    time becomes a table point; a dynamic pattern adds its index build, timed by the same clock when the search
    hands it over (``build``), else the search's wall time."""
    from sparsesearch.patterns import ashape, block_topk
    from sparsesearch.search.cost import DYNAMIC

    timed = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "GPU X")
    monkeypatch.setattr(MeasuredCost, "_time", lambda self, run: (timed.append(run), 0.5 if run is not build else 0.25)[1])
    costs = MeasuredCost(cache_path=tmp_path / "c.json", interpolate=False)
    q = torch.zeros(1, 2, 512, 16)
    static = ashape.build_index(ashape.AShapeParams(sink=64, local=128), 512, 512, heads=2, block_m=64, block_n=64)
    run = lambda: None
    build = lambda: None
    density = torch.tensor([0.3, 0.3])
    for _ in range(2):
        assert costs.cost_ms("ashape", density, 512, q, static, run, 9.0).tolist() == [0.25, 0.25]  # 0.5 over 2 heads
    assert len(timed) == 1 and costs.timed == 1
    (points,) = costs.table.points.values()
    assert points[-1][-1] == 0.5  # the table learned the time itself
    assert "block_topk" in DYNAMIC
    dynamic = block_topk.build_index(block_topk.BlockTopKParams(k_blocks=2), q, torch.zeros(1, 2, 512, 16), block_m=64, block_n=64)
    assert costs.cost_ms("block_topk", density, 512, q, dynamic, run, 9.0, build=build).tolist() == [0.375, 0.375]
    assert costs.cost_ms("block_topk", density, 512, q, dynamic, run, 0.001).tolist() == pytest.approx([0.75, 0.75])  # 0.5 + 1 ms wall
