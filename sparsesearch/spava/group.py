"""Process groups for SPAVA: the environment children get, init with timeouts, an in-process spawner.

Ranks are started either by torchrun / ``python -m torch.distributed.run`` (the CLI, launch.py) or by
``spawn`` below (tests, and callers that stay in Python). Both end with the same per-rank function and the
same ``init_process_group`` call; with one process it is a group of one (STYLE habit 14).

Every environment built for child processes turns NVLink multicast off (ENVIRONMENT.md: multi-GPU hosts
must keep NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..models.split import gpu_count

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 120.0


def child_env(base: dict | None = None, **extra: str) -> dict:
    """A copy of `base` (os.environ by default) with multicast off and `extra` set."""
    env = dict(os.environ if base is None else base)
    env.update(MULTICAST_OFF)
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous of a local run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_backend(backend: str, nproc: int) -> str:
    """'auto' -> nccl with GPUs, gloo without. NCCL without GPUs or with fewer GPUs than ranks is bad input."""
    if nproc <= 0:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    gpus = gpu_count()
    if backend == "auto":
        backend = "nccl" if gpus else "gloo"
    if backend == "nccl" and gpus == 0:
        raise ValueError("backend nccl asked for, but torch sees no CUDA device (use gloo on CPU)")
    if backend == "nccl" and nproc > gpus:
        raise ValueError(f"backend nccl runs one rank per GPU: nproc {nproc} is more than the {gpus} GPUs here")
    return backend


def init_group(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S, rank: int | None = None, world: int | None = None) -> tuple[int, int, torch.device]:
    """init_process_group from the torchrun environment (or rank/world given). -> (rank, world, device).

    The timeout bounds every collective: a dead peer ends the run with an error, not a hang.
    """
    kwargs = {} if rank is None else {"rank": rank, "world_size": world}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    return rank, world, device


def _entry(local_rank: int, fn: Callable, world: int, port: int, backend: str, timeout_s: float, args: tuple) -> None:
    os.environ.update(MULTICAST_OFF)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank))
    init_group(backend, timeout_s, rank=local_rank, world=world)
    try:
        fn(local_rank, world, *args)
        # every rank done with its collectives before any tears the group down: a rank that destroyed its
        # gloo group while a peer's last exchange was still in flight aborted that peer ("terminate called
        # without an active exception", exit -6; seen once in CI in the 2-process decode test)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and torn down: leave without interpreter finalization. Gloo's worker threads can still hold async work
    # whose tensors are freed during finalization, which aborts the process after every result is in (SIGABRT,
    # "terminate called without an active exception"; pytorch/pytorch#179291). The barrier above did not stop it:
    # the 2-process decode test still died that way in two full CI runs, never alone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, nproc: int, *args, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run fn(rank, world, *args) on `nproc` fresh processes in one group; fn must be importable (pickled by name).

    Raises RuntimeError with one line naming the first rank that failed (its exception or exit code), or
    TimeoutError after timeout_s; either way every process of the run is ended before returning.
    """
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)  # inherited by the spawned children
    ctx = mp.start_processes(_entry, args=(fn, nproc, free_port(), backend, timeout_s, args), nprocs=nproc,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + 30  # init and collectives time out first; this is the last guard
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"SPAVA run of {nproc} processes did not finish within {timeout_s + 30:.0f} s")
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        raise RuntimeError(f"rank {exc.error_index} failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"rank {exc.error_index} died (exit code {exc.exit_code}); the run was stopped") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
