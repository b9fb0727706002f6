"""The measured-cost cache trusts only times measured by this torch, Triton and kernel version."""

from __future__ import annotations

import json

import pytest

from sparsesearch.search.cost import MeasuredCost, cache_env, kernel_version


def test_cache_round_trips_under_its_stamp(tmp_path):
    path = tmp_path / "costs.json"
    first = MeasuredCost(cache_path=path)
    first._cache["H200|(1, 4, 512, 64)|ashape"] = 0.25
    first._write()
    stored = json.loads(path.read_text())
    assert stored["env"] == cache_env() and set(stored["env"]) == {"torch", "triton", "kernels"}
    assert MeasuredCost(cache_path=path)._cache == {"H200|(1, 4, 512, 64)|ashape": 0.25}


@pytest.mark.parametrize("content", [
    {"env": {**cache_env(), "triton": "0.0.1"}, "costs": {"k": 1.0}},   # another Triton
    {"env": {**cache_env(), "kernels": "0" * 16}, "costs": {"k": 1.0}},  # older kernels
    {"H100|(1, 4, 512, 64)|ashape": 1.0},                                # the unstamped layout before
    {"env": cache_env("NVIDIA H100 80GB HBM3"), "costs": {"k": 1.0}},   # another GPU
])
def test_foreign_or_stale_cache_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match="ignoring cost cache"):
        costs = MeasuredCost(cache_path=path, device_name="NVIDIA H200")
    assert costs._cache == {}
    costs._write()  # the next write replaces it with this install's stamp
    assert json.loads(path.read_text())["env"] == cache_env("NVIDIA H200")


def test_unreadable_cache_is_ignored_and_a_missing_one_is_silent(tmp_path, recwarn):
    assert MeasuredCost(cache_path=tmp_path / "none.json")._cache == {}
    assert not recwarn.list
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert MeasuredCost(cache_path=tmp_path / "bad.json")._cache == {}


def test_kernel_version_follows_the_kernel_sources(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = kernel_version(tmp_path)
    assert len(before) == 16 and kernel_version(tmp_path) == before
    (tmp_path / "a.py").write_text("x = 2\n")
    assert kernel_version(tmp_path) != before
    assert kernel_version() == cache_env()["kernels"]
