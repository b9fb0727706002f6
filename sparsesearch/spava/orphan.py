"""Ranks that outlive their launcher end themselves.

`spava run` / `spava sweep` start torchrun in a session of its own so that a refused or timed-out launch can end
every rank at once (launch._end_session). That cleanup runs in the launching CLI; when the CLI is killed outright
(SIGKILL, a closed terminal's process group), nothing ends the session, and the ranks would run on, holding
GPUs, with the launcher's temporary directory left in /tmp. So each rank watches the launcher's pid, given in
LAUNCHER_ENV, and when it is gone rank 0 removes the launcher's temporary directory and every rank exits;
torchrun, its workers gone and no restarts asked for, exits too.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

LAUNCHER_ENV = "SPARSESEARCH_SPAVA_LAUNCHER"  # pid of the process that started torchrun
POLL_S = 1.0
TEMP_PREFIX = "spava-"  # launch.py's temporary directory: removed only when it is one of ours


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists under another user
        return True
    return True


def watch_launcher(pid: int, temp_dir: Path | None, *, rank: int, poll_s: float = POLL_S, exit=os._exit) -> threading.Thread:
    """Start a daemon thread that, once ``pid`` is gone, removes ``temp_dir`` (rank 0, and only a directory
    named like launch.py's) and ends this process with status 1."""

    def watch() -> None:
        while alive(pid):
            time.sleep(poll_s)
        if rank == 0 and temp_dir is not None and temp_dir.name.startswith(TEMP_PREFIX):
            shutil.rmtree(temp_dir, ignore_errors=True)
        exit(1)

    thread = threading.Thread(target=watch, name="spava-launcher-watch", daemon=True)
    thread.start()
    return thread


def watch_from_env(result: str | None) -> threading.Thread | None:
    """``watch_launcher`` for a rank started by the launcher (LAUNCHER_ENV set); None when started by hand."""
    pid = os.environ.get(LAUNCHER_ENV)
    if not pid:
        return None
    temp_dir = Path(result).parent if result else None
    return watch_launcher(int(pid), temp_dir, rank=int(os.environ.get("RANK", "0")))
