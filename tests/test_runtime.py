"""Runtime through transformers' AttentionInterface on a tiny random Llama (CPU, torch backend)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsesearch.artifacts.columns import ALL_MODALITIES, row_from_params
from sparsesearch.patterns import PARAMS
from conftest import smollm2_gguf
from sparsesearch.runtime import ATTN_NAME, apply, build_plan, model_info, remove

N = 200


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def artifact(rows: list[tuple[int, int, str, dict]], space: str = "kv", methods: dict | None = None):
    records = []
    for layer, head, pattern, params in rows:
        rec = {"layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES, "boundary": "none",
               "pattern": pattern, "block_m": 32, "block_n": 32}
        rec.update(row_from_params(PARAMS[pattern](**params)))
        records.append(rec)
    return SimpleNamespace(manifest={"head_index_space": space, "methods": methods or {}}, heads=pd.DataFrame(records))


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def ids(batch=1, n=N, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_dense_artifact_reproduces_stock_logits_exactly(model):
    x = ids()
    stock = logits(model, x)
    plan = apply(model, artifact([(l, h, "dense", {}) for l in range(3) for h in range(2)]), min_tokens=16)
    try:
        assert model.config._attn_implementation == ATTN_NAME
        assert plan.summary() == {"dense": 3}
        assert torch.equal(logits(model, x), stock)
    finally:
        remove(model)
    assert model.config._attn_implementation == "sdpa"


def test_covering_patterns_match_dense(model):
    """A-shape with a window past N and VS with every line admit every causal key: same logits as dense."""
    x = ids()
    stock = logits(model, x)
    rows = [(0, 0, "ashape", {"sink": 4, "local": 4 * N}), (0, 1, "vertical_slash", {"vertical_size": N, "slash_size": N, "last_q": 16}),
            (1, 0, "block_topk", {"k_blocks": 64, "sink_blocks": 1}), (2, 1, "ashape", {"sink": 0, "local": 4 * N})]
    plan = apply(model, artifact(rows), min_tokens=16)
    try:
        assert plan.summary() == {"sparse": 3}
        got = logits(model, x)
    finally:
        remove(model)
    torch.testing.assert_close(got, stock, atol=2e-4, rtol=1e-4)


def test_sparse_artifact_changes_logits_and_generates(model):
    x = ids()
    stock = logits(model, x)
    rows = [(l, h, "ashape", {"sink": 4, "local": 32}) for l in range(3) for h in range(2)]
    apply(model, artifact(rows), min_tokens=16)
    try:
        sparse = logits(model, x)
        out = model.generate(x, max_new_tokens=5, do_sample=False)
    finally:
        remove(model)
    assert not torch.allclose(sparse, stock, atol=1e-3)
    assert out.shape == (1, N + 5)


def test_query_space_and_triangle_layers(model):
    x = ids()
    stock = logits(model, x)
    rows = [(0, h, "ashape", {"sink": 0, "local": 4 * N}) for h in range(4)]
    tri = {"trianglemix": {"start_layer": 1, "sink": 4 * N, "window": 4 * N, "last": 16}}
    plan = apply(model, artifact(rows, space="query", methods=tri), min_tokens=16)
    try:
        assert plan.summary() == {"sparse": 1, "triangle": 2}
        got = logits(model, x)
    finally:
        remove(model)
    torch.testing.assert_close(got, stock, atol=2e-4, rtol=1e-4)


def test_left_padded_batch_matches_single_sequences(model):
    rows = [(l, h, "ashape", {"sink": 4, "local": 40}) for l in range(3) for h in range(2)]
    a, b = ids(n=N, seed=2), ids(n=N - 37, seed=3)
    batch = torch.zeros(2, N, dtype=torch.long)
    mask = torch.zeros(2, N, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 37:], mask[1, 37:] = b[0], 1
    apply(model, artifact(rows), min_tokens=16)
    try:
        together = logits(model, batch, mask)
        alone_a, alone_b = logits(model, a), logits(model, b)
    finally:
        remove(model)
    torch.testing.assert_close(together[0], alone_a[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(together[1, 37:], alone_b[0], atol=2e-4, rtol=1e-4)


def test_short_prompts_and_decoding_stay_dense(model):
    x = ids(n=20)
    stock = logits(model, x)
    apply(model, artifact([(0, 0, "ashape", {"sink": 1, "local": 2})]), min_tokens=64)
    try:
        assert torch.equal(logits(model, x), stock)
    finally:
        remove(model)


def test_plan_rejects_rows_outside_the_model(model):
    info = model_info(model)
    bad = artifact([(5, 0, "ashape", {"sink": 1, "local": 8})])
    with pytest.raises(ValueError, match="outside the model"):
        build_plan(bad.manifest, bad.heads, info)
    with pytest.raises(ValueError, match="min_tokens"):
        build_plan(bad.manifest, bad.heads, info, min_tokens=0)


# ------------------------------------------------------------------ the real model (SmolLM2-135M, GGUF)
@pytest.fixture(scope="module")
def smollm2():
    from sparsesearch.models import load_model

    smollm2_gguf()
    model, tok, info = load_model("smollm2-135m", dtype="float32", device="cpu")
    return model.eval(), tok, info


def test_smollm2_dense_artifact_is_stock_and_sparse_generates(smollm2, tmp_path):
    from sparsesearch.artifacts import load_artifact, write_artifact
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.export import export_minference, import_minference

    model, tok, info = smollm2
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? " + "Answer briefly. " * 60}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = chat["input_ids"]
    stock = logits(model, ids)
    dense_rows = [(l, h, "dense", {}) for l in range(info.num_layers) for h in range(info.num_kv_heads)]
    vs_rows = [(l, h, "vertical_slash" if h else "ashape",
                {"vertical_size": 64, "slash_size": 128, "last_q": 64} if h else {"sink": 16, "local": 128})
               for l in range(info.num_layers) for h in range(info.num_kv_heads)]
    paths = {}
    for name, rows in (("dense", dense_rows), ("sparse", vs_rows)):
        table = artifact(rows).heads.to_dict("records")
        for r in table:
            r["block_m"] = r["block_n"] = 64
        manifest = new_manifest(info, head_index_space="kv", provenance={"kind": "manual"}, methods={"mminference": {"table": "heads.parquet"}},
                                created="2026-01-01T00:00:00Z")
        paths[name] = write_artifact(tmp_path / name, manifest, {"heads.parquet": table})
    dense_art = load_artifact(paths["dense"], model_info=info)
    apply(model, dense_art, min_tokens=64)
    try:
        assert torch.equal(logits(model, ids), stock), "an all-dense artifact must not change a single logit"
    finally:
        remove(model)
    sparse_art = load_artifact(paths["sparse"], model_info=info)
    apply(model, sparse_art, min_tokens=64)
    try:
        changed = logits(model, ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    finally:
        remove(model)
    assert not torch.equal(changed, stock)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # export -> import keeps every field the MInference format carries
    back_manifest, back_tables = import_minference(export_minference(sparse_art), info)
    back = {(r["layer"], r["head"]): r for r in back_tables["heads.parquet"]} if isinstance(back_tables["heads.parquet"], list) else None
    if back is None:
        back = {(int(r["layer"]), int(r["head"])): r for r in back_tables["heads.parquet"].to_dict("records")}
    assert len(back) == info.num_layers * info.num_heads  # MInference is per query head
    first = back[(3, 4)]  # query head 4 belongs to KV head 1 (group of 3): vertical_slash(64, 128)
    assert first["pattern"] == "vertical_slash" and int(first["vertical_size"]) == 64 and int(first["slash_size"]) == 128


def test_last_row_only_keeps_the_next_token(model):
    """Paper 002 §2.4: the last layer computes only the final row; the final position's logits are unchanged."""
    x = ids()
    stock = logits(model, x)
    apply(model, artifact([(0, 0, "dense", {})]), min_tokens=16, last_row_only=True)
    try:
        got = logits(model, x)
        out = model.generate(x, max_new_tokens=4, do_sample=False)
    finally:
        remove(model)
    torch.testing.assert_close(got[:, -1], stock[:, -1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[:, :-1], stock[:, :-1]), "earlier rows of the last layer were skipped"
    assert out.shape == (1, N + 4)


def test_a_repeat_prefill_makes_no_tensors_from_host_lists(model, monkeypatch):
    """Head ids are made once per group: a tensor built from a host list per launch is, on CUDA, a copy that waits
    for the stream to drain, so the host could not run ahead of the GPU (139 waits per 8B-stack prefill before;
    benchmarks/prefill_syncs.py). A second prefill through the runtime builds none in sparsesearch code."""
    import traceback

    rows = [(0, 0, "ashape", {"sink": 4, "local": 32}), (0, 1, "vertical_slash", {"vertical_size": 16, "slash_size": 16, "last_q": 16}),
            (1, 0, "block_topk", {"k_blocks": 3, "sink_blocks": 1}), (1, 1, "dense", {}), (2, 0, "ashape", {"sink": 0, "local": 64})]
    x = ids()
    apply(model, artifact(rows), min_tokens=16)
    try:
        logits(model, x)  # warm: the per-group ids are made here
        made, real = [], torch.tensor

        def watched(*args, **kwargs):
            where = [f"{f.filename.rsplit('/sparsesearch/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-1] if "/sparsesearch/" in f.filename]
            if where:
                made.append(where[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", watched)
        logits(model, x)
    finally:
        remove(model)
    assert made == []
