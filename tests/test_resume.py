"""Fault tests of the long commands' resume (sparsesearch.workdir): probe-layers and sweep-spava are killed
after k units (a KeyboardInterrupt from the unit function) or at a random point (SIGKILL of a real process
after its first unit file), rerun with --resume, and must end with what an uninterrupted run writes, with no
partial directory or temporary left beside the output.

`spava run` has no resume: it is one launch of one configuration on one prompt (a single unit, printed and
not written), so a killed run has nothing finished to keep.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from sparsesearch.probe.probe import ProbeSettings
from sparsesearch.probe.run import ProbeConfig, run_probe
from sparsesearch.workdir import WorkDir, partial_path
from sparsesearch_cli.app import app
from processes import descendants
from tiny_model import make_tiny_model

runner = CliRunner()
CLI = "import sys; from sparsesearch_cli.app import main; sys.argv[0] = 'sparsesearch'; main()"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=3)


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _leftovers(root: Path, out: Path, command: str) -> list[str]:
    """What a finished run must not leave: its partial directory, and any temporary of a whole-file write."""
    left = [str(p) for p in root.rglob(".*.tmp*")]
    return left + ([str(partial_path(out, command))] if partial_path(out, command).exists() else [])


def _interrupt_after(monkeypatch, module, name: str, k: int):
    """Patch ``module.name`` to raise KeyboardInterrupt on its (k + 1)-th call; -> the real function."""
    real, calls = getattr(module, name), [0]

    def unit(*args, **kwargs):
        if calls[0] == k:
            raise KeyboardInterrupt
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, unit)
    return real


def _count_calls(monkeypatch, module, name: str, real) -> list[int]:
    """Patch ``module.name`` to ``real``, counting its calls; -> the counter."""
    calls = [0]

    def unit(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, unit)
    return calls


def _kill_at_random_point(cmd: list[str], unit_dir: Path, units: int, seed: int) -> int:
    """Start ``cmd`` in a session of its own; once a random number of its ``units`` unit files (at least one,
    at most units - 2, so that the run cannot finish between the look and the kill) are in ``unit_dir``,
    SIGKILL its session and any session a child started (the SPAVA launcher's torchrun), wherever it is then;
    -> the return code. The processes ended are the ones this test started, named by pid."""
    at = random.Random(seed).randint(1, units - 2)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while len([p for p in unit_dir.glob("*.json") if p.name != "state.json"]) < at:
            assert proc.poll() is None, "the run ended before the kill"
            assert time.monotonic() < deadline, f"fewer than {at} unit files within 240 s"
            time.sleep(0.02)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
    return proc.returncode


# ------------------------------------------------------------------------------------------ probe-layers


def _probe_cfg(model: str, out: Path, **kw) -> ProbeConfig:
    settings = ProbeSettings(samples=3, tokens=320, sink=16, window=32, last=32)
    return ProbeConfig(model=model, settings=settings, out=out, created="2026-01-01T00:00:00Z", **kw)


@pytest.fixture(scope="module")
def probe_reference(tiny, tmp_path_factory):
    """The uninterrupted probe: the artifact's files and the plot's bytes."""
    out = tmp_path_factory.mktemp("ref") / "art"
    run_probe(_probe_cfg(tiny, out))
    return _files(out), out.with_name("art.png").read_bytes()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_probe_killed_after_k_prompts_resumes_to_the_same_artifact(tiny, tmp_path, monkeypatch, probe_reference, k):
    import sparsesearch.probe.run as probe_run

    out = tmp_path / "art"
    real = _interrupt_after(monkeypatch, probe_run, "probe_sample", k)
    with pytest.raises(KeyboardInterrupt):
        run_probe(_probe_cfg(tiny, out))
    work = WorkDir(partial_path(out, "probe-layers"))
    assert work.names() == {f"sample-{i:05d}" for i in range(k)} and not out.exists()
    calls = _count_calls(monkeypatch, probe_run, "probe_sample", real)
    run_probe(_probe_cfg(tiny, out, resume=True))
    assert calls[0] == 3 - k  # the prompts done before the kill are read, not probed again
    files, png = probe_reference
    assert _files(out) == files and out.with_name("art.png").read_bytes() == png
    assert _leftovers(tmp_path, out, "probe-layers") == []


def test_probe_resume_refuses_other_settings_and_a_fresh_start_drops_old_state(tiny, tmp_path, monkeypatch, probe_reference):
    import sparsesearch.probe.run as probe_run

    out = tmp_path / "art"
    _interrupt_after(monkeypatch, probe_run, "probe_sample", 1)
    with pytest.raises(KeyboardInterrupt):
        run_probe(_probe_cfg(tiny, out))
    monkeypatch.undo()
    other = _probe_cfg(tiny, out, resume=True)
    other.settings = ProbeSettings(samples=3, tokens=320, sink=8, window=32, last=32)
    with pytest.raises(ValueError, match="started with other settings; drop --resume") as exc:
        run_probe(other)
    assert "\n" not in str(exc.value)
    work = WorkDir(partial_path(out, "probe-layers"))
    work.save("sample-00001", {"length": 1, "grad": [], "abs": [], "att": []})  # a stale unit a fresh start must not read
    run_probe(_probe_cfg(tiny, out))  # no resume: the old state is dropped, every prompt probed again
    assert _files(out) == probe_reference[0] and _leftovers(tmp_path, out, "probe-layers") == []


def test_probe_cli_sigkilled_at_a_random_point_resumes(tiny, tmp_path):
    """The real command, SIGKILLed after its first prompt; `--resume` ends with the uninterrupted run's table
    (the manifest differs only in its creation time)."""
    args = ["probe-layers", "--model", tiny, "--samples", "6", "--tokens", "320", "--sink", "16", "--window", "32", "--last", "32",
            "--device", "cpu"]
    ref = tmp_path / "ref"
    assert runner.invoke(app, args + ["--out", str(ref), "--json"]).exit_code == 0
    out = tmp_path / "art"
    rc = _kill_at_random_point([sys.executable, "-c", CLI, *args, "--out", str(out)], partial_path(out, "probe-layers"), 6, seed=1)
    assert rc == -signal.SIGKILL and not out.exists()
    res = runner.invoke(app, args + ["--out", str(out), "--resume", "--json"])
    assert res.exit_code == 0, res.output
    assert (out / "layers.parquet").read_bytes() == (ref / "layers.parquet").read_bytes()
    manifest = lambda d: {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "created"}
    assert manifest(out) == manifest(ref)
    assert _leftovers(tmp_path, out, "probe-layers") == []


# ------------------------------------------------------------------------------------------- sweep-spava

# Timings (and the modelled latency and recommendation built on them) are measured, so they differ between
# any two runs; everything else in a row is computed and must be the same.
MEASURED = ("seconds", "seconds_exact", "attention_seconds", "modelled_s_w2", "modelled_s_w4", "modelled_s_w8")
SWEEP = ["--nproc", "1", "--tokens", "600", "--samples", "2", "--anchor", "128", "--passing", "0,128", "--query", "16", "--backend", "gloo"]


def _computed(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "spava.parquet").drop(columns=list(MEASURED))


@pytest.fixture
def in_process_launch(monkeypatch, tmp_path):
    """The launcher replaced by the rank program run here, as a group of one (gloo): what the CLI does around
    the launch is unchanged, and a patched unit function reaches the rank."""
    import sparsesearch.spava.launch as launch_mod
    from sparsesearch.spava.group import free_port
    from sparsesearch.spava.run import rank_main

    def launch(cfg, *, tick=lambda done, total: None, **_):
        launch_mod.preflight(cfg)
        result = tmp_path / "result.json"
        with monkeypatch.context() as env:
            env.setenv("MASTER_ADDR", "127.0.0.1")
            env.setenv("MASTER_PORT", str(free_port()))
            env.setenv("RANK", "0")
            env.setenv("WORLD_SIZE", "1")
            rank_main(cfg, str(result))
        payload = json.loads(result.read_text())
        result.unlink()
        return payload

    monkeypatch.setattr(launch_mod, "launch", launch)


@pytest.mark.parametrize("k", [2, 3])  # 2: the first prompt done (its exact run skipped); 3: the second prompt half done
def test_sweep_spava_killed_after_k_configurations_resumes(tiny, tmp_path, monkeypatch, in_process_launch, k):
    import sparsesearch.spava.run as spava_run

    ref, out = tmp_path / "ref", tmp_path / "art"
    assert runner.invoke(app, ["sweep-spava", "--model", tiny, *SWEEP, "--out", str(ref), "--json"]).exit_code == 0
    real = _interrupt_after(monkeypatch, spava_run, "config_row", k)
    res = runner.invoke(app, ["sweep-spava", "--model", tiny, *SWEEP, "--out", str(out)])
    assert res.exit_code != 0 and not out.exists()
    work = WorkDir(partial_path(out, "sweep-spava"))
    saved = {name: work.load(name) for name in sorted(work.names())}
    assert len(saved) == k
    calls = _count_calls(monkeypatch, spava_run, "config_row", real)
    res = runner.invoke(app, ["sweep-spava", "--model", tiny, *SWEEP, "--out", str(out), "--resume", "--json"])
    assert res.exit_code == 0, res.output
    assert calls[0] == 4 - k  # the configurations measured before the kill are read, not run again
    pd.testing.assert_frame_equal(_computed(out), _computed(ref))
    rows = pd.read_parquet(out / "spava.parquet")
    for row in saved.values():  # a resumed row is the saved one, its measured timings included
        at = rows[(rows["sample"] == row["sample"]) & (rows["passing"] == row["passing"])].iloc[0]
        assert all(at[m] == row[m] for m in MEASURED if row[m] is not None)
    assert _leftovers(tmp_path, out, "sweep-spava") == []


@pytest.mark.slow  # three real launches, about a minute on two CPU cores
def test_sweep_spava_cli_sigkilled_at_a_random_point_resumes(tiny, tmp_path):
    """The real command and launch (torchrun, one rank), SIGKILLed with its ranks after a random number of
    configurations; `--resume` ends with the uninterrupted sweep's computed values."""
    args = ["sweep-spava", "--model", tiny, *SWEEP, "--samples", "3"]
    ref, out = tmp_path / "ref", tmp_path / "art"
    assert runner.invoke(app, args + ["--out", str(ref), "--json"]).exit_code == 0
    rc = _kill_at_random_point([sys.executable, "-c", CLI, *args, "--out", str(out)], partial_path(out, "sweep-spava"), 6, seed=2)
    assert rc == -signal.SIGKILL and not out.exists()
    res = runner.invoke(app, args + ["--out", str(out), "--resume", "--json"])
    assert res.exit_code == 0, res.output
    pd.testing.assert_frame_equal(_computed(out), _computed(ref))
    assert _leftovers(tmp_path, out, "sweep-spava") == []
