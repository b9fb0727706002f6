"""Heads that change their mind across calibration samples (P11 §4): found, recorded, given the safer pick."""

from __future__ import annotations

import json

import torch

from sparsesearch.patterns.ashape import AShapeParams
from sparsesearch.patterns.block_topk import BlockTopKParams
from sparsesearch.patterns.vertical_slash import VerticalSlashParams
from sparsesearch.search.layer import Scored, head_rows, mean_scored
from sparsesearch.search.space import Candidate
from sparsesearch.search.stability import head_stability, record, safer_rows, worst_scored

CANDIDATES = [(Candidate("ashape", {"sink": 64, "local": 512}), AShapeParams(64, 512)),
              (Candidate("vertical_slash", {"vertical_size": 64, "slash_size": 256}), VerticalSlashParams(64, 256)),
              (Candidate("block_topk", {"k_blocks": 4}), BlockTopKParams(4, 1))]


def _sample(errors: list[list[float]]) -> list[Scored]:
    """One sample's scores: errors[c][h] per candidate c and head h, equal costs, all within budget."""
    heads = len(errors[0])
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return [Scored(cand, [params] * heads, t(err), t([1 - e for e in err]), t([0.3] * heads), t([1.0] * heads))
            for (cand, params), err in zip(CANDIDATES, errors)]


# Head 0 flips: A-shape is exact on sample A and poor on B, vertical-slash the other way round; block top-k is
# mediocre on both. The mean picks vertical-slash (0.105 < 0.12); its worst case (0.2) is worse than block
# top-k's (0.12), the safer choice. Head 1 is A-shape on both: stable.
A = _sample([[0.01, 0.05], [0.20, 0.30], [0.12, 0.40]])
B = _sample([[0.30, 0.06], [0.01, 0.30], [0.12, 0.40]])
BUDGET = torch.tensor([2.0, 2.0], dtype=torch.float64)


def test_a_head_that_flips_is_found_and_takes_the_lowest_worst_case():
    chosen = head_rows(mean_scored([A, B]), BUDGET, "output_error")
    assert [r["pattern"] for r in chosen] == ["vertical_slash", "ashape"]
    stab = head_stability([A, B], [BUDGET, BUDGET], "output_error", chosen)
    assert [s["stable"] for s in stab] == [False, True]
    assert stab[0]["picks"] == ["ashape", "vertical_slash"] and stab[0]["errors"] == [0.2, 0.01] and stab[0]["spread"] == 0.19
    rows = safer_rows(chosen, [A, B], BUDGET, "output_error", stab)
    assert rows[0]["pattern"] == "block_topk" and rows[0]["output_error"] == 0.12 and "unstable across samples" in rows[0]["reason"]
    assert rows[1] == chosen[1]


def test_worst_case_scores_take_max_error_and_min_recall():
    worst = worst_scored([A, B])
    assert worst[0].error.tolist() == [0.30, 0.06] and worst[0].recall.tolist() == [0.70, 0.94]


def test_the_record_lists_unstable_heads_and_is_plain_json():
    chosen = head_rows(mean_scored([A, B]), BUDGET, "output_error")
    stab = head_stability([A, B], [BUDGET, BUDGET], "output_error", chosen)
    rec = record({3: stab}, samples=2)
    assert rec["heads"] == 2 and rec["unstable_count"] == 1 and rec["unstable"][0]["layer"] == 3
    json.loads(json.dumps(rec, allow_nan=False))


def test_a_pruned_candidate_in_one_sample_records_null_not_infinity():
    pruned = _sample([[0.01, 0.05], [float("inf"), 0.30], [0.12, 0.40]])
    chosen = head_rows(mean_scored([A, B]), BUDGET, "output_error")
    stab = head_stability([pruned, B], [BUDGET, BUDGET], "output_error", chosen)
    assert stab[0]["errors"][0] is None
    json.dumps(record({0: stab}, samples=2), allow_nan=False)


def test_calibrate_with_two_samples_records_stability(tmp_path):
    from sparsesearch.calibrate import CalibrateConfig, calibrate
    from tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    cfg = CalibrateConfig(model=model, data="synthetic:passkey", max_tokens=256, samples=2, out=tmp_path / "a",
                          eval_samples=0, min_tokens=128, created="2026-01-01T00:00:00Z", device="cpu")
    result = calibrate(cfg)
    stab = result.manifest["methods"]["mminference"]["stability"]
    assert stab["samples"] == 2 and stab["heads"] == 3  # 3 layers x 1 KV head
    unstable = {(s["layer"], s["head"]) for s in stab["unstable"]}
    for row in result.rows:
        if (row["layer"], row["head"]) in unstable and row["reason"]:
            assert "unstable across samples" in row["reason"]


def test_inspect_shows_unstable_heads(tmp_path):
    from typer.testing import CliRunner

    from artifact_fixtures import edit_manifest, make_artifact, mix_rows
    from cli.app import app
    from sparsesearch.artifacts.io import read_manifest

    chosen = head_rows(mean_scored([A, B]), BUDGET, "output_error")
    rec = record({1: head_stability([A, B], [BUDGET, BUDGET], "output_error", chosen)}, samples=2)
    path = make_artifact(tmp_path / "a", mix_rows())
    mm = read_manifest(path)["methods"]["mminference"] or {"table": "heads.parquet"}
    edit_manifest(path, methods={**read_manifest(path)["methods"], "mminference": {**mm, "stability": rec}})
    out = CliRunner().invoke(app, ["inspect", str(path)]).output
    assert "1 of 2 heads unstable" in out and "ashape / vertical_slash" in out
