"""Exporters: MInference JSON (both ways, lossless), DuoAttention TSV, plain JSON, FlexAttention BlockMask.

The FlexAttention mask is checked against the kernels' semantics: each head's own index through
``reference.index_mask_fn`` (plus the triangle's dense last rows), at token level on CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from artifact_fixtures import TINY, manifest, mix_rows, row
from conftest import DEVICE
from sparsesearch import reference as ref
from sparsesearch.artifacts import load_artifact, write_artifact
from sparsesearch.artifacts.columns import params_from_row
from sparsesearch.export import (
    block_mask_from_tensors, duo_tsv, export_duo, export_json, export_minference, flex_block_mask, flex_tensors,
    import_minference, load_flex, minference_json, write_flex, write_minference,
)
from sparsesearch.export._common import write_file_atomic
from sparsesearch.export.minference import DENSE_SIZE
from sparsesearch.index import num_blocks
from sparsesearch.patterns import REGISTRY


def load(tmp_path, rows=None, *, space="query", name="art", methods=None):
    m = manifest(space=space)
    m["methods"].update(methods or {})
    return load_artifact(write_artifact(tmp_path / name, m, {"heads.parquet": rows if rows is not None else mix_rows()}))


COMPARED = ("layer", "head", "q_modality", "k_modality", "boundary", "pattern", "score",
            "vertical_size", "slash_size", "last_q", "force_vertical", "force_slash", "sink", "local", "k_blocks", "sink_blocks")


def fields(rows):
    return [{k: r[k] for k in COMPARED} for r in rows]


# ------------------------------------------------------------------------------------------ minference


def test_minference_export_maps_every_representable_pattern(tmp_path):
    config = export_minference(load(tmp_path))
    assert len(config) == 2 and all(list(layer) == ["0", "1", "2", "3"] for layer in config)
    assert config[0]["0"] == ["vertical_and_slash", 1000, 6096, 0.5]
    assert config[0]["1"] == ["stream_llm", 128, 1024, 0.51]
    assert config[0]["2"] == ["block_sparse", 16, 1, 0.52]
    assert config[0]["3"] == ["vertical_and_slash", DENSE_SIZE, DENSE_SIZE, 0.53]
    assert config[1]["0"][0] == "stream_llm"
    assert json.loads(minference_json(config)) == config


def test_minference_round_trip_is_lossless(tmp_path):
    art = load(tmp_path)
    path = write_minference(art, tmp_path / "cfg.json")
    manifest_, tables = import_minference(path, TINY, created="2025-01-01T00:00:00Z")
    back = load_artifact(write_artifact(tmp_path / "back", manifest_, tables), model_info=TINY)
    assert fields(back.head_rows()) == fields(art.head_rows())
    assert export_minference(back) == export_minference(art)
    assert back.manifest["provenance"]["kind"] == "imported"
    assert back.manifest["provenance"]["source"] == "cfg.json"
    assert back.manifest["methods"]["mminference"]["fallback_heads"] == []
    assert back.manifest["calibration"] is None and back.manifest["device"]["gpu"] is None


def test_minference_import_of_a_peer_file_with_missing_heads(tmp_path):
    peer = [
        {"0": ["vertical_and_slash", 3500, 100, 0.675], "1": ["stream_llm", 100, 800, 0.9], "3": ["block_sparse", 8, 1, 0.1]},
        {"2": ["vertical_and_slash", 30, 800, 1]},
    ]
    file = tmp_path / "peer.json"
    file.write_text(json.dumps(peer))
    manifest_, tables = import_minference(file, TINY)
    rows = {(r["layer"], r["head"]): r for r in tables["heads.parquet"].to_dict("records")}
    assert rows[(0, 0)]["pattern"] == "vertical_slash" and rows[(0, 0)]["vertical_size"] == 3500
    assert rows[(0, 1)]["pattern"] == "ashape" and (rows[(0, 1)]["sink"], rows[(0, 1)]["local"]) == (100, 800)
    assert rows[(0, 3)]["pattern"] == "block_topk"
    fallback = manifest_["methods"]["mminference"]["fallback_heads"]
    assert fallback == [[0, 2], [1, 0], [1, 1], [1, 3]]
    assert (rows[(1, 0)]["vertical_size"], rows[(1, 0)]["slash_size"]) == (1000, 6096)
    art = load_artifact(write_artifact(tmp_path / "art", manifest_, tables), model_info=TINY)
    assert export_minference(art)[1]["0"] == ["vertical_and_slash", 1000, 6096, None]
    assert manifest_["provenance"]["sha256"] == __import__("hashlib").sha256(file.read_bytes()).hexdigest()


def test_minference_kv_space_artifact_expands_to_query_heads(tmp_path):
    rows = [row(layer, kv, *(("ashape", dict(sink=4, local=64)) if kv == 0 else ("vertical_slash", dict(vertical_size=7, slash_size=9))))
            for layer in range(2) for kv in range(2)]
    config = export_minference(load(tmp_path, rows, space="kv"))
    assert [config[0][str(h)][0] for h in range(4)] == ["stream_llm", "stream_llm", "vertical_and_slash", "vertical_and_slash"]


def test_minference_writes_heads_without_rows_as_dense_like_the_runtime(tmp_path):
    rows = [r for r in mix_rows() if (r["layer"], r["head"]) != (1, 2)]
    config = export_minference(load(tmp_path, rows))
    assert config[1]["2"] == ["vertical_and_slash", DENSE_SIZE, DENSE_SIZE, None]


@pytest.mark.parametrize(
    "rows, methods, expected",
    [
        ([row(0, 1, "triangle", dict(sink=4, window=64, last=16))], None, "layer 0 head 1: pattern triangle cannot be written"),
        ([row(1, 3, "grid", dict(stride=16))], None, "layer 1 head 3: pattern grid cannot be written"),
        ([row(0, 0, "ashape", boundary="k")], None, "layer 0 head 0: boundary 'k' cannot be written"),
        ([row(0, 2, "vertical_slash", dict(last_q=32))], None, "layer 0 head 2: vertical_slash with last_q 32 cannot be written"),
        ([row(0, 0, "ashape", q_modality="text")], None, "modality-pair row (layer 0, head 0, text->all)"),
        ([row(0, 0, "ashape")], {"trianglemix": {"start_layer": 1, "sink": 8, "window": 64, "last": 16}}, "layer 1 head 0: pattern triangle"),
    ],
)
def test_minference_refuses_what_the_format_cannot_carry(tmp_path, rows, methods, expected):
    art = load(tmp_path, rows, methods=methods)
    with pytest.raises(ValueError) as info:
        export_minference(art)
    assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        write_minference(art, tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()


IMPORT_ERRORS = [
    ('[{"0": ["vertical_and_slash", 1000, 6096, 1.0]}', "not valid JSON"),
    ('{"0": {}}', "expected a JSON list with one object per layer, got dict"),
    ("[{}]", "has 1 layers, model tiny-llama has 2"),
    ('[{"9": ["stream_llm", 1, 2, 0]}, {}]', "layer 0 head 9 out of range [0, 4)"),
    ('[{"-1": ["stream_llm", 1, 2, 0]}, {}]', "head key '-1'"),
    ('[{"0": ["diagonal", 1, 2, 0]}, {}]', "unknown type 'diagonal'"),
    ('[{"0": ["stream_llm", "1", 2, 0]}, {}]', "sizes must be integers"),
    ('[{"0": ["stream_llm", 1, 2, "high"]}, {}]', "score must be a number or null"),
    ('[{"0": ["stream_llm", 1, 0, 0.5]}, {}]', "invalid stream_llm entry: local must be >= 1"),
    ('[{"0": ["stream_llm", 1]}, {}]', "expected [type, vertical_size, slash_size, score]"),
    ('[[1, 2], {}]', "layer 0 must be an object"),
    ('[{"0": ["stream_llm", 1, 2, 0], "0": ["stream_llm", 1, 2, 0]}, {}]', "repeated key(s) ['0']"),
]


@pytest.mark.parametrize("text, expected", IMPORT_ERRORS)
def test_minference_import_errors_are_one_line(tmp_path, text, expected):
    file = tmp_path / "cfg.json"
    file.write_text(text)
    with pytest.raises(ValueError) as info:
        import_minference(file, TINY)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------ duo, json


def test_duo_tsv_marks_streaming_kv_heads(tmp_path):
    rows = []
    for layer in range(2):
        for head in range(4):
            streaming = (layer == 0 and head in (0, 1)) or (layer == 1 and head in (0, 2, 3))
            rows.append(row(layer, head, "ashape" if streaming else "vertical_slash") if head != 3 or layer != 1
                        else row(layer, head, "triangle", dict(sink=4, window=64, last=16)))
    art = load(tmp_path, rows)
    assert export_duo(art) == [[0, 1], [1, 0]]
    assert duo_tsv(export_duo(art)) == "0\t1\n1\t0\n"
    kv = load(tmp_path, [row(l, h, "ashape" if h == 1 else "dense") for l in range(2) for h in range(2)], space="kv", name="kv")
    assert export_duo(kv) == [[1, 0], [1, 0]]
    tri = load(tmp_path, [row(0, h, "ashape") for h in range(4)], name="tri",
               methods={"trianglemix": {"start_layer": 1, "sink": 4, "window": 64, "last": 16}})
    assert export_duo(tri) == [[0, 0], [0, 0]]
    missing = load(tmp_path, [row(0, 0, "ashape"), row(0, 1, "ashape")], name="missing")
    assert export_duo(missing) == [[0, 1], [1, 1]]  # heads without rows run dense
    pairs = load(tmp_path, [row(0, 0, "ashape"), row(0, 1, "ashape"), row(0, 1, "vertical_slash", q_modality="text")], name="pairs")
    assert export_duo(pairs)[0][0] == 1  # a modality-pair row of the group keeps full attention


def test_json_export_is_plain_json(tmp_path):
    art = load(tmp_path)
    payload = json.loads(json.dumps(export_json(art), allow_nan=False))
    assert payload["manifest"] == art.manifest
    assert len(payload["heads"]) == 8 and payload["heads"][0]["vertical_size"] == 1000
    assert payload["heads"][1]["vertical_size"] is None


def test_single_file_outputs_refuse_directories_and_write_atomically(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        write_file_atomic(tmp_path / "dir", b"x")
    with pytest.raises(ValueError, match="is a directory"):
        write_file_atomic(str(tmp_path / "new") + "/", b"x")
    target = tmp_path / "keep.txt"
    target.write_text("old")

    def fail(*args, **kwargs):
        raise OSError("replace failed (simulated)")

    monkeypatch.setattr("sparsesearch.files.os.replace", fail)
    with pytest.raises(OSError, match="simulated"):
        write_file_atomic(target, b"new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "keep.txt"]


# ------------------------------------------------------------------------------------------ flex

FLEX_MIX = [
    ("vertical_slash", dict(vertical_size=5, slash_size=4, last_q=16, force_vertical=2, force_slash=2)),
    ("ashape", dict(sink=8, local=40)),
    ("triangle", dict(sink=4, window=24, last=30)),
    ("block_topk", dict(k_blocks=2, sink_blocks=1)),
    ("grid", dict(stride=12, phase=3, local=20)),
    ("dense", dict()),
]


def flex_artifact(tmp_path, space: str, name: str, blocks: tuple[int, int]):
    heads = 4 if space == "query" else 2
    bm, bn = blocks
    rows = [row(layer, head, *FLEX_MIX[(layer * heads + head) % len(FLEX_MIX)], block_m=bm if head % 2 else bn, block_n=bn)
            for layer in range(2) for head in range(heads)]
    return load(tmp_path, rows, space=space, name=name)


def expected_mask(art, layer, q, k):
    """bool [B, Hq, Nq, Nk]: per head, its own index through the oracle's index_mask_fn (+ triangle dense rows)."""
    batch, q_heads, q_len, _ = q.shape
    kv_len, group = k.shape[2], q_heads // k.shape[1]
    space = art.head_index_space
    rows = {r["head"]: r for r in art.head_rows() if r["layer"] == layer}
    rows_idx = torch.arange(q_len)
    out = torch.zeros(batch, q_heads, q_len, kv_len, dtype=torch.bool)
    for h in range(q_heads):
        r = rows[h if space == "query" else h // group]
        module, params = REGISTRY[r["pattern"]], params_from_row(r)
        block_m, block_n = r["block_m"], r["block_n"]
        if r["pattern"] in ("vertical_slash", "block_topk"):
            if space == "query":
                index = module.build_index(params, q[:, h:h + 1], k[:, h // group:h // group + 1], block_m=block_m, block_n=block_n)
            else:
                kv = h // group
                index = module.build_index(params, q[:, kv * group:(kv + 1) * group], k[:, kv:kv + 1], head_space="kv", block_m=block_m, block_n=block_n)
        else:
            index = module.build_index(params, q_len, kv_len, block_m=block_m, block_n=block_n)
        mask = ref.index_mask_fn(index, q_len, kv_len)(rows_idx)[:, 0]
        if r["pattern"] == "triangle":
            split = index.meta["split_row"]
            causal = torch.arange(kv_len)[None, :] <= (rows_idx[:, None] + kv_len - q_len)
            mask[:, split:] = causal[split:]
        out[:, h] = mask
    return out


@pytest.mark.parametrize(
    "space, q_len, kv_len, blocks, block",
    [
        ("query", 150, 150, (16, 16), 16),
        ("query", 100, 170, (32, 32), 32),
        ("kv", 130, 161, (16, 16), 16),
        ("query", 150, 150, (32, 16), 64),   # FlexAttention tiles coarser than the rows' blocks
        ("kv", 120, 200, (64, 32), 16),      # ... and finer
    ],
)
def test_flex_block_mask_equals_the_kernel_semantics(tmp_path, space, q_len, kv_len, blocks, block):
    art = flex_artifact(tmp_path, space, f"{space}{q_len}", blocks)
    gen = torch.Generator().manual_seed(q_len)
    q = torch.randn(2, 4, q_len, 16, generator=gen)
    k = torch.randn(2, 2, kv_len, 16, generator=gen)
    v = torch.randn(2, 2, kv_len, 16, generator=gen)
    for layer in range(2):
        bm = flex_block_mask(art, q, k, layer, block=block)
        want = expected_mask(art, layer, q, k)
        # mask_mod alone (FlexAttention's eager path evaluates it on every pair).
        got = create_mask(bm.mask_mod, 2, 4, q_len, kv_len, device=q.device)
        assert torch.equal(got, want), (layer, (got != want).nonzero()[:5])
        # Block lists (the compiled path): full blocks admit everything, partial ones the mask_mod, others nothing.
        qb, kb = num_blocks(q_len, block), num_blocks(kv_len, block)
        listed = bm.to_dense()[..., :qb, :kb].bool()
        full = torch.zeros_like(listed)
        counts, idx = bm.full_kv_num_blocks, bm.full_kv_indices
        for b in range(2):
            for h in range(4):
                for m in range(qb):
                    full[b, h, m, idx[b, h, m, : counts[b, h, m]].long()] = True
        expand = lambda t: t.repeat_interleave(block, 2).repeat_interleave(block, 3)[:, :, :q_len, :kv_len]  # noqa: E731
        compiled = expand(full) | (expand(listed & ~full) & got)
        assert torch.equal(compiled, want)
        # Every listed block holds an admitted key (no wasted work) and no admitted key lies outside them.
        pooled = torch.zeros(2, 4, qb * block, kb * block, dtype=torch.bool)
        pooled[:, :, :q_len, :kv_len] = want
        any_admitted = pooled.view(2, 4, qb, block, kb, block).any(5).any(3)
        assert torch.equal(listed | any_admitted, listed)
        assert torch.equal(listed & any_admitted, listed)
        # Attention through FlexAttention (eager, CPU) equals the oracle with the expected mask.
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        ref_out, _ = ref.masked_attention(q, k, v, lambda rows: want[:, :, rows])
        nonempty = want.any(-1)
        torch.testing.assert_close(out[nonempty], ref_out[nonempty].to(out.dtype), atol=2e-5, rtol=1e-4)


def test_flex_static_tensors_file_round_trip(tmp_path):
    rows = [row(layer, head, *FLEX_MIX[[1, 2, 4, 5][head]], block_m=16, block_n=16) for layer in range(2) for head in range(4)]
    art = load(tmp_path, rows)
    per_layer = {layer: flex_tensors(art, layer, q_len=90, block=16) for layer in range(2)}
    path = write_flex(per_layer, tmp_path / "masks.safetensors", metadata={"artifact": "art"})
    loaded = load_flex(path)
    assert set(loaded) == {0, 1}
    for layer in range(2):
        assert set(loaded[layer]) == set(per_layer[layer])
        for name, tensor in per_layer[layer].items():
            assert torch.equal(loaded[layer][name], tensor), name
        a, b = block_mask_from_tensors(per_layer[layer]), block_mask_from_tensors(loaded[layer])
        assert torch.equal(a.to_dense(), b.to_dense())
        assert torch.equal(create_mask(a.mask_mod, 1, 4, 90, 90, device="cpu"), create_mask(b.mask_mod, 1, 4, 90, 90, device="cpu"))
    q, k = torch.randn(1, 4, 90, 8), torch.randn(1, 2, 90, 8)
    direct = flex_block_mask(art, q, k, 0, block=16)
    assert torch.equal(create_mask(direct.mask_mod, 1, 4, 90, 90, device="cpu"), create_mask(block_mask_from_tensors(loaded[0]).mask_mod, 1, 4, 90, 90, device="cpu"))


def test_flex_saved_layer_runs_where_the_attention_runs(tmp_path):
    """A layer loaded from a file sits on the CPU; block_mask_from_tensors(device=) moves the mask tables to
    the attention's device (on a GPU a CPU table indexed by CUDA indices fails)."""
    rows = [row(0, head, *FLEX_MIX[[1, 2, 4, 5][head]], block_m=16, block_n=16) for head in range(4)]
    art = load(tmp_path, rows)
    loaded = load_flex(write_flex({0: flex_tensors(art, 0, q_len=90, block=16)}, tmp_path / "m.safetensors"))
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 90, 16, generator=gen), torch.randn(1, 2, 90, 16, generator=gen), torch.randn(1, 2, 90, 16, generator=gen)
    bm = block_mask_from_tensors(loaded[0], device=DEVICE)
    want = create_mask(block_mask_from_tensors(loaded[0]).mask_mod, 1, 4, 90, 90, device="cpu")
    assert torch.equal(create_mask(bm.mask_mod, 1, 4, 90, 90, device=DEVICE).cpu(), want)
    out = flex_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), block_mask=bm, enable_gqa=True).cpu()
    ref_out, _ = ref.masked_attention(q, k, v, lambda rows: want[:, :, rows])
    torch.testing.assert_close(out, ref_out.to(out.dtype), atol=2e-5 if DEVICE == "cpu" else 2e-3, rtol=1e-4 if DEVICE == "cpu" else 2e-3)


def test_flex_needs_q_and_k_for_dynamic_patterns_and_checks_shapes(tmp_path):
    art = load(tmp_path)
    with pytest.raises(ValueError, match="layer 0 head 0 uses vertical_slash, which is estimated from Q and K"):
        flex_tensors(art, 0, q_len=64, block=16)
    with pytest.raises(ValueError, match="the model has 4 query and 2 KV heads, q and k have 2 and 2"):
        flex_tensors(art, 0, q=torch.randn(1, 2, 64, 8), k=torch.randn(1, 2, 64, 8))
    with pytest.raises(ValueError, match="block must be one of"):
        flex_tensors(art, 0, q_len=64, block=100)
    with pytest.raises(ValueError, match="layer must be in"):
        flex_tensors(art, 5, q_len=64)
    with pytest.raises(ValueError, match="boundary 'q'"):
        flex_tensors(load(tmp_path, [row(0, 0, "ashape", boundary="q")], name="b"), 0, q_len=64)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load_flex(tmp_path / "bad.safetensors")


def test_flex_trianglemix_layers_and_missing_heads_follow_the_runtime(tmp_path):
    art = load(tmp_path, [row(0, 0, "ashape", dict(sink=4, local=16))], name="tri",
               methods={"trianglemix": {"start_layer": 1, "sink": 4, "window": 24, "last": 30}})
    t0 = flex_tensors(art, 0, q_len=80, block=16)
    assert t0["window"].tolist() == [16, -1, -1, -1]  # heads 1..3 have no row: dense
    t1 = flex_tensors(art, 1, q_len=80, block=16)
    assert t1["window"].tolist() == [24] * 4 and t1["dense_from_row"].tolist() == [50] * 4
    dense_mask = create_mask(block_mask_from_tensors(t0).mask_mod, 1, 4, 80, 80, device="cpu")
    assert torch.equal(dense_mask[0, 1], torch.ones(80, 80, dtype=torch.bool).tril())


def test_replace_keeps_tiny_model(tmp_path):
    assert replace(TINY, num_layers=2) == TINY


def test_flex_export_of_dynamic_heads_from_a_prompt_through_the_model(tmp_path):
    """P12 §2: an artifact with vertical-slash heads exports to flex from the CLI alone: --prompt runs one
    held-out prompt through --model, and the block lists equal those built from that prompt's own q/k."""
    from typer.testing import CliRunner

    from cli.app import app
    from sparsesearch.data import held_out
    from sparsesearch.export.flex import flex_tensors, load_flex
    from sparsesearch.models import capture_qkv, load_model
    from sparsesearch.pareto.baselines import vertical_slash_point
    from tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", layers=2, heads=2, kv_heads=1)
    model, tok, info = load_model(model_dir, dtype="float32", device="cpu")
    point = vertical_slash_point(info, 256, 0.3)
    art_path = write_artifact(tmp_path / "vs", point.manifest, {"heads.parquet": point.rows})
    out = tmp_path / "vs.safetensors"
    result = CliRunner().invoke(app, ["export", str(art_path), "--format", "flex", "--model", model_dir, "--prompt",
                                      "text:shakespeare", "--tokens", "256", "--out", str(out)])
    assert result.exit_code == 0, result.output
    art = load_artifact(art_path)
    sample = held_out("text:shakespeare", tok, max_tokens=256)
    caps = capture_qkv(model, sample.input_ids[None], info=info)
    got = load_flex(out)
    for cap in caps:
        want = flex_tensors(art, cap.layer, q=cap.q, k=cap.k)
        assert set(got[cap.layer]) == set(want) and all(torch.equal(got[cap.layer][n], want[n]) for n in want)
    refused = CliRunner().invoke(app, ["export", str(art_path), "--format", "flex", "--tokens", "256", "--out", str(tmp_path / "x.st")])
    assert refused.exit_code == 2 and "--prompt" in refused.output
