"""One fidelity path (sparsesearch/fidelity.py) for calibrate, evaluate and probe-layers --validate."""

from __future__ import annotations

import pytest
import torch

from sparsesearch import fidelity
from sparsesearch.fidelity import Generation, accuracy, evaluate_fidelity, greedy_agreement
from tiny_model import make_tiny_model


def _gen(new_ids, correct=None) -> Generation:
    return Generation(10, torch.tensor(new_ids), correct)


def test_greedy_agreement_counts_positions_before_the_first_departure():
    ref = _gen([5, 6, 7, 8])
    assert greedy_agreement(ref, _gen([5, 6, 7, 8])) == 1.0
    assert greedy_agreement(ref, _gen([5, 6, 0, 8])) == 0.5
    assert greedy_agreement(ref, _gen([0, 6, 7, 8])) == 0.0


def test_accuracy_counts_found_answers_only():
    assert accuracy([_gen([1], True), _gen([1], False), _gen([1], None), _gen([1], True)]) == 0.5


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
    cfg = ProbeConfig(settings=ProbeSettings(samples=1, tokens=256, sink=16, window=32, last=32), eval_data="synthetic:passkey",
                      eval_samples=2, validate_step=1, out=tmp_path)
    rows = validate_starts(model, tok, info, cfg, None)
    assert [r["start_layer"] for r in rows] == [None, 0, 1] and rows[0]["kl"] == 0.0
    assert calls.count(None) == 2, "the model's own attention runs once per prompt"
    assert len(calls) == 2 * 3


def test_validate_on_the_default_natural_text_holds_teacher_forced_kl(tiny, tmp_path):
    """probe-layers' default --eval-data is text:shakespeare (like calibrate): no retrieval, so no accuracy
    and no verdict; the KL the tolerance bounds is the teacher-forced mean over every position."""
    from sparsesearch.probe.probe import ProbeSettings
    from sparsesearch.probe.run import ProbeConfig, smallest_within, validate_starts

    model, tok, info = tiny
    # 1024 tokens: the inference triangle (sink 8, window 512, last 128) skips keys only past 512+128 rows.
    cfg = ProbeConfig(settings=ProbeSettings(samples=1, tokens=1024, sink=16, window=32, last=32), eval_samples=1, validate_step=1, out=tmp_path)
    assert cfg.eval_data == "text:shakespeare"
    rows = validate_starts(model, tok, info, cfg, None)
    assert [r["start_layer"] for r in rows] == [None, 0, 1] and all(r["accuracy"] is None for r in rows)
    assert all(r["kl"] == r["kl_mean"] and r["verdict"] is None for r in rows[1:])
    assert rows[1]["kl"] > rows[2]["kl"] > 0  # triangle from layer 0 changes more than from layer 1
    assert smallest_within(rows, rows[2]["kl"]) == 1 and smallest_within(rows, rows[1]["kl"]) == 0
    assert smallest_within(rows, rows[2]["kl"] / 2) is None


# --------------------------------------------------------------------------------------------- teacher forcing


def _ashape_artifact(info, sink: int = 16, local: int = 32):
    """A-shape (sink + local, 64-blocks) in every KV head of every layer: sparse enough at 300 tokens to differ."""
    from types import SimpleNamespace

    import pandas as pd

    from sparsesearch.artifacts.columns import ALL_MODALITIES, row_from_params
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.patterns.ashape import AShapeParams

    rows = [{"layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES, "boundary": "none",
             "pattern": "ashape", **row_from_params(AShapeParams(sink=sink, local=local)), "block_m": 64, "block_n": 64,
             "density": None, "recall": None, "output_error": None, "latency_ms": None, "score": None}
            for layer in range(info.num_layers) for head in range(info.num_kv_heads)]
    return SimpleNamespace(manifest=new_manifest(info, head_index_space="kv", provenance={"kind": "manual"}), heads=pd.DataFrame(rows)), rows


def test_chunked_position_scores_match_full_logits(tiny, monkeypatch):
    """Oracle: KL and NLL from the model's own [N, vocab] logits; the chunked lm head (several chunks, the
    last one partial) and the hidden states taken at the head must give the same numbers."""
    from sparsesearch.data import held_out

    model, tok, info = tiny
    sample = held_out("synthetic:passkey", tok, max_tokens=300, seed=1)
    artifact, _ = _ashape_artifact(info)
    monkeypatch.setattr(fidelity, "LOGIT_CHUNK_ELEMENTS", 70 * model.config.vocab_size)  # 70 positions per chunk
    dense, _ = fidelity.final_hidden(model, sample)
    sparse, audit = fidelity.final_hidden(model, sample, artifact, min_tokens=64, audit=True)
    ids = fidelity.sequence_ids(sample)
    kl, nll_dense, nll_sparse = fidelity.position_scores(model, ids, dense, sparse)

    from sparsesearch.runtime import apply, remove

    with torch.no_grad():
        p = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        apply(model, artifact, min_tokens=64)
        try:
            q = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        finally:
            remove(model)
    assert kl.shape == (ids.numel(),) and nll_dense.shape == (ids.numel() - 1,)
    torch.testing.assert_close(kl, (p.exp() * (p - q)).sum(-1).clamp_min(0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(nll_dense, torch.nn.functional.cross_entropy(p[:-1], ids[1:], reduction="none"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nll_sparse, torch.nn.functional.cross_entropy(q[:-1], ids[1:], reduction="none"), atol=1e-5, rtol=1e-5)
    assert float(kl[:48].max()) < 1e-5 < float(kl[64:].mean())  # rows inside sink + local see every key
    assert sorted(audit) == list(range(info.num_layers))


def test_teacher_forced_report_on_natural_text(tiny, tmp_path):
    """A sparse artifact on a held-out .txt half: KL > 0 everywhere it can be, the tail counted from
    min_tokens, perplexities that differ, no retrieval block (no answers), and 'can fail' holds."""
    from sparsesearch.data.natural import text_part

    model, tok, info = tiny
    path = tmp_path / "story.txt"
    path.write_text("".join(f"Line {i}: the river runs past the mill and the miller counts sacks of grain.\n" for i in range(200)))
    _, rows = _ashape_artifact(info)
    from sparsesearch.artifacts.manifest import new_manifest

    manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "manual"})
    result = evaluate_fidelity(model, tok, manifest, rows, data=str(path), samples=2, tokens=300, min_tokens=128)
    tf = result["teacher_forced"]
    assert result["tokens"] == 300 and tf["tokens"] == 600 and tf["tail_from"] == 128 and tf["tail_tokens"] == 2 * (300 - 128)
    assert tf["sparse_ran"] and tf["kl_mean"] > 0 and tf["kl_tail_mean"] > tf["kl_mean"]
    assert tf["ppl_dense"] != tf["ppl_sparse"] and tf["ppl_dense"] > 1
    assert result["retrieval"] is None and result["dense_accuracy"] is None and result["greedy_agreement"] is None
    assert result["next_token_kl"] == tf["next_token_kl"]
    assert text_part(str(path), held_out=True).documents[0][1].startswith("Line 100:")
    lines = fidelity.describe(result)
    assert "teacher-forced over 600 positions" in lines[1] and "positions >= 128" in lines[1]


def _gens(correct: list[bool]) -> list[Generation]:
    return [_gen([1], c) for c in correct]


def test_retrieval_verdict_needs_a_reference_that_retrieves():
    none = fidelity.retrieval(_gens([False] * 5), _gens([False] * 5))
    assert none["verdict"] == "uninformative: dense retrieves 0/5" and (none["dense_correct"], none["sparse_correct"]) == (0, 0)
    few = fidelity.retrieval(_gens([True, True, False, False, False]), _gens([True] * 5))
    assert few["verdict"] == "uninformative: dense retrieves 2/5"  # below half
    one = fidelity.retrieval(_gens([True]), _gens([False]))
    assert one["verdict"] == "uninformative: dense retrieves 1/1"  # fewer than RETRIEVAL_MIN_CORRECT
    ok = fidelity.retrieval(_gens([True, True, True, False]), _gens([True, False, False, False]), [0.125, 0.375, 0.625, 0.875])
    assert ok["verdict"] == "informative" and (ok["dense_correct"], ok["sparse_correct"], ok["n"]) == (3, 1, 4)
    assert fidelity.retrieval([], []) is None
    line = fidelity.describe({"eval_data": "synthetic:passkey", "samples": 5, "tokens": 4096, "next_token_kl": 0.01,
                              "greedy_agreement": 1.0, "mean_density": 0.2, "retrieval": none})[-1]
    assert line == "retrieval: uninformative: dense retrieves 0/5 (sparse 0/5)" and "%" not in line


def test_retrieval_depths_are_spread(tiny):
    model, tok, info = tiny
    prompts, depths = fidelity.held_out_samples("synthetic:passkey", tok, samples=4, tokens=300)
    assert depths == [0.125, 0.375, 0.625, 0.875]
    assert [p.meta["depth"] for p in prompts] == depths
    needles = [p.meta["needle_token_index"] for p in prompts]
    assert needles == sorted(needles) and len(set(needles)) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(samples=0, tokens=4096, min_tokens=1024), "--samples must be >= 1, got 0"),
    (dict(samples=2, tokens=4096, min_tokens=0), "--min-tokens must be >= 1, got 0"),
    (dict(samples=2, tokens=2048, min_tokens=4096), "--min-tokens 4096 > --tokens 2048: every prompt would run dense"),
])
def test_check_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fidelity.check_options(**kwargs)
    fidelity.check_options(samples=1, tokens=4096, min_tokens=4096)


def test_teacher_forced_sequence_appends_the_answer_as_text():
    from sparsesearch.data import IMAGE, TEXT, Sample

    s = Sample(torch.arange(5), torch.tensor([TEXT, IMAGE, IMAGE, TEXT, TEXT]), answer="x", answer_ids=torch.tensor([7, 8]))
    assert fidelity.sequence_ids(s).tolist() == [0, 1, 2, 3, 4, 7, 8]
    assert fidelity.sequence_modality(s).tolist() == [TEXT, IMAGE, IMAGE, TEXT, TEXT, TEXT, TEXT]
    plain = Sample(torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert fidelity.sequence_ids(plain) is plain.input_ids and fidelity.sequence_modality(plain) is plain.modality


def test_manifest_schema_takes_the_new_fidelity_block_and_old_ones():
    import copy
    import json
    from pathlib import Path

    from sparsesearch.artifacts.schema import ArtifactError, validate

    old = json.loads((Path(__file__).parents[1] / "artifacts/reference/smollm2-135m-4k/manifest.json").read_text())
    validate(old)  # written before teacher forcing: no teacher_forced / retrieval fields
    new = copy.deepcopy(old)
    block = new["methods"]["mminference"]["fidelity"]
    block["teacher_forced"] = {"positions": "every", "tokens": 8, "kl_mean": 0.1, "ppl_dense": 3.0, "ppl_sparse": 3.5, "tail_from": 4,
                               "tail_tokens": 4, "kl_tail_mean": 0.2, "ppl_dense_tail": 3.0, "ppl_sparse_tail": 4.0,
                               "sparse_ran": True, "next_token_kl": 0.3}
    block["retrieval"] = fidelity.retrieval(_gens([False] * 4), _gens([False] * 4), [0.125, 0.375, 0.625, 0.875])
    validate(new)
    block["retrieval"]["verdict"] = "0% vs 0%"
    with pytest.raises(ArtifactError, match="retrieval.verdict does not match"):
        validate(new)
