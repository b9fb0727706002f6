"""A SPAVA rank whose launcher is killed outright ends itself, and rank 0 removes the launcher's temporary
directory (P12 §1: no hung ranks, no leftovers)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from processes import descendants
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


@pytest.mark.slow
def test_spava_run_killed_outright_leaves_no_rank_and_no_temporary_and_reruns_the_same(tmp_path):
    """`spava run`'s CLI SIGKILLed mid-launch (as `kill -9` would: the CLI alone): torchrun and its ranks end
    within seconds and the launcher's spava-* directory goes; a rerun gives the uninterrupted run's values."""
    import json
    import os
    import signal

    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", layers=3)
    args = ["spava", "run", "--model", model, "--nproc", "2", "--tokens", "900", "--anchor", "128", "--passing", "128",
            "--query", "16", "--backend", "gloo", "--json"]
    cli = ["-c", "import sys; from sparsesearch_cli.app import main; sys.argv[0] = 'sparsesearch'; main()", *args]
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    ref = subprocess.run([sys.executable, *cli], env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    proc = subprocess.Popen([sys.executable, *cli], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(temp.glob("spava-*/ranks.log")) or len(descendants(proc.pid)) < 3:  # torchrun + 2 ranks
        assert proc.poll() is None and time.monotonic() < deadline, "the launch ended before the kill"
        time.sleep(0.05)
    below = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert not [p for p in below if alive(p)], "ranks outlived the killed launcher"
        assert not list(temp.glob("spava-*")), "the launcher's temporary was left"
    finally:
        for p in below:
            if alive(p):
                os.kill(p, signal.SIGKILL)
    again = subprocess.run([sys.executable, *cli], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    keep = ("tokens", "anchor", "passing", "kl", "top1_agreement", "bytes_sent")
    rows = lambda out: [{k: r.get(k) for k in keep} for r in json.loads(out)["rows"]]  # noqa: E731
    assert rows(again.stdout) == rows(ref.stdout)
