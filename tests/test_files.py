"""Whole-or-nothing writes (sparsesearch/files.py) and the shared files that use them: the measured-cost cache and the
launch table keep both processes' entries when two write at once, and a failed write leaves the old file and no
temporary."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from sparsesearch import files
from sparsesearch.files import atomic_path, locked, write_bytes_atomic, write_json_atomic, write_text_atomic
from sparsesearch.kernels.launch_table import write_configs
from sparsesearch.search.cost import MeasuredCost

ROUNDS = 40  # writes per process: enough for the two to interleave many times on two cores
CONFIG = {"TILE_N": 32, "num_warps": 8, "num_stages": 3}
ENV = {"torch": "2.0", "triton": "3.0", "kernels": "0" * 16, "device": "Fake GPU"}


def leftovers(directory: Path) -> list[str]:
    """Temporaries the writes may have left (the sidecar lock files are meant to stay)."""
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def test_files_module_imports_nothing_from_the_package():
    """It sits at the bottom of the layering: any module may use it, so it may use none of them."""
    tree = ast.parse(Path(files.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.level or "sparsesearch" in (n.module or ""))]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("sparsesearch")]
    assert imported == []


def test_writes_give_exactly_the_serialised_bytes(tmp_path):
    payload = {"b": [1, 2.5, None], "a": "é"}
    write_json_atomic(tmp_path / "a.json", payload, end="\n", indent=2, sort_keys=True)
    assert (tmp_path / "a.json").read_text() == json.dumps(payload, indent=2, sort_keys=True) + "\n"
    write_json_atomic(tmp_path / "b.json", payload)
    assert (tmp_path / "b.json").read_text() == json.dumps(payload)
    write_text_atomic(tmp_path / "deep" / "c.txt", "é\n")  # missing directories are made
    assert (tmp_path / "deep" / "c.txt").read_bytes() == "é\n".encode()
    write_bytes_atomic(tmp_path / "c.txt", b"old")
    write_bytes_atomic(tmp_path / "c.txt", b"new")
    assert (tmp_path / "c.txt").read_bytes() == b"new" and leftovers(tmp_path) == []


def test_a_new_file_gets_the_permissions_a_plain_open_gives(tmp_path):
    """Not mkstemp's 0600: the shared cache must stay readable as it was before."""
    mask = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "x", b"x")
        (tmp_path / "plain").write_bytes(b"x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o644


def test_the_file_and_its_directory_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(files.os, "fsync", record)
    write_bytes_atomic(tmp_path / "x", b"x")
    assert synced == ["file", "dir"], "the bytes before the rename, the rename after it"


def test_a_payload_that_fails_to_serialise_leaves_the_old_file(tmp_path):
    target = tmp_path / "t.json"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_json_atomic(target, {"bad": object()})
    assert target.read_text() == "old" and leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [OSError("disk full (simulated)"), KeyboardInterrupt()])
def test_a_failed_writer_removes_its_temporary(tmp_path, error):
    target = tmp_path / "t.parquet"
    target.write_text("old")
    with pytest.raises(type(error)):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise error
    assert target.read_text() == "old" and leftovers(tmp_path) == []


def test_a_failed_rename_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "t.json"
    target.write_text("old")

    def refuse(src, dst):
        raise OSError("replace failed (simulated)")

    monkeypatch.setattr(files.os, "replace", refuse)
    with pytest.raises(OSError, match="simulated"):
        write_text_atomic(target, "new")
    assert target.read_text() == "old" and leftovers(tmp_path) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_leaves_the_old_file(tmp_path):
    target = tmp_path / "ro" / "t.json"
    target.parent.mkdir()
    target.write_text("old")
    target.parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            write_text_atomic(target, "new")
    finally:
        target.parent.chmod(0o755)
    assert target.read_text() == "old" and leftovers(target.parent) == []


def test_a_cost_cache_write_that_fails_leaves_the_cache_and_keeps_what_it_measured(tmp_path):
    path = tmp_path / "costs.json"
    costs = MeasuredCost(cache_path=path)
    costs._cache["k"], costs._dirty = 1.0, True
    costs.flush()
    before = path.read_text()
    costs.table.add("fam", [1.0], 1.0)
    costs._cache["bad"], costs._dirty = object(), True
    with pytest.raises(TypeError):
        costs.flush()
    assert path.read_text() == before and leftovers(tmp_path) == []
    del costs._cache["bad"]
    other = MeasuredCost(cache_path=path)  # another process writes in between
    other._cache["o"], other._dirty = 2.0, True
    other.flush()
    costs.flush()  # the point the failed write did not save is merged in now
    stored = json.loads(path.read_text())
    assert stored["costs"] == {"k": 1.0, "o": 2.0} and stored["points"] == {"fam": [[1.0, 1.0]]}


def test_two_cost_caches_that_read_the_same_file_keep_each_others_entries(tmp_path):
    """The lost update a bare atomic replace allows: both read, both measure, both write; the merge keeps both."""
    path = tmp_path / "costs.json"
    first, second = MeasuredCost(cache_path=path), MeasuredCost(cache_path=path)
    first._cache["a"] = 1.0
    first.table.add("fam", [1.0, 1.0], 1.0)
    first._write()
    second._cache["b"] = 2.0
    second.table.add("fam", [1.0, 2.0], 2.0)
    second._write()
    stored = json.loads(path.read_text())
    assert stored["costs"] == {"a": 1.0, "b": 2.0}
    assert stored["points"] == {"fam": [[1.0, 1.0, 1.0], [1.0, 2.0, 2.0]]}
    first._write()  # a writer that adopted the file once adds nothing twice
    assert json.loads(path.read_text())["points"] == stored["points"]


def _hammer_costs(path: str, tag: int, start) -> None:
    costs = MeasuredCost(cache_path=Path(path))
    start.wait()
    for i in range(ROUNDS):
        costs._cache[f"{tag}-{i}"] = float(i)
        costs.table.add("shared", [1.0, float(tag), float(i)], float(i))
        costs._dirty = True
        costs.flush()


def _costs_written(path: Path) -> set:
    stored = json.loads(path.read_text())
    return set(stored["costs"]) | {f"point {int(row[1])}-{int(row[2])}" for row in stored["points"]["shared"]}


def _costs_expected(tag: int) -> set:
    return {f"{tag}-{i}" for i in range(ROUNDS)} | {f"point {tag}-{i}" for i in range(ROUNDS)}


def _hammer_launch_table(path: str, tag: int, start) -> None:
    start.wait()
    for i in range(ROUNDS):
        write_configs(Path(path), "Fake GPU", ENV, {f"{tag}-{i}": CONFIG})


def _launch_table_written(path: Path) -> set:
    return set(json.loads(path.read_text())["devices"]["Fake GPU"]["configs"])


def _launch_table_expected(tag: int) -> set:
    return {f"{tag}-{i}" for i in range(ROUNDS)}


@pytest.mark.parametrize("hammer, written, expected", [
    (_hammer_costs, _costs_written, _costs_expected),
    (_hammer_launch_table, _launch_table_written, _launch_table_expected),
], ids=["cost-cache", "launch-table"])
def test_two_processes_writing_one_shared_file_keep_both_and_never_corrupt_it(tmp_path, hammer, written, expected):
    """Two real processes write the file ROUNDS times each, at once; meanwhile every read of it parses, and at the
    end each process's entries are all there."""
    path = tmp_path / "shared.json"
    context = multiprocessing.get_context("fork")  # the children need only what this process imported already
    start = context.Event()
    workers = [context.Process(target=hammer, args=(str(path), tag, start)) for tag in (1, 2)]
    for worker in workers:
        worker.start()
    start.set()
    reads = 0
    while any(worker.is_alive() for worker in workers):
        if path.exists():
            written(path)  # raises on a half-written file
            reads += 1
        time.sleep(0.001)  # two cores, shared: leave the writers most of them
    for worker in workers:
        worker.join()
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert written(path) == expected(1) | expected(2)
    assert leftovers(tmp_path) == [] and reads > 0


def test_locked_excludes_another_process(tmp_path):
    """The lock is held across processes: a child asking for it waits until the parent lets go."""
    context = multiprocessing.get_context("fork")
    order = context.Queue()
    with locked(tmp_path / "f.json"):
        child = context.Process(target=_take_lock, args=(str(tmp_path / "f.json"), order))
        child.start()
        child.join(timeout=0.5)
        assert child.is_alive(), "the child got the lock while the parent held it"
        order.put("parent let go")
    child.join(timeout=10)
    assert child.exitcode == 0 and [order.get(timeout=5), order.get(timeout=5)] == ["parent let go", "child locked"]


def _take_lock(path: str, order) -> None:
    with locked(path):
        order.put("child locked")
