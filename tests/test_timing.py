"""benchmarks/timing.py: the interleaved loop alternates its callables and reports each one's median."""

import statistics

import pytest
import torch

from benchmarks.timing import Clock, call_ms, cpu_clock, interleaved_ms


class FakeDevice:
    """A clock whose time moves only when a fake kernel runs: call i of `name` takes durations[name][i] ms.
    Records the call order and how many syncs the loop issued."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now, self.calls, self.syncs, self.durations = 0.0, [], 0, durations

    def fn(self, name: str):
        def call():
            self.now += self.durations[name][sum(c == name for c in self.calls)]
            self.calls.append(name)
        return call

    def clock(self) -> Clock:
        def sync():
            self.syncs += 1
        return Clock(mark=lambda: self.now, elapsed=lambda a, b: b - a, sync=sync)


def test_alternates_and_takes_medians_of_the_timed_rounds():
    # Warm-up calls are slow (compilation) and the baseline drifts upward; the medians must come from the
    # 5 timed rounds alone, per callable.
    kernel = [100.0, 90.0, 1.0, 3.0, 2.0, 50.0, 2.5]
    sdpa = [200.0, 180.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    dev = FakeDevice({"kernel": kernel, "sdpa": sdpa})
    timed = interleaved_ms([dev.fn("kernel"), dev.fn("sdpa")], clock=dev.clock(), warmup=2, reps=5)
    assert dev.calls == ["kernel", "sdpa"] * 7
    assert timed.reps == 5
    assert timed.ms == (statistics.median(kernel[2:]), statistics.median(sdpa[2:]))
    assert timed.ms == (2.5, 12.0)
    assert dev.syncs == 7  # one per round, never between the calls of a round


def test_flush_runs_before_every_call_outside_its_marks():
    dev = FakeDevice({"a": [1.0] * 4, "b": [2.0] * 4})
    flushed = []

    def flush():
        flushed.append(len(dev.calls))
        dev.now += 1000.0  # a flush that takes time must not show up in any call's time

    timed = interleaved_ms([dev.fn("a"), dev.fn("b")], clock=dev.clock(), flush=flush, warmup=1, reps=3)
    assert flushed == list(range(8))
    assert timed.ms == (1.0, 2.0)


def test_counts_from_the_time_budget():
    # Three probe rounds of 1 + 4 ms: 5 ms a round -> ceil(20 / 5) = 4 warm-up and ceil(50 / 5) = 10 timed.
    dev = FakeDevice({"a": [1.0] * 100, "b": [4.0] * 100})
    timed = interleaved_ms([dev.fn("a"), dev.fn("b")], clock=dev.clock(), warmup_ms=20, rep_ms=50)
    assert timed.reps == 10
    assert dev.calls == ["a", "b"] * (3 + 4 + 10)
    assert timed.ms == (1.0, 4.0)


def test_at_least_five_and_at_most_max_reps():
    slow = FakeDevice({"a": [1000.0] * 100})
    assert interleaved_ms([slow.fn("a")], clock=slow.clock(), warmup_ms=0, rep_ms=1).reps == 5
    fast = FakeDevice({"a": [0.001] * 100})
    assert interleaved_ms([fast.fn("a")], clock=fast.clock(), warmup_ms=0, rep_ms=1e6, max_reps=20).reps == 20


def test_cpu_callables_on_the_wall_clock():
    order = []
    timed = interleaved_ms([lambda: order.append(0), lambda: order.append(1) or sum(range(20000))],
                           clock=cpu_clock(), warmup=1, reps=9)
    assert order == [0, 1] * 10
    assert 0 < timed.ms[0] < timed.ms[1]  # summing 20000 ints costs more than appending one


@pytest.mark.parametrize("kwargs", [{"reps": 0, "warmup": 0}, {"reps": 3, "warmup": -1}])
def test_bad_counts(kwargs):
    with pytest.raises(ValueError, match="reps must be >= 1"):
        interleaved_ms([lambda: None], **kwargs)
    with pytest.raises(ValueError, match="at least one callable"):
        interleaved_ms([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphed_replays_the_captured_work():
    from benchmarks.timing import graphed

    x = torch.zeros(4, device="cuda")
    replay = graphed(lambda: x.add_(1.0), warmup=2)  # 2 eager calls, then the capture (which does not run it)
    assert x.tolist() == [2.0] * 4
    replay()
    replay()
    assert x.tolist() == [4.0] * 4


def test_call_ms_times_a_long_call_once_after_the_warm_one():
    # A 1M prefill: the warm call (compiles, 700 s) is over long_ms, so exactly one more call is timed.
    dev = FakeDevice({"prefill": [700_000.0, 560_000.0, 1.0]})
    assert call_ms(dev.fn("prefill"), dev.clock()) == 560_000.0
    assert dev.calls == ["prefill"] * 2


def test_call_ms_takes_the_median_of_short_calls_within_the_budget():
    # A 100 ms warm call and a 500 ms budget: five more calls, their median (the warm one stays out).
    times = [100.0, 95.0, 120.0, 80.0, 400.0, 110.0] + [1.0] * 10
    dev = FakeDevice({"step": times})
    assert call_ms(dev.fn("step"), dev.clock()) == 110.0
    assert len(dev.calls) == 6
    # At least three calls however long the budget says; never more than max_calls.
    dev = FakeDevice({"step": [10.0, 400.0, 300.0, 500.0] + [1.0] * 10})
    assert call_ms(dev.fn("step"), dev.clock(), budget_ms=1.0) == 400.0 and len(dev.calls) == 4
    dev = FakeDevice({"step": [1.0] * 20})
    call_ms(dev.fn("step"), dev.clock(), max_calls=7)
    assert len(dev.calls) == 8


def test_call_ms_hands_short_calls_to_the_given_timer():
    dev = FakeDevice({"step": [5.0, 7.0]})
    assert call_ms(dev.fn("step"), dev.clock(), short=lambda: 4.25) == 4.25
    assert dev.calls == ["step"]  # the warm call only: the short timer makes its own


def test_program_cost_fit_recovers_a_planted_line_in_sdpa_tiles():
    from benchmarks.program_cost import fit_line, sdpa_tile_us, summarize

    assert fit_line([(1.0, 5.0), (3.0, 9.0), (5.0, 13.0)]) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([(2.0, 1.0), (2.0, 3.0)])
    # 8 query blocks: a causal row crosses 4.5 key blocks on average, so 9 ms of SDPA is 2000 us per tile.
    assert sdpa_tile_us(9.0, 512, 64) == pytest.approx(2000.0)
    # Planted: 3 SDPA tiles fixed, 1.1x SDPA per tile; rows below fit_from (the kb=1 row) stay out of the fit.
    base = {"n": 512, "block": 64, "config": None, "sdpa_ms": 9.0}
    rows = [dict(base, case=f"topk_kb{t}", tiles_per_row=t, us=2000.0 * (3 + 1.1 * t)) for t in (8, 16, 32)]
    rows += [dict(base, case="topk_kb1", tiles_per_row=1, us=1.0), dict(base, case="null", tiles_per_row=0, us=4000.0),
             dict(base, case="diag_only", tiles_per_row=1, us=5000.0)]
    (s,) = summarize(rows, fit_from=8)
    assert s["fixed_tiles"] == pytest.approx(3.0) and s["per_tile_vs_sdpa"] == pytest.approx(1.1)
    assert (s["null_tiles"], s["diag_only_tiles"]) == (2.0, 2.5)


def test_program_cost_cases_isolate_the_intercept():
    from benchmarks.program_cost import cases

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 256, 32), torch.randn(1, 2, 256, 32)
    got = cases(q, k, [1, 2], 64)
    assert set(got) == {"topk_kb1", "topk_kb2", "diag_only", "null"}
    assert int(got["diag_only"].full_count.sum()) == 0 and bool((got["diag_only"].partial_count == got["topk_kb1"].partial_count).all())
    assert int(got["null"].full_count.sum()) == 0 and int(got["null"].partial_count.sum()) == 0
    assert int(got["topk_kb2"].full_count.sum()) > 0


def test_gap_drains_and_idles_before_every_call(monkeypatch):
    import benchmarks.timing as timing

    dev = FakeDevice({"a": [1.0] * 4, "b": [2.0] * 4})
    slept = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: slept.append((s, len(dev.calls), dev.syncs)))
    timed = interleaved_ms([dev.fn("a"), dev.fn("b")], clock=dev.clock(), warmup=1, reps=3, gap_ms=50.0)
    assert timed.ms == (1.0, 2.0)
    # Before each of the 8 calls: a sync, then 50 ms idle; plus the one sync that ends each of the 4 rounds.
    assert [s for s, _, _ in slept] == [0.05] * 8
    assert [calls for _, calls, _ in slept] == list(range(8))
    assert [syncs for _, _, syncs in slept] == [1, 2, 4, 5, 7, 8, 10, 11]
    assert dev.syncs == 12


def test_gaps_count_against_the_time_budget(monkeypatch):
    import benchmarks.timing as timing

    monkeypatch.setattr(timing.time, "sleep", lambda s: None)
    # Rounds of 1 + 4 ms calls and two 100 ms gaps: 205 ms a round -> 1 warm-up and the minimum of 5 timed rounds.
    dev = FakeDevice({"a": [1.0] * 100, "b": [4.0] * 100})
    timed = interleaved_ms([dev.fn("a"), dev.fn("b")], clock=dev.clock(), warmup_ms=50, rep_ms=200, gap_ms=100.0)
    assert timed.reps == 5 and len(dev.calls) == 2 * (3 + 1 + 5)
