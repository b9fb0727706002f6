"""A SPAVA rank whose launcher is killed outright ends itself, and rank 0 removes the launcher's temporary
directory (P12 §1: no hung ranks, no leftovers)."""

from __future__ import annotations

import subprocess
import sys
import time

from sparsesearch.spava.orphan import LAUNCHER_ENV, alive

RANK = """
import sys, time
from pathlib import Path
from sparsesearch.spava.orphan import watch_from_env
watch_from_env(sys.argv[1])
time.sleep(60)
"""


def _wait_gone(proc: subprocess.Popen, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return True
        time.sleep(0.1)
    return False


def test_a_rank_ends_and_cleans_up_when_its_launcher_is_killed(tmp_path):
    temp = tmp_path / "spava-abc"
    temp.mkdir()
    (temp / "ranks.log").write_text("x")
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = {**__import__("os").environ, LAUNCHER_ENV: str(launcher.pid), "RANK": "0"}
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(temp / "result.json")], env=env)
    try:
        time.sleep(1.5)
        assert rank.poll() is None  # the launcher lives: the rank works on
        launcher.kill()
        launcher.wait()
        assert _wait_gone(rank, 10), "the rank outlived its launcher"
        assert rank.returncode == 1 and not temp.exists()
    finally:
        for p in (launcher, rank):
            if p.poll() is None:
                p.kill()


def test_only_rank_0_removes_and_only_a_launcher_directory(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()
    assert not alive(launcher.pid)
    env = {**__import__("os").environ, LAUNCHER_ENV: str(launcher.pid), "RANK": "0"}
    rank = subprocess.run([sys.executable, "-c", RANK, str(other / "result.json")], env=env, timeout=30)
    assert rank.returncode == 1 and other.exists()  # not named like launch.py's temporary: kept
