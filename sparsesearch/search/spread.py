"""Per-layer work spread over the devices of one host: one worker process per device, one shared task queue.

A layer's search needs nothing but that layer's captured q/k/v and writes its own files in the work
directory, so the searches of a model are independent units. The capture (one forward pass in the main
process, the model placed by ``device_map``) submits each layer as it arrives; whichever worker is free takes
it (a shared queue: a slow layer does not hold up a GPU's share). What travels: per (sample, layer) the
q/k/v once, host memory to the worker through shared memory; back: one short message per layer. The results
are files, so the artifact is assembled exactly as after a one-process search, and a killed run resumes
from them.

Workers are spawned (CUDA cannot be forked) and import torch and the search afresh (a few seconds each).
``setup(device, *setup_args)`` runs once in each worker and returns its state; ``work(state, *args)`` runs
per task; a state with a ``close()`` method has it called at the end, and what it returns comes back in
``Spread.finish()``'s report. setup and work must be module-level functions (they are sent by name).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

POLL_S = 1.0  # how often a waiting main process checks that its workers are alive


@dataclass
class WorkerReport:
    """One worker's account: tasks done, seconds busy, its device's peak memory, what its state's close() said."""

    device: str
    tasks: int = 0
    busy_s: float = 0.0
    peak_bytes: int = 0
    closed: dict = field(default_factory=dict)


def _serve(worker: int, device: str, threads: int, setup: Callable, setup_args: tuple, work: Callable, tasks, results) -> None:
    """Worker ``worker``'s loop: tasks until the None that ends them; every outcome is a message on ``results``."""
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        # the host's cores shared out: every process at torch's default (all cores) made each worker's CPU-side
        # steps 3x slower on a 2-GPU host (OpenMP threads of three processes contending)
        torch.set_num_threads(threads)
        state = setup(device, *setup_args)
        results.put(("ready", None, worker, None))
        while (task := tasks.get()) is not None:
            key, args = task
            started = time.perf_counter()
            work(state, *args)
            results.put(("done", key, worker, time.perf_counter() - started))
        closed = state.close() if hasattr(state, "close") else None
        peak = torch.cuda.max_memory_allocated(torch.device(device)) if device.startswith("cuda") else 0
        results.put(("exit", None, worker, (peak, closed or {})))
    except BaseException as exc:  # noqa: BLE001 -- every failure goes back as one line; the main process raises it
        results.put(("error", None, worker, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


class Spread:
    """Workers on ``devices`` (one process each), fed by ``submit``; ``finish`` waits for every task.

    ``on_done(key, device, seconds)`` is called in the main process as results arrive (from ``poll`` and
    ``finish``). A worker that fails or dies ends the run with a RuntimeError naming it; leaving the ``with``
    block by an exception stops every worker (no process outlives the run)."""

    def __init__(self, devices: list[str], setup: Callable, setup_args: tuple, work: Callable,
                 on_done: Callable[[object, str, float], None] = lambda key, device, seconds: None):
        ctx = mp.get_context("spawn")
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.on_done, self.ready, self.exited = on_done, 0, 0
        self.reports = [WorkerReport(d) for d in devices]
        threads = max(1, (os.cpu_count() or 1) // (len(devices) + 1))  # + 1: the main process's capture
        self.procs = [ctx.Process(target=_serve, args=(i, d, threads, setup, setup_args, work, self.tasks, self.results), daemon=True)
                      for i, d in enumerate(devices)]
        for p in self.procs:
            p.start()

    def __enter__(self) -> Spread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, key, *args) -> None:
        """Queue one task; CPU tensors in ``args`` travel through shared memory."""
        self.tasks.put((key, args))

    def _handle(self, message) -> None:
        """Apply one worker message: counts, reports, on_done; a worker's error raises here."""
        kind, key, worker, payload = message
        report = self.reports[worker]
        if kind == "error":
            raise RuntimeError(f"search worker on {report.device} failed: {payload}")
        if kind == "ready":
            self.ready += 1
        elif kind == "done":
            report.tasks += 1
            report.busy_s += payload
            self.on_done(key, report.device, payload)
        else:  # exit
            self.exited += 1
            report.peak_bytes, report.closed = payload

    def _next(self, timeout: float):
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            dead = [(r.device, p.exitcode) for r, p in zip(self.reports, self.procs) if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"search worker on {dead[0][0]} died (exit code {dead[0][1]})") from None
            return None

    def _wait(self, done: Callable[[], bool]) -> None:
        """Handle messages until done() holds, checking every POLL_S that no worker died."""
        while not done():
            message = self._next(POLL_S)
            if message is not None:
                self._handle(message)

    def wait_ready(self) -> None:
        """Wait until every worker has imported and set up: started before a model loads, their start-up
        (a few seconds each) overlaps the load instead of the search."""
        self._wait(lambda: self.ready == len(self.procs))

    def poll(self) -> None:
        """Handle whatever results have arrived, without waiting."""
        while (message := self._next(0.0)) is not None:
            self._handle(message)

    def finish(self) -> list[WorkerReport]:
        """Wait for every submitted task, end the workers, and return their reports."""
        for _ in self.procs:
            self.tasks.put(None)
        self._wait(lambda: self.exited == len(self.procs))
        for p in self.procs:
            p.join()
        return list(self.reports)

    def close(self) -> None:
        """Stop every worker still running (after a failure: the tasks in flight are abandoned)."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
