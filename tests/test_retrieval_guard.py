"""The retrieval guard of --target-kl (sparsesearch/tuning.py, search/targets.hold_guard): the KL target's
choice moves up the path to the cheapest point that loses no passkey answer dense gives; a guard that the
densest sparse point still fails is a miss; a guard dense cannot answer is recorded and left out."""

from __future__ import annotations

import pytest
import torch

from sparsesearch.calibrate import CalibrateConfig
from sparsesearch.search.allocate import hold_retrieval
from sparsesearch.search.targets import DENSE, Allocation, HeadCurve, KeyCheck, hold_guard, protect_layers
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


def _checks(table: dict[int, int]):
    """check_of over rows_of's one row: misses from the table, worst 0.1 when a key is lost."""
    misses_of, calls = _misses(table)
    return (lambda rows: KeyCheck(m := misses_of(rows), 0.1 if m else 0.9)), calls


def test_hold_retrieval_records_the_move_and_the_miss():
    misses_of, _ = _checks({0: 2, 1: 1, 2: 0, 3: 0})
    alloc, record, miss = hold_retrieval(PATH, 0, (misses_of, {"dense_retrieves": 3}), _rows, [CURVE])
    assert alloc is PATH[2] and miss is None
    assert record["held"] and record["kl_choice_cost"] == 0.2 and record["cost"] == 0.6
    assert [m["cost_fraction"] for m in record["measured"]] == sorted(m["cost_fraction"] for m in record["measured"])

    failing, _ = _checks({0: 3, 1: 2, 2: 1, 3: 1})
    alloc, record, miss = hold_retrieval(PATH, 0, (failing, {"dense_retrieves": 3}), _rows, [CURVE])
    assert alloc is PATH[0] and not record["held"]
    assert miss.startswith("the retrieval guard cannot be held: the densest sparse allocation loses 1 of 3")

    alloc, record, miss = hold_retrieval(PATH, 1, (None, {"dense_retrieves": 0, "why": "nothing to hold"}), _rows, [CURVE])
    assert alloc is PATH[1] and miss is None and record["why"] == "nothing to hold"


def test_a_guard_dense_cannot_answer_is_recorded_not_applied(tmp_path):
    from sparsesearch.models import load_model

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=2)
    misses_of, record = retrieval_guard(cfg, model, tok, {}, [])
    assert misses_of is None  # a random tiny model answers no passkey
    # dense holds none of them: every prompt up to keycheck.DRAWS x 2 is read looking for 2 keys
    assert record["data"] == GUARD_DATA and record["prompts"] == 8 and record["wanted"] == 2 and record["dense_retrieves"] == 0
    assert len(record["dense_min_p"]) == 8 and all(p < 0.5 for p in record["dense_min_p"]), "a random tiny model retrieves no key"
    assert record["held"] is None and "nothing to hold" in record["why"]


def test_calibrate_moves_the_kl_choice_until_the_guard_holds(tmp_path, monkeypatch):
    """Through calibrate on the tiny model (whose dense run answers no passkey, so the real guard would hold
    nothing): a guard that loses an answer at every point below 60% mean density moves the KL target's
    choice there; the record names both points, and the moved point's KL is measured (it meets the target)."""
    import json

    import sparsesearch.calibrate as cal
    from test_calibrate import SPACE

    def fake_guard(cfg, model, tokenizer, manifest, fixed_rows, progress=None, memo=None):
        def check_of(rows):
            lost = int(sum(r["density"] for r in rows) / len(rows) < 0.6)
            return KeyCheck(lost, 0.2 if lost else 0.9)

        return check_of, {"data": GUARD_DATA, "prompts": 1, "dense_retrieves": 1}

    monkeypatch.setattr(cal, "retrieval_guard", fake_guard)
    space = tmp_path / "space.json"
    space.write_text(json.dumps(SPACE))
    target = 0.05
    res = cal.calibrate(CalibrateConfig(model=make_tiny_model(tmp_path / "tiny"), data="synthetic:passkey", search_space=str(space),
                                        max_tokens=256, out=tmp_path / "a", eval_data="", target_kl=target, min_tokens=128))
    rec = res.manifest["methods"]["mminference"]["target"]
    guard = rec["retrieval_guard"]
    assert guard["held"] and guard["cost"] > guard["kl_choice_cost"], "the KL alone chose a cheaper point: the guard moved it"
    how = guard["protect"] if guard.get("by") == "protect" else guard
    assert all(m["misses"] == 0 for m in how["measured"] if m["cost_fraction"] >= guard["cost"])
    assert "protect" in guard, "a moved choice also tries keeping layers dense"
    chosen = rec["calibration"]
    assert chosen["cost_fraction"] == guard["cost"] and chosen["mean_density"] >= 0.6
    assert chosen["achieved"] is not None and chosen["achieved"] <= target


@pytest.mark.parametrize("guard, says", [
    ({"prompts": 4, "dense_retrieves": 3, "held": True, "kl_choice_cost": 0.31, "cost": 0.52}, "held by moving from 31.0% to 52.0% of dense cost"),
    ({"prompts": 4, "dense_retrieves": 3, "held": True, "kl_choice_cost": 0.31, "cost": 0.31}, "held at the KL target's own choice"),
    ({"prompts": 4, "dense_retrieves": 3, "held": False, "kl_choice_cost": 0.31}, "NOT held"),
    ({"prompts": 4, "dense_retrieves": 0, "held": None, "why": "dense retrieves none of the 4 guard keys: nothing to hold"}, "nothing to hold"),
])
def test_the_report_says_what_the_guard_did(guard, says):
    from sparsesearch_cli.calibrate import guard_line

    line = guard_line(guard)
    assert line.startswith(f"retrieval guard (4 passkey prompts, dense retrieves {guard['dense_retrieves']}): ") and says in line


def test_the_report_reads_a_greedy_guard_record():
    """Artifacts written before Run 38 counted greedy answers (dense_correct): inspect still reads them."""
    from sparsesearch_cli.calibrate import guard_line

    line = guard_line({"prompts": 4, "dense_correct": 1, "held": True, "kl_choice_cost": 0.1, "cost": 0.6})
    assert line.startswith("retrieval guard (4 passkey prompts, dense answers 1): held by moving")


@pytest.mark.parametrize("dense, top, sparse, held, misses", [
    # per prompt, per answer token (" " then two digits): dense's teacher-forced probabilities, whether each is
    # dense's most likely token, and the artifact's probabilities
    ([[0.3, 0.98, 0.99], [0.3, 0.6, 0.2], [0.9, 0.37, 0.8]], [[0, 1, 1], [0, 1, 0], [1, 1, 1]],
     [[0.05, 0.97, 0.9], [0.3, 0.1, 0.1], [0.9, 0.18, 0.8]], [0, 2], 1),
    ([[0.3, 0.98, 0.99], [0.3, 0.6, 0.2]], [[0, 1, 1], [1, 1, 0]], [[0.01, 0.6, 0.6], [0.3, 0.0, 0.0]], [0], 0),
    ([[0.9, 0.4, 0.99]], [[1, 0, 1]], [[0.9, 0.4, 0.99]], [], None),
])
def test_the_guard_holds_keys_dense_retrieves_and_counts_those_a_point_loses(tmp_path, monkeypatch, dense, top, sparse, held, misses):
    """A key is held when every digit is dense's most likely token (a leading " " is format, not key: neither
    its rank nor its 0.05 under sparse counts) and lost when a digit falls below GUARD_KEEPS x its dense p (0.37
    -> 0.18); only held prompts run sparse. The model's forwards are stood in for by tables."""
    import sparsesearch.fidelity as fid
    import sparsesearch.keycheck as keycheck
    from sparsesearch.models import load_model

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    order, calls = {}, []

    def fake_answer_probs(model, sample, artifact=None, *, min_tokens=1024):
        i = order.setdefault(id(sample), len(order))
        calls.append((i, artifact is not None))
        probs = torch.tensor((sparse if artifact is not None else dense)[i])
        return probs, torch.tensor(top[i], dtype=torch.bool)

    monkeypatch.setattr(fid, "answer_probs", fake_answer_probs)
    monkeypatch.setattr(keycheck, "key_steps", lambda tokenizer, ids: [1, 2])
    monkeypatch.setattr(keycheck, "DRAWS", 1)  # exactly the table's prompts (reading until held: test_pareto_keys)
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=len(dense))
    misses_of, record = retrieval_guard(cfg, model, tok, {}, [])
    assert record["dense_retrieves"] == len(held) and len(record["dense_min_p"]) == len(dense)
    if misses is None:
        assert misses_of is None and record["held"] is None and "nothing to hold" in record["why"]
        return
    calls.clear()
    reading = misses_of([])
    assert reading.misses == misses and 0.0 <= reading.worst
    assert calls == [(i, True) for i in held], "prompts dense does not retrieve are never run sparse"


def test_key_steps_leave_out_the_answers_whitespace(tmp_path):
    from sparsesearch.models import load_model
    from sparsesearch.keycheck import key_steps

    _, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    ids = tok.encode(" ", add_special_tokens=False) + tok.encode("17", add_special_tokens=False)
    assert key_steps(tok, torch.tensor(ids)) == list(range(len(ids)))[1:]


def test_answer_probs_are_the_teacher_forced_probabilities_of_the_answer(tmp_path):
    """answer_probs equals the full forward's softmax at the positions before each answer token."""
    from sparsesearch.data import load_calibration
    from sparsesearch.fidelity import answer_probs, sequence_ids
    from sparsesearch.models import load_model

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    sample = load_calibration("synthetic:passkey", tok, max_tokens=256, samples=1, seed=0)[0]
    got, top = answer_probs(model, sample)
    ids = sequence_ids(sample)
    a = sample.answer_ids.numel()
    with torch.no_grad():
        probs = model(ids[None]).logits[0].float().softmax(-1)[ids.numel() - a - 1 : -1]
    want = probs.gather(-1, sample.answer_ids[:, None])[:, 0]
    assert got.shape == (a,) and torch.allclose(got, want, atol=1e-5)
    assert torch.equal(top, probs.argmax(-1) == sample.answer_ids)


def _layers_curves(n: int) -> list[HeadCurve]:
    """n layers of one head, each with one candidate at 0.2 of its dense cost."""
    return [HeadCurve(layer=l, head=0, cost=(0.2,), error=(0.1,), dense_cost=1.0) for l in range(n)]


@pytest.mark.parametrize("lose, expected", [
    # a key is lost when layer 1 is sparse, or layers 0 and 2 are both sparse: 1 first (it loses a key alone),
    # then 2 (its digits fall further alone than 0's)
    (lambda sparse: int(1 in sparse) + int({0, 2} <= sparse), [1, 2]),
    (lambda sparse: 0, []),  # nothing lost: nothing kept dense
    (lambda sparse: int(len(sparse) > 0), None),  # every sparse layer loses the key: only all-dense holds
])
def test_protect_layers_keeps_the_fewest_layers_that_hold_the_keys(lose, expected):
    curves = _layers_curves(4)
    start = Allocation([0, 0, 0, DENSE])
    worst_alone = {0: 0.8, 1: 0.1, 2: 0.6}

    def check(a):
        sparse = {c.layer for c, i in zip(curves, a.choices) if i != DENSE}
        m = lose(sparse)
        return KeyCheck(m, min([worst_alone[l] for l in sparse] + [1.0]) if len(sparse) == 1 else (0.1 if m else 0.9))

    layers, alone = protect_layers(curves, start, check)
    assert layers == expected
    assert sorted(alone) == [0, 1, 2], "every sparse layer is read alone; an all-dense layer is not"


def test_protect_retrieval_holds_where_moving_up_the_path_cannot():
    """Four layers; a key is lost whenever layer 2 is sparse, the layer the KL model ranks cheapest to make
    sparse, so every sparse point of its path keeps layer 2 sparse and the guard's path move cannot hold.
    Protecting keeps layer 2 dense and meets the KL target over the other three."""
    from sparsesearch.search.allocate import protect_retrieval
    from sparsesearch.search.frontier import frontier_kl_path
    from sparsesearch.search.targets import search_target

    curves = [HeadCurve(layer=l, head=0, cost=(0.1, 0.3), error=(0.3, 0.1), dense_cost=1.0) for l in range(4)]
    sensitivity = {0: 1.0, 1: 1.0, 2: 0.01, 3: 1.0}  # layer 2 looks harmless to the KL model: it goes sparse first
    kl = lambda a: sum(sensitivity[c.layer] * c.error_of(i) ** 2 for c, i in zip(curves, a.choices))
    check = lambda a: KeyCheck(int(a.choices[2] != DENSE), 0.1 if a.choices[2] != DENSE else 1.0)
    path, predicted = frontier_kl_path(curves, sensitivity)
    target = 0.05
    start = search_target(path, kl, target, [a.cost_fraction(curves) for a in path], 0.0, predicted).chosen
    moved, _ = hold_guard(path, start, lambda a: check(a).misses)
    prot = protect_retrieval(curves, sensitivity, path[start], check, kl, target)
    assert prot.record["layers"] == [2] and prot.chosen is not None
    held = prot.path[prot.chosen]
    assert held.choices[2] == DENSE and "kept dense for retrieval" in held.reasons[(2, 0)]
    assert check(held).misses == 0 and kl(held) <= target
    assert moved is None, "layer 2 is the path's last to go dense: no sparse point of the path holds"
    assert prot.record["cost"] == round(held.cost_fraction(curves), 6) and prot.measured, "its KL was measured"


def test_a_sweeps_memo_runs_the_guards_dense_side_and_each_reading_once(tmp_path, monkeypatch):
    """Targets of one sweep share a TuningMemo: the second guard runs no dense forward, and a reading of rows
    already read (the path move and the layer protection meet the same points) runs no sparse forward."""
    import sparsesearch.fidelity as fid
    from sparsesearch.models import load_model
    from sparsesearch.tuning import TuningMemo

    model, tok, _ = load_model(make_tiny_model(tmp_path / "tiny"), dtype="float32", device="cpu")
    calls = []

    def fake_answer_probs(model, sample, artifact=None, *, min_tokens=1024):
        calls.append(artifact is not None)
        return torch.full((sample.answer_ids.numel(),), 0.9), torch.ones(sample.answer_ids.numel(), dtype=torch.bool)

    monkeypatch.setattr(fid, "answer_probs", fake_answer_probs)
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=2)
    memo = TuningMemo()
    first, record = retrieval_guard(cfg, model, tok, {}, [], memo=memo)
    assert calls == [False, False] and record["dense_retrieves"] == 2
    rows = [{"layer": 0, "density": 0.5}]
    assert first(rows) == KeyCheck(0, pytest.approx(1.0)) and calls[2:] == [True, True]
    calls.clear()
    second, again = retrieval_guard(cfg, model, tok, {}, [], memo=memo)
    assert again == record and second(rows) == first(rows) and calls == [], "nothing runs twice"


def test_guard_prompt_j_is_the_jth_calibration_prompt(tmp_path):
    """Read one at a time, the guard's prompts are the stream's own (seed cfg.seed + j), so a model that holds
    the first N keys reads exactly the N prompts a fixed count read before."""
    from transformers import AutoTokenizer

    from sparsesearch.data import load_calibration
    from sparsesearch.tuning import guard_prompt

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "tiny"))
    cfg = CalibrateConfig(model="tiny", data="synthetic:passkey", max_tokens=256, retrieval_guard=3, seed=5)
    batch = load_calibration(GUARD_DATA, tok, max_tokens=256, samples=3, seed=5)
    assert [guard_prompt(cfg, tok, j).answer for j in range(3)] == [s.answer for s in batch]
    assert [guard_prompt(cfg, tok, j).input_ids.tolist() for j in range(3)] == [s.input_ids.tolist() for s in batch]
