"""One fidelity path (sparsesearch/fidelity.py) for calibrate, evaluate and probe-layers --validate."""

from __future__ import annotations

import pytest
import torch

from sparsesearch import fidelity
from sparsesearch.fidelity import Generation, accuracy, evaluate_fidelity, greedy_agreement, mean_kl, next_token_kl
from tiny_model import make_tiny_model


def _gen(logits, new_ids, correct=None) -> Generation:
    return Generation(10, torch.log_softmax(torch.tensor(logits, dtype=torch.float32), -1), torch.tensor(new_ids), correct)


def test_next_token_kl_is_zero_against_itself_and_positive_otherwise():
    a, b = _gen([1.0, 2.0, 3.0], [1]), _gen([3.0, 2.0, 1.0], [1])
    assert next_token_kl(a, a) == 0.0
    assert next_token_kl(a, b) > 0.0
    assert mean_kl([a, a], [a, b]) == pytest.approx(next_token_kl(a, b) / 2)


def test_greedy_agreement_counts_positions_before_the_first_departure():
    ref = _gen([0.0], [5, 6, 7, 8])
    assert greedy_agreement(ref, _gen([0.0], [5, 6, 7, 8])) == 1.0
    assert greedy_agreement(ref, _gen([0.0], [5, 6, 0, 8])) == 0.5
    assert greedy_agreement(ref, _gen([0.0], [0, 6, 7, 8])) == 0.0


def test_accuracy_counts_found_answers_only():
    assert accuracy([_gen([0.0], [1], True), _gen([0.0], [1], False), _gen([0.0], [1], None), _gen([0.0], [1], True)]) == 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sparsesearch.models import load_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2), dtype="float32", device="cpu")


def test_an_all_dense_artifact_matches_the_model_exactly(tiny):
    """No sparse layer: the runtime runs transformers' own SDPA, so logits and tokens are the model's."""
    from sparsesearch.artifacts.manifest import new_manifest

    model, tok, info = tiny
    manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "hand-written"})
    result = evaluate_fidelity(model, tok, manifest, [], data="synthetic:passkey", samples=2, tokens=256, min_tokens=64)
    assert result["samples"] == 2 and result["tokens"] <= 256
    assert result["next_token_kl"] == 0.0 and result["greedy_agreement"] == 1.0
    assert result["dense_accuracy"] == result["sparse_accuracy"]
    assert result["mean_density"] is None and result["layer_output_error"] == {}


def test_validate_runs_the_reference_once(tiny, monkeypatch, tmp_path):
    from sparsesearch.probe.probe import ProbeSettings
    from sparsesearch.probe.run import ProbeConfig, validate_starts

    model, tok, info = tiny
    calls = []
    original = fidelity.generate

    def counted(model_, tok_, sample, artifact=None, **kw):
        calls.append(artifact)
        return original(model_, tok_, sample, artifact, **kw)

    monkeypatch.setattr(fidelity, "generate", counted)
    cfg = ProbeConfig(settings=ProbeSettings(samples=1, tokens=256, sink=16, window=32, last=32), eval_samples=2, validate_step=1, out=tmp_path)
    rows = validate_starts(model, tok, info, cfg, None)
    assert [r["start_layer"] for r in rows] == [None, 0, 1] and rows[0]["kl"] == 0.0
    assert calls.count(None) == 2, "the model's own attention runs once per prompt"
    assert len(calls) == 2 * 3
