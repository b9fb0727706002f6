"""VLM calibration data: chat rows with images go through the model's real processor (a tiny LLaVA with a
LlavaProcessor, offline), keep their pixel tensors for the forward, mark image tokens, and calibrate runs
Alg. 4 over text and image regions end to end."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from sparsesearch.data import IMAGE, TEXT, load_calibration, sha256_of
from sparsesearch.models import load_model, modality_ids
from sparsesearch_cli.app import app
from tiny_vlm import IMAGE_SIZE, PATCH, make_tiny_llava, write_image_rows

TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
SPACE = {
    "name": "vlm-small", "format": 1, "reference_tokens": 1024, "block_m": 16, "block_n": 16,
    "target": {"pattern": "ashape", "params": {"sink": 64, "local": 256}}, "budget_slack": 3.0,
    "candidates": [
        {"pattern": "ashape", "params": {"sink": 32, "local": 64}},
        {"pattern": "vertical_slash", "params": {"vertical_size": 64, "slash_size": 64, "last_q": 32}},
    ],
    "boundaries": ["none", "k", "q", "2d"],
}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return make_tiny_llava(root / "llava"), write_image_rows(root / "data", rows=3)


def test_image_rows_go_through_the_processor(vlm):
    path, rows = vlm
    model, processor, info = load_model(path, device="cpu")
    samples = load_calibration(str(rows), processor, max_tokens=1024, samples=2)
    for s in samples:
        assert s.inputs["pixel_values"].shape == (6, 3, IMAGE_SIZE, IMAGE_SIZE)
        assert int((s.modality == IMAGE).sum()) == 6 * TOKENS_PER_IMAGE and int((s.modality == TEXT).sum()) > 0
        # The data's image ids are the model's own modality ids for the same tokens.
        assert torch.equal(modality_ids(s.input_ids[None], info)[0], s.modality)
        with torch.no_grad():  # the model accepts the sample as the processor built it
            model(input_ids=s.input_ids[None], **s.inputs)
    changed = [type(s)(s.input_ids, s.modality, inputs={"pixel_values": s.inputs["pixel_values"] + 1}) for s in samples]
    assert sha256_of(changed) != sha256_of(samples), "the pixels are part of the provenance hash"
    with pytest.raises(ValueError, match="no sample"):
        load_calibration(str(rows), processor, max_tokens=128, samples=1)  # rows cannot be cut through images


def test_image_rows_need_a_processor(vlm):
    path, rows = vlm
    _, processor, _ = load_model(path, device="cpu")
    with pytest.raises(ValueError, match="processor"):
        load_calibration(str(rows), processor.tokenizer, max_tokens=1024)


def test_calibrate_a_vlm_on_image_rows(vlm, tmp_path):
    path, rows = vlm
    space = tmp_path / "space.json"
    space.write_text(json.dumps(SPACE))
    out = tmp_path / "art"
    result = CliRunner().invoke(app, ["calibrate", "--model", path, "--data", str(rows), "--search-space", str(space),
                                      "--max-tokens", "1024", "--out", str(out), "--eval-data", str(rows),
                                      "--min-tokens", "64", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert sum(summary["boundaries"].values()) == 2 * 2  # 2 layers x 2 KV heads
    import pandas as pd

    heads = pd.read_parquet(out / "heads.parquet")
    assert {("image", "text"), ("text", "image"), ("image", "image"), ("all", "image")} <= set(zip(heads.q_modality, heads.k_modality))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["modalities"]["names"] == {"text": 0, "image": 1}
    assert summary["fidelity"]["samples"] == 1 and summary["fidelity"]["next_token_kl"] >= 0.0
