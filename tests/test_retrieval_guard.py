"""The retrieval guard of --target-kl (sparsesearch/tuning.py, search/targets.hold_guard): the KL target's
choice moves up the path to the cheapest point that loses no passkey answer dense gives; a guard that the
densest sparse point still fails is a miss; a guard dense cannot answer is recorded and left out."""

from __future__ import annotations

import pytest
import torch

from sparsesearch.calibrate import CalibrateConfig
from sparsesearch.search.allocate import hold_retrieval
from sparsesearch.search.targets import DENSE, Allocation, HeadCurve, hold_guard
from sparsesearch.tuning import GUARD_DATA, retrieval_guard
from tiny_model import make_tiny_model

CURVE = HeadCurve(layer=0, head=0, cost=(1.0, 2.0, 3.0, 4.0), error=(0.4, 0.3, 0.2, 0.1), dense_cost=5.0)
PATH = [Allocation([0]), Allocation([1]), Allocation([2]), Allocation([3]), Allocation([DENSE])]


def _misses(table: dict[int, int]):
    """misses_of over rows_of's one row: the candidate index -> misses, and the calls it saw."""
    calls = []

    def misses_of(rows):
        calls.append(rows[0]["choice"])
        return table[rows[0]["choice"]]

    return misses_of, calls


def _rows(a: Allocation) -> list[dict]:
    return [{"choice": a.choices[0]}]


@pytest.mark.parametrize("start, table, expected", [
    (0, {0: 2, 1: 1, 2: 0, 3: 0}, 2),  # moved up two points
    (1, {0: 2, 1: 0, 2: 0, 3: 0}, 1),  # the KL's choice already holds: it stands
    (0, {0: 3, 1: 2, 2: 1, 3: 1}, None),  # even the densest sparse point loses an answer
])
def test_hold_guard_finds_the_cheapest_point_at_or_past_the_start(start, table, expected):
    misses_of, calls = _misses(table)
    held, measured = hold_guard(PATH, start, lambda a: misses_of(_rows(a)))
    assert held == expected
    assert calls[0] == 3, "the densest sparse point is measured first: if it misses, nothing cheaper is tried"
    assert all(i >= start for i in measured) and DENSE not in calls, "never below the KL's choice, never all-dense"
    if held is not None:
        assert measured[held] == 0 and all(measured[i] > 0 for i in measured if i < held)


def test_hold_retrieval_records_the_move_and_the_miss():
    misses_of, _ = _misses({0: 2, 1: 1, 2: 0, 3: 0})
    alloc, record, miss = hold_retrieval(PATH, 0, (misses_of, {"dense_correct": 3}), _rows, [CURVE])
    assert alloc is PATH[2] and miss is None
    assert record["held"] and record["kl_choice_cost"] == 0.2 and record["cost"] == 0.6
    assert [m["cost_fraction"] for m in record["measured"]] == sorted(m["cost_fraction"] for m in record["measured"])

    failing, _ = _misses({0: 3, 1: 2, 2: 1, 3: 1})
    alloc, record, miss = hold_retrieval(PATH, 0, (failing, {"dense_correct": 3}), _rows, [CURVE])
    assert alloc is PATH[0] and not record["held"]
    assert miss.startswith("the retrieval guard cannot be held: the densest sparse allocation loses 1 of 3")

    alloc, record, miss = hold_retrieval(PATH, 1, (None, {"dense_correct": 0, "why": "nothing to hold"}), _rows, [CURVE])
    assert alloc is PATH[1] and miss is None and record["why"] == "nothing to hold"


def test_a_guard_dense_cannot_answer_is_recorded_not_applied(tmp_path):
    from sparsesearch.models import load_model

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=2)
    misses_of, record = retrieval_guard(cfg, model, tok, {}, [])
    assert misses_of is None  # a random tiny model answers no passkey
    assert record["data"] == GUARD_DATA and record["prompts"] == 2 and record["dense_correct"] == 0
    assert record["held"] is None and "nothing to hold" in record["why"]


def test_calibrate_moves_the_kl_choice_until_the_guard_holds(tmp_path, monkeypatch):
    """Through calibrate on the tiny model (whose dense run answers no passkey, so the real guard would hold
    nothing): a guard that loses an answer at every point below 60% mean density moves the KL target's
    choice there; the record names both points, and the moved point's KL is measured (it meets the target)."""
    import json

    import sparsesearch.calibrate as cal
    from test_calibrate import SPACE

    def fake_guard(cfg, model, tokenizer, manifest, fixed_rows, progress=None):
        def misses_of(rows):
            return int(sum(r["density"] for r in rows) / len(rows) < 0.6)

        return misses_of, {"data": GUARD_DATA, "prompts": 1, "dense_correct": 1}

    monkeypatch.setattr(cal, "retrieval_guard", fake_guard)
    space = tmp_path / "space.json"
    space.write_text(json.dumps(SPACE))
    target = 0.05
    res = cal.calibrate(CalibrateConfig(model=make_tiny_model(tmp_path / "tiny"), data="synthetic:passkey", search_space=str(space),
                                        max_tokens=256, out=tmp_path / "a", eval_data="", target_kl=target, min_tokens=128))
    rec = res.manifest["methods"]["mminference"]["target"]
    guard = rec["retrieval_guard"]
    assert guard["held"] and guard["cost"] > guard["kl_choice_cost"], "the KL alone chose a cheaper point: the guard moved it"
    assert all(m["misses"] == 0 for m in guard["measured"] if m["cost_fraction"] >= guard["cost"])
    chosen = rec["calibration"]
    assert chosen["cost_fraction"] == guard["cost"] and chosen["mean_density"] >= 0.6
    assert chosen["achieved"] is not None and chosen["achieved"] <= target


@pytest.mark.parametrize("guard, says", [
    ({"prompts": 4, "dense_correct": 3, "held": True, "kl_choice_cost": 0.31, "cost": 0.52}, "held by moving from 31.0% to 52.0% of dense cost"),
    ({"prompts": 4, "dense_correct": 3, "held": True, "kl_choice_cost": 0.31, "cost": 0.31}, "held at the KL target's own choice"),
    ({"prompts": 4, "dense_correct": 3, "held": False, "kl_choice_cost": 0.31}, "NOT held"),
    ({"prompts": 4, "dense_correct": 0, "held": None, "why": "dense answers 0 of 4 guard prompts: nothing to hold"}, "nothing to hold"),
])
def test_the_report_says_what_the_guard_did(guard, says):
    from sparsesearch_cli.calibrate import guard_line

    line = guard_line(guard)
    assert line.startswith(f"retrieval guard (4 passkey prompts, dense answers {guard['dense_correct']}): ") and says in line


def test_misses_count_only_answers_dense_gives(tmp_path, monkeypatch):
    """misses_of runs sparse only the prompts dense answers, and counts those the artifact loses (the model's
    generations stood in for by a table: dense answers prompts 0 and 2, the artifact loses prompt 2)."""
    import sparsesearch.fidelity as fid
    from sparsesearch.models import load_model

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    samples = {}
    calls = []

    def fake_generate(model, tokenizer, sample, artifact=None, *, min_tokens=1024):
        i = samples.setdefault(id(sample), len(samples))
        calls.append((i, artifact is not None))
        right = i in (0, 2) if artifact is None else i == 0
        return fid.Generation(len(sample.input_ids), torch.zeros(0, dtype=torch.long), right)

    monkeypatch.setattr(fid, "generate", fake_generate)
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=3)
    misses_of, record = retrieval_guard(cfg, model, tok, {}, [])
    assert record["dense_correct"] == 2 and misses_of is not None
    calls.clear()
    assert misses_of([]) == 1
    assert calls == [(0, True), (2, True)], "prompt 1 (dense wrong) is never run sparse"
