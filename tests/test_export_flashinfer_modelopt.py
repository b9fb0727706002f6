"""Issue P14's flashinfer and modelopt exports: BSR round trips (scipy) against our own block masks, the lost token
mask counted against a token-level reference, refusals, and check-export's rules on our files and broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from artifact_fixtures import TINY, make_artifact, manifest, mix_rows, row
from sparsesearch.artifacts import load_artifact, write_artifact
from sparsesearch.export.check import check_file
from sparsesearch.export.flashinfer import (
    export_flashinfer, flashinfer_file_bytes, from_bsr, load_flashinfer, lossy_blocks, to_bsr, variable_plan_inputs,
)
from sparsesearch.export.flex import flex_tensors
from sparsesearch.export.modelopt import export_modelopt
from sparsesearch.index import BlockIndex, to_block_masks
from sparsesearch.models import resolve_model_info
from test_export_engines import run, tiny_dir  # noqa: F401 - the CLI runner and the config-only model fixture

STATIC = [("ashape", dict(sink=100, local=300)), ("dense", {})]
TRI = {"trianglemix": {"start_layer": 1, "sink": 4, "window": 64, "last": 16}}


def load(tmp_path, rows, *, space="kv", methods=None, name="art"):
    m = manifest(space=space)
    m["methods"].update(methods or {})
    return load_artifact(write_artifact(tmp_path / name, m, {"heads.parquet": rows}))


def flex_blocks(art, layer: int, tokens: int) -> torch.Tensor:
    """Our own block masks (the FlexAttention export's code table at 64 x 64): listed bool [Hq, QB, KB]."""
    t = flex_tensors(art, layer, q_len=tokens, block=64)
    kv_blocks = -(-tokens // 64)
    out = []
    for name in ("code_full", "code_partial"):
        count, idx = t[f"{name}_count"], t[f"{name}_idx"]
        index = BlockIndex(count, idx, torch.zeros_like(count), torch.zeros_like(idx[..., :1]), 64, 64)
        out.append(to_block_masks(index, kv_blocks)[0][0])
    return out[0] | out[1]


# ------------------------------------------------------------------------------------------ flashinfer export


@pytest.mark.parametrize("tokens", [1000, 1024])
def test_flashinfer_bsr_round_trips_through_scipy_to_our_block_masks(tmp_path, tokens):
    sparse = pytest.importorskip("scipy.sparse")
    art = load(tmp_path, mix_rows(STATIC, heads=2), methods=TRI)  # layer 1 is a TriangleMix layer
    plan, tensors = export_flashinfer(art, tokens)
    mb = -(-tokens // 64)
    for layer in range(2):
        ours = flex_blocks(art, layer, tokens)  # [Hq, QB, KB]
        for kv in range(2):
            indptr, indices = (tensors[f"layers.{layer}.kv_heads.{kv}.{n}"] for n in ("indptr", "indices"))
            # scipy builds the BSR of our token-level block mask; its lists must be the exported ones.
            dense = torch.kron(ours[2 * kv].int(), torch.ones(64, 64, dtype=torch.int32)).numpy()
            bsr = sparse.bsr_matrix(dense, blocksize=(64, 64))
            bsr.sort_indices()
            assert bsr.indptr.tolist() == indptr.tolist() and bsr.indices.tolist() == indices.tolist()
            assert torch.equal(ours[2 * kv], ours[2 * kv + 1])  # the group's query heads share the pattern
            back = sparse.bsr_matrix((torch.ones(indices.numel(), 64, 64).numpy(), indices.numpy(), indptr.numpy()),
                                     shape=(mb * 64, mb * 64)).toarray()
            assert (back.reshape(mb, 64, mb, 64).any(axis=(1, 3)) == ours[2 * kv].numpy()).all()
    assert plan["heads"][1][0]["pattern"] == "triangle" and plan["heads"][1][0]["dense_from_row"] == tokens - 16


def test_flashinfer_file_round_trip_and_variable_wrapper_inputs(tmp_path):
    art = load(tmp_path, mix_rows(STATIC, heads=2))
    out = tmp_path / "plan.safetensors"
    result = run("export", art.path, "--format", "flashinfer", "--tokens", 1000, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["block_sizes"] == [64, 64] and payload["lossy_heads"] == 2
    plan, tensors = load_flashinfer(out)
    expected_plan, expected = export_flashinfer(art, 1000)
    assert plan == expected_plan and set(tensors) == set(expected)
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    masks, rows, cols = variable_plan_inputs(plan, tensors, 0)
    assert masks.shape == (2, 16, 16) and rows[0].sum() == 1000 and cols[1].sum() == 1000 and cols[0, -1] == 1000 - 15 * 64
    assert torch.equal(masks[1], from_bsr(tensors["layers.0.kv_heads.1.indptr"], tensors["layers.0.kv_heads.1.indices"], 16))


@pytest.mark.parametrize("window, sink, dense_from", [(300, 100, 1000), (128, 64, 1000), (70, 4, 936), (64, 0, 1000)])
def test_lossy_blocks_match_a_token_level_reference(window, sink, dense_from):
    tokens, r, c = 1000, 64, 32
    q = torch.arange(tokens)[:, None]
    k = torch.arange(tokens)[None, :]
    causal = k <= q
    ours = causal & ((q - k < window) | (k < sink) | (q >= dense_from))
    pad = (-tokens % r, -tokens % c)
    grid = lambda m: torch.nn.functional.pad(m, (0, pad[1], 0, pad[0])).view(-(-tokens // r), r, -(-tokens // c), c)  # noqa: E731
    listed = grid(ours).any(3).any(1)
    full = grid(ours).all(3).all(1)
    partial = listed & ~full
    extra = grid(causal & ~ours).any(3).any(1)  # blocks where causal=True admits a key our mask drops
    got = lossy_blocks(partial, (window, sink, dense_from), tokens, r, c)
    assert torch.equal(got, partial & extra) and (window % c != 0) <= bool(got.any())


def test_to_bsr_and_from_bsr_are_inverse():
    listed = torch.rand(7, 9, generator=torch.Generator().manual_seed(0)) < 0.4
    bsr = to_bsr(listed, listed)
    assert torch.equal(from_bsr(bsr["indptr"], bsr["indices"], 9), listed) and bool(bsr["partial"].all())


@pytest.mark.parametrize("rows, space, fragment", [
    (mix_rows(heads=2), "kv", "layer 0 head 0 (vertical_slash) is estimated from each prompt's Q and K"),
    ([row(0, 0, "block_topk", dict(k_blocks=4))], "kv", "(block_topk) is estimated"),
    (mix_rows(STATIC), "query", "layer 0 KV head 0: query heads 0 (ashape) and 1 (dense) differ"),
])
def test_cli_flashinfer_refusals_write_nothing(tmp_path, rows, space, fragment):
    art = load(tmp_path, rows, space=space)
    out = tmp_path / "plan.safetensors"
    result = run("export", art.path, "--format", "flashinfer", "--tokens", 512, "--out", out)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.output
    assert not out.exists()


def test_cli_flashinfer_needs_tokens_in_context_and_overwrite(tmp_path):
    art = load(tmp_path, mix_rows(STATIC, heads=2))
    out = tmp_path / "plan.safetensors"
    assert "needs --tokens" in run("export", art.path, "--format", "flashinfer", "--out", out).stderr
    result = run("export", art.path, "--format", "flashinfer", "--tokens", 5000, "--out", out)
    assert result.exit_code == 2 and "exceeds the context" in result.stderr and not out.exists()
    out.write_bytes(b"old")
    result = run("export", art.path, "--format", "flashinfer", "--tokens", 256, "--out", out)
    assert result.exit_code == 2 and "--overwrite" in result.stderr and out.read_bytes() == b"old"


# ------------------------------------------------------------------------------------------ check-export flashinfer


def test_check_flashinfer_our_export_and_broken_plans(tmp_path, tiny_dir):
    info = resolve_model_info(str(tiny_dir))
    art = load(tmp_path, mix_rows(STATIC, heads=2))
    plan, tensors = export_flashinfer(art, 1000)
    path = tmp_path / "p.safetensors"
    path.write_bytes(flashinfer_file_bytes(plan, tensors))
    findings = check_file(path, "flashinfer", info)
    assert [f.level for f in findings] == ["note"] * 3  # C does not divide 1000; two lossy ashape heads
    assert "BlockSparseAttentionWrapper reads every key block as C long" in findings[0].text

    broken = dict(tensors)
    broken["layers.0.kv_heads.1.indices"] = broken["layers.0.kv_heads.1.indices"] + 1  # last block row -> 16: out of range
    broken["layers.1.kv_heads.0.indptr"] = broken["layers.1.kv_heads.0.indptr"].flip(0)
    del broken["layers.1.kv_heads.1.partial"]
    path.write_bytes(flashinfer_file_bytes({**plan, "num_kv_heads": 2}, broken))
    problems = [f.text for f in check_file(path, "flashinfer", info) if f.level == "problem"]
    assert problems == [
        "layer 0 KV head 1: indices out of range [0, 16) (ceil(tokens / C) key blocks)",
        "layer 1 KV head 0: indptr must start at 0, never decrease and end at the 136 indices",
        "layer 1 KV head 1: missing tensors (need indptr, indices, partial)",
    ]
    path.write_bytes(flashinfer_file_bytes({**plan, "num_layers": 3, "tokens": 8192}, tensors))
    problems = [f.text for f in check_file(path, "flashinfer", info) if f.level == "problem"]
    assert problems[0].startswith("the plan has num_layers 3, model") and "exceed the model's context (4096)" in problems[1]


def test_check_flashinfer_malformed_file_is_one_line_exit_2(tmp_path, tiny_dir):
    path = tmp_path / "p.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    result = run("check-export", path, "--format", "flashinfer", "--model", tiny_dir)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "cannot read safetensors" in lines[0], result.output


# ------------------------------------------------------------------------------------------ modelopt


def test_modelopt_block_names_dense_layers_and_the_measured_sparsity(tmp_path):
    rows = [row(0, h, "ashape", dict(sink=64, local=256), density=0.2 + 0.1 * h) for h in range(4)]
    rows += [row(1, h, "dense", density=1.0) for h in range(4)]
    block = export_modelopt(load(tmp_path, rows, space="query"))
    group = block["config_groups"]["group_0"]
    assert group == {"algorithm": "skip_softmax", "targets": ["LlamaAttention"], "ignore": ["model.layers.1.self_attn"],
                     "target_sparsity": {"prefill": 0.65}}  # 1 - mean(0.2, 0.3, 0.4, 0.5); the dense layer is ignored
    assert block["producer"]["name"] == "sparsesearch"


# ModelOpt's reader runs in a child process: importing modelopt.torch registers its plugins with torch and
# transformers, which must not leak into the other tests of this process.
_READER = """
import json, sys
from types import SimpleNamespace
from modelopt.torch.sparsity.attention_sparsity.plugins import sparse_attn_config as reader
block, modules = json.loads(sys.stdin.read())
got = reader.load_from_checkpoint_metadata(SimpleNamespace(sparse_attention_config=block))
print(json.dumps(None if got is None else {"preset": got[1], "cfg": got[0],
                                           "match": {m: reader.match_sparse_config(m, got[0]) for m in modules}}))
"""


def _modelopt_reads(block: dict, modules: list[str]) -> dict | None:
    """nvidia-modelopt's load_from_checkpoint_metadata on a config holding ``block``, and its per-module match."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _READER], input=json.dumps([block, modules]), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_modelopt_own_reader_resolves_our_block_as_check_export_says(tmp_path):
    """nvidia-modelopt 0.47's serving reader (the `modelopt` test extra; the function ModelOpt's vLLM plugin
    calls) on CPU. It takes our block from a config, and with no calibrated threshold_scale_factor resolves it
    to its Triton skip-softmax preset: our ignore list and sparsity are not applied, as check-export's note
    and docs/deploying.md say. A ModelOpt calibration's fitted factor (a, b per phase) added to the same block
    makes it apply them: the layer we keep dense is disabled, every other attention module runs skip-softmax
    at our measured sparsity."""
    pytest.importorskip("modelopt")
    rows = [row(0, h, "ashape", dict(sink=64, local=256), density=0.2 + 0.1 * h) for h in range(4)]
    rows += [row(1, h, "dense", density=1.0) for h in range(4)]
    block = export_modelopt(load(tmp_path, rows, space="query"))
    layers = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    got = _modelopt_reads(block, layers)
    assert got is not None and got["preset"] == "SKIP_SOFTMAX_TRITON_DEFAULT"
    assert layers[1] not in json.dumps(got["cfg"]), "uncalibrated: ModelOpt does not read our ignore list"

    block["config_groups"]["group_0"]["threshold_scale_factor"] = {"prefill": {"a": 1.0, "b": 0.5}}  # a calibration's fit
    got = _modelopt_reads(block, layers)
    assert got["preset"] == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP"
    assert got["match"][layers[1]] == {"enable": False}
    assert got["match"][layers[0]]["enable"] and got["match"][layers[0]]["target_sparse_ratio"]["prefill"] == pytest.approx(0.65)


def test_cli_modelopt_then_check_export(tmp_path, tiny_dir):
    art = make_artifact(tmp_path / "A")
    out = tmp_path / "modelopt.json"
    result = run("export", art, "--format", "modelopt", "--out", out)
    assert result.exit_code == 0 and "no per-head pattern" in result.stderr, result.output
    findings = check_file(out, "modelopt", resolve_model_info(str(tiny_dir)))
    assert [f.level for f in findings] == ["note"] and "SKIP_SOFTMAX_TRITON_DEFAULT" in findings[0].text
    config = {"sparse_attention_config": json.loads(out.read_text())}  # a config.json holding the block
    group = config["sparse_attention_config"]["config_groups"]["group_0"]
    group.update(ignore=["model.layers.7.self_attn", "lm_head"], target_sparsity=1.5, targets=[], algorithm="topk")
    del config["sparse_attention_config"]["producer"]
    out.write_text(json.dumps(config))
    result = run("check-export", out, "--format", "modelopt", "--model", tiny_dir)
    lines = [line for line in result.stderr.splitlines() if line.startswith(("problem:", "note:"))]
    assert result.exit_code == 2 and lines == [
        "note: config_groups.group_0: algorithm 'topk' is unknown to ModelOpt 0.47's reader and silently ignored",
        "problem: config_groups.group_0: targets must be a non-empty list of module class names, got []",
        "problem: config_groups.group_0: ignore entry 'model.layers.7.self_attn': layer out of range [0, 2)",
        "problem: config_groups.group_0: ignore entry 'lm_head' names no layer (layers.N)",
        "problem: config_groups.group_0: target_sparsity must be in [0, 1] or {prefill, decode} of such, got 1.5",
        "problem: producer must be an object with a name, got None",
    ]


@pytest.mark.parametrize("text, fragment", [("[1, 2]", "expected a JSON object"), ("{bad", "not valid JSON")])
def test_check_modelopt_malformed_is_one_line_exit_2(tmp_path, tiny_dir, text, fragment):
    path = tmp_path / "m.json"
    path.write_text(text)
    result = run("check-export", path, "--format", "modelopt", "--model", tiny_dir)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.output
