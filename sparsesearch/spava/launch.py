"""Start a SPAVA launch with torch.distributed.run (torchrun) and collect rank 0's rows.

Everything a user can get wrong is checked here first (``preflight``: nproc, backend vs GPUs, l_a / l_p
against the prompt length, the model's context, the data spec), so bad input is one line with nothing
written and no process started. The children get the multicast-off environment (group.child_env) and
a collective timeout; torchrun ends the other ranks when one dies, and the launcher turns that into one
line naming the rank and its last error. The children run in their own session, so a wall-clock limit
ends exactly the processes this launcher started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .decode import DECODERS
from .group import check_backend, child_env, free_port
from .orphan import LAUNCHER_ENV
from .run import PROGRESS, SpavaConfig, layouts


def preflight(cfg: SpavaConfig) -> None:
    """Raise ValueError (one line) for any bad input before a process starts."""
    check_backend(cfg.backend, cfg.nproc)
    if cfg.query < 1:
        raise ValueError(f"--query must be >= 1 token, got {cfg.query}")
    if not cfg.tokens or any(n <= cfg.query for n in cfg.tokens):
        raise ValueError(f"--tokens must be longer than the query ({cfg.query}), got {cfg.tokens}")
    if cfg.timeout_s <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {cfg.timeout_s}")
    if cfg.generate < 0:
        raise ValueError(f"--generate must be >= 0 tokens, got {cfg.generate}")
    if cfg.decode not in DECODERS:
        raise ValueError(f"--decode must be one of {', '.join(DECODERS)}, got {cfg.decode!r}")
    if cfg.bandwidth_gbs <= 0:
        raise ValueError(f"--bandwidth must be > 0 GB/s, got {cfg.bandwidth_gbs}")
    for n in cfg.tokens:
        layouts(cfg, n)
    from .. import preflight as check

    what = "--tokens + --generate" if cfg.generate else "--tokens"
    check.context_fits(what, max(cfg.tokens) + cfg.generate, check.model_info(cfg.model))
    check.data("--data", None if cfg.data == "text" else cfg.data)


def triton_mode(backend: str) -> dict:
    """TRITON_INTERPRET for the ranks: the interpreter on gloo (CPU tensors: the decode's kernel path runs there
    only interpreted), compiled kernels on NCCL (interpreting them on GPUs would time the interpreter); a value
    set by the caller is kept either way."""
    default = "1" if backend == "gloo" else "0"
    return {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", default)}


_RANK_ERROR = re.compile(r"^\[rank(\d+)\]:\s*(\w*(Error|Exception)\b.*)$")
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+).*?traceback\s*:\s*([^\n]*)", re.S)


def failure_line(log: str, rc: int) -> str:
    """One line for a failed launch from torchrun's log: the root-cause rank (torchrun's summary) with its
    signal or its Python error; else the first rank error; else the exit code."""
    errors = {}
    for line in log.splitlines():
        m = _RANK_ERROR.match(line.strip())
        if m:
            errors.setdefault(int(m.group(1)), m.group(2)[:300])
    root = _ROOT.search(log)
    if root:
        rank, code, trace = int(root.group(1)), root.group(2), root.group(3).strip()
        if trace.startswith("Signal"):
            return f"rank {rank} died ({trace}); torchrun stopped the other ranks"
        if rank in errors:
            return f"rank {rank} failed: {errors[rank]}"
        return f"rank {rank} exited with code {code}; torchrun stopped the other ranks"
    if errors:
        rank = min(errors)
        return f"rank {rank} failed: {errors[rank]}"
    return f"the launch failed (torchrun exit code {rc}) before any rank reported an error"


def launch(cfg: SpavaConfig, *, wall_s: float | None = None, log_path: Path | None = None, tick=lambda done, total: None) -> dict:
    """Run the launch; returns rank 0's result dict (rows, exact_engine, ...). RuntimeError on failure.
    tick(done, total) is called as rank 0 finishes configurations (read from the ranks' log)."""
    preflight(cfg)
    with tempfile.TemporaryDirectory(prefix="spava-") as tmp:
        result = Path(tmp) / "result.json"
        log_file = log_path or Path(tmp) / "ranks.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "sparsesearch.spava", "--config", json.dumps(asdict(cfg)), "--result", str(result)]
        env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc))),
                        **triton_mode(check_backend(cfg.backend, cfg.nproc)), **{LAUNCHER_ENV: str(os.getpid())})
        with open(log_file, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = _wait(proc, Path(log_file), wall_s, tick)
            except subprocess.TimeoutExpired:
                _end_session(proc)
                raise RuntimeError(f"SPAVA launch did not finish within {wall_s:.0f} s; its processes were ended") from None
            finally:
                _end_session(proc)  # torchrun stops its ranks; this ends anything left in the session
        if rc != 0 or not result.is_file():
            raise RuntimeError(failure_line(Path(log_file).read_text(errors="replace"), rc))
        return json.loads(result.read_text())


def _wait(proc: subprocess.Popen, log_file: Path, wall_s: float | None, tick) -> int:
    """proc.wait with a wall limit (TimeoutExpired past it), calling tick on each progress line of rank 0."""
    deadline = None if wall_s is None else time.monotonic() + wall_s
    seen = 0
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() > deadline:
                raise
        marks = re.findall(rf"^{PROGRESS} (\d+) (\d+)$", log_file.read_text(errors="replace"), re.M)
        if len(marks) > seen:
            seen = len(marks)
            tick(int(marks[-1][0]), int(marks[-1][1]))


def _end_session(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks: the session started for them, TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not _session_alive(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is not None and not _session_alive(proc.pid):
            return


def _session_alive(sid: int) -> bool:
    """Whether any process of session `sid` (the one started for torchrun) is still there."""
    try:
        os.killpg(sid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
