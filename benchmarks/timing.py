"""Interleaved timing: a kernel and its baseline alternate in one loop, so a drifting clock, a throttling
GPU or a noisy neighbour moves both medians alike and their ratio holds still.

    medians = interleaved_ms([kernel, sdpa], clock=cuda_clock())   # kernel, sdpa, kernel, sdpa, ...
    efficiency = density * medians.ms[1] / medians.ms[0]

Every call is timed alone (its own start/end mark); on a GPU the marks are CUDA events read after one
synchronize per round, so the loop never waits between calls. ``flush`` (e.g. zeroing a buffer larger
than L2, as ``triton.testing.do_bench`` does) runs before every call, outside its marks, so no call
inherits a warm cache from the call before it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence


@dataclass(frozen=True)
class Clock:
    """Where times come from: ``mark()`` stamps now (in the device's stream order), ``elapsed(a, b)`` is
    the milliseconds between two stamps, ``sync()`` waits until every stamp so far can be read."""

    mark: Callable[[], Any]
    elapsed: Callable[[Any, Any], float]
    sync: Callable[[], None]


def cpu_clock() -> Clock:
    """Host wall clock (perf_counter); calls are synchronous, so sync has nothing to wait for."""
    return Clock(mark=time.perf_counter, elapsed=lambda a, b: (b - a) * 1e3, sync=lambda: None)


def cuda_clock() -> Clock:
    """CUDA events on the current stream; read after ``torch.cuda.synchronize``."""
    import torch

    def mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    return Clock(mark=mark, elapsed=lambda a, b: a.elapsed_time(b), sync=torch.cuda.synchronize)


def call_ms(fn: Callable[[], Any], clock: Clock, long_ms: float = 1000.0, budget_ms: float = 500.0, max_calls: int = 100,
            short: Callable[[], float] | None = None) -> float:
    """ms of one fn call at any length: a first (warm) call is timed; past ``long_ms`` the answer is one
    more timed call, else ``short()`` when given (e.g. triton's do_bench, L2 flushed) or the median of as
    many more calls as fit ``budget_ms`` (3 to ``max_calls``). A 1M-token dense prefill takes minutes, so a
    repeated median would not fit a device command (triton's do_bench alone makes eight calls). Each call
    is synchronized alone: meant for calls of a millisecond and up."""

    def once() -> float:
        clock.sync()
        start = clock.mark()
        fn()
        end = clock.mark()
        clock.sync()
        return clock.elapsed(start, end)

    first = once()
    if first >= long_ms:
        return once()
    if short is not None:
        return short()
    calls = min(max_calls, max(3, round(budget_ms / max(first, 1e-3))))
    return statistics.median(once() for _ in range(calls))


def l2_flush(bytes_: int = 256 << 20) -> Callable[[], None]:
    """A call that overwrites a CUDA buffer larger than L2 (256 MiB, as triton.testing.do_bench)."""
    import torch

    buffer = torch.empty(bytes_, dtype=torch.int8, device="cuda")
    return buffer.zero_


def graphed(fn: Callable[[], Any], warmup: int = 3) -> Callable[[], None]:
    """fn captured once into a CUDA graph (after ``warmup`` eager calls on a side stream, which compile and
    allocate); the returned call replays it: the GPU's time for fn's work without its host launch cost,
    which at short lengths is larger than the work itself (a Python launcher per kernel)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Interleaved(NamedTuple):
    ms: tuple[float, ...]  # median milliseconds per call, in the order of fns
    reps: int  # timed calls of each fn (warm-up rounds excluded)


def _round(fns: Sequence[Callable[[], Any]], clock: Clock, flush: Callable[[], None] | None,
           gap_ms: float = 0.0) -> list[tuple[Any, Any]]:
    """One call of each fn in order, each between its own two marks; returns the unread marks. ``gap_ms`` > 0:
    before each call the device drains (sync) and idles that long."""
    marks = []
    for fn in fns:
        if gap_ms > 0:
            clock.sync()
            time.sleep(gap_ms / 1e3)
        if flush is not None:
            flush()
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    return marks


def _rounds(fns, clock: Clock, flush, rounds: int, gap_ms: float = 0.0) -> list[list[float]]:
    """``rounds`` alternating rounds; per fn its list of call times (ms). One sync per round (and one per call
    with a gap)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        marks = _round(fns, clock, flush, gap_ms)
        clock.sync()
        for i, (start, end) in enumerate(marks):
            times[i].append(clock.elapsed(start, end))
    return times


def interleaved_ms(
    fns: Sequence[Callable[[], Any]],
    *,
    clock: Clock | None = None,
    flush: Callable[[], None] | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    warmup_ms: float = 50.0,
    rep_ms: float = 200.0,
    max_reps: int = 1000,
    gap_ms: float = 0.0,
) -> Interleaved:
    """Median ms of each of ``fns`` timed alternately in one loop: fns[0], fns[1], ..., fns[0], fns[1], ...

    Without ``warmup``/``reps`` the counts follow do_bench's budgets: three probe rounds (also the first
    warm-up: compiles, autotuning) estimate one round's time from their last round; then
    ``ceil(warmup_ms / round)`` untimed rounds and ``ceil(rep_ms / round)`` timed rounds (at least 5, at
    most ``max_reps``). With explicit counts exactly ``warmup + reps`` rounds run and no probe.
    Each median is over that fn's ``reps`` timed calls. ``clock`` defaults to ``cpu_clock()``.
    ``gap_ms``: the device idles that long before every call, so each starts from the same power state. On an
    H200 the call right after a full-power SDPA call ran 10-23% slower than from idle (RESULTS.md, Run 13);
    without a gap a kernel paired with SDPA pays that every time. The gaps count against the time budgets.
    """
    if not fns:
        raise ValueError("interleaved_ms needs at least one callable")
    clock = clock or cpu_clock()
    if warmup is None or reps is None:
        probe = _rounds(fns, clock, flush, 3, gap_ms)
        # The budgets are wall time: a round's idle gaps count (100 ms gaps around a 1 ms call: 5 rounds, not 200).
        per_round = max(sum(t[-1] for t in probe) + gap_ms * len(fns), 1e-6)
        warmup = min(math.ceil(warmup_ms / per_round), max_reps) if warmup is None else warmup
        reps = min(max(5, math.ceil(rep_ms / per_round)), max_reps) if reps is None else reps
    if reps < 1 or warmup < 0:
        raise ValueError(f"interleaved_ms: reps must be >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    _rounds(fns, clock, flush, warmup, gap_ms)
    times = _rounds(fns, clock, flush, reps, gap_ms)
    return Interleaved(ms=tuple(float(statistics.median(t)) for t in times), reps=reps)
