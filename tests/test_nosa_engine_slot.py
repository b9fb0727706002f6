"""generate() through the engine's slot decoder (runtime/nosa_device.py SlotDecoder, one per global layer, batched over
sequences and KV heads) against the engine's torch decoder, which tests/test_nosa_engine.py checks against
brute force: the same tokens and, in every layer at every step, the same selected blocks, on a ragged batch
(left padding) over block starts and a store that grows past its hint. The fused Triton step runs here
under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from sparsesearch.nosa.config import make_config
from sparsesearch.runtime.nosa_config import NosaConfig
from sparsesearch.runtime.nosa_engine import _fusable, disable_nosa, enable_nosa, resolve_decoder, right_aligned
from sparsesearch.runtime.offload_cache import NosaLayer, SlotNosaLayer
from test_nosa_engine import ragged_batch, tiny_llama

PROMPT, PAD, NEW = 190, 31, 12  # lengths 190 and 159; decode step s appends position length + s - 1: block starts 160 (s 2), 192 (s 3)


def with_eviction_heads(model):
    """A NOSA-checkpoint stand-in: every attention module carries eviction_w [Hkv, D] and eviction_a [Hkv]."""
    g = torch.Generator().manual_seed(11)
    for layer in model.model.layers:
        attn = layer.self_attn
        kv, dim, device = model.config.num_key_value_heads, attn.head_dim, attn.q_proj.weight.device
        attn.register_buffer("eviction_w", (torch.randn(kv, dim, generator=g) / dim**0.5).to(device))
        attn.register_buffer("eviction_a", (torch.rand(kv, generator=g) + 0.5).to(device))
    return model


def generate(model, cfg, decoder: str, fused: bool | None = None, hint: int | None = 0):
    """Greedy generate() of NEW tokens on the ragged batch; returns (tokens, per layer the selection after
    each step, the cache). hint 0: the slot store holds the prompt only and grows during the run."""
    torch.manual_seed(3)
    ids, mask = (t.to(next(model.parameters()).device) for t in ragged_batch(PROMPT, PAD))
    engine = enable_nosa(model, cfg=cfg, decoder=decoder, fused=fused)
    try:
        cache = engine.new_cache(max_new_tokens=hint)
        selections = {i: [] for i, layer in enumerate(cache.layers)}
        for i, layer in enumerate(cache.layers):
            def recorded(query, decode=layer.decode, layer=layer, i=i):
                out = decode(query)  # the fused decoders share a scratch: copy the selection before the next layer steps
                selections[i].append(layer.last_selected.clone())
                return out
            layer.decode = recorded
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        disable_nosa(model)
    return out, selections, cache


def assert_same_steps(reference, other) -> None:
    """Same tokens; per layer and step the same selected blocks (the slot decoder's map is as wide as its
    capacity: nothing selected past the torch decoder's blocks)."""
    (want, want_sel, _), (got, got_sel, _) = reference, other
    assert torch.equal(got, want)
    for i, steps in want_sel.items():
        assert len(steps) == len(got_sel[i]) == NEW - 1
        for t, (a, b) in enumerate(zip(steps, got_sel[i])):
            n = a.shape[-1]
            assert torch.equal(b[..., :n], a) and not b[..., n:].any(), (i, t)


CASES = [
    pytest.param("vnorm", make_config(128, 0.25, 32, "vnorm"), False, id="vnorm-torch"),
    pytest.param("trained", make_config(128, 0.25, 32, "trained"), False, id="trained-torch"),
    # random: the torch decoder redraws every token's noise at a refresh (the sweep's control), the slot decoder
    # hashes (seed, position, head) once per token; with k_e = 0 the agnostic score has no say and the steps agree
    pytest.param("random", NosaConfig(block=32, k=4, k_q=2, n_init=1, n_win=1, proxy="random"), False, id="random-ke0-torch"),
    pytest.param("trained", make_config(128, 0.25, 32, "trained"), True, id="trained-fused"),
    pytest.param("vnorm", make_config(128, 0.25, 32, "vnorm"), True, id="vnorm-fused", marks=pytest.mark.slow),
    pytest.param("random", NosaConfig(block=32, k=4, k_q=2, n_init=1, n_win=1, proxy="random"), True, id="random-ke0-fused", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("proxy,cfg,fused", CASES)
def test_slot_decoder_generates_what_the_torch_decoder_does(proxy, cfg, fused):
    model = tiny_llama(layers=1).to(DEVICE if fused else "cpu")  # Triton needs the GPU where there is one
    if proxy == "trained":
        with_eviction_heads(model)
    reference = generate(model, cfg, "torch")
    slot = generate(model, cfg, "slot", fused=fused)
    assert isinstance(reference[2].layers[0], NosaLayer) and isinstance(slot[2].layers[0], SlotNosaLayer)
    assert_same_steps(reference, slot)
    layer = slot[2].layers[0]
    assert layer.decoder.fused == fused and layer.grown == 1  # a store of 192 tokens, outgrown at step 3
    assert layer.lengths.tolist() == [PROMPT + NEW - 1, PROMPT - PAD + NEW - 1]


def test_memory_report_counts_the_decoders_traffic():
    """Host bytes used equal the torch decoder's; H2D is the decoder's fetched blocks (K and V), which
    exceed the torch decoder's by the complete tail blocks it moves on the device; nothing dropped."""
    model = tiny_llama(layers=1)
    cfg = make_config(128, 0.25, 32, "vnorm")
    (_, _, torch_cache), (_, _, slot_cache) = generate(model, cfg, "torch"), generate(model, cfg, "slot", fused=False, hint=NEW)
    want, got = torch_cache.layers[0].memory(), slot_cache.layers[0].memory()
    dec = slot_cache.layers[0].decoder
    block_bytes = cfg.block * dec.dim * 2 * 4
    assert got["host_bytes_used"] == want["host_bytes_used"] == (PROMPT + NEW - 1 + PROMPT - PAD + NEW - 1) * 2 * dec.dim * 2 * 4
    assert got["host_bytes"] == 2 * 2 * 2 * 224 * dec.dim * 4  # K and V, 2 sequences, 2 KV heads, 190 + 12 + 1 -> 224 tokens
    assert got["fetched_blocks"] > 0 and got["h2d_bytes"] == got["fetched_blocks"] * block_bytes
    assert got["h2d_bytes"] == want["h2d_bytes"] + want["blocks_moved_from_tail"] * block_bytes
    assert got["dropped_blocks"] == 0 and got["steps"] == NEW - 1 and got["d2h_bytes"] == want["d2h_bytes"]
    assert 0 < got["device_bytes"] and slot_cache.layers[0].grown == 0
    report = slot_cache.memory_report()
    assert "slot decoder" in report and "0 blocks dropped" in report and f"over {NEW - 1} steps" in report


def test_slot_decoder_on_a_hybrid_model_uses_the_models_scaling():
    """Gemma 3 (query_pre_attn_scalar != head_dim): slot layers on the global layers only, and with a budget
    that covers the context generate() equals dense decoding."""
    from transformers import Gemma3ForCausalLM

    from tiny_model import GEMMA_LAYER_TYPES, tiny_gemma_config

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_gemma_config()).eval()
    ids = torch.randint(0, 128, (1, 150))
    dense = model.generate(ids, max_new_tokens=4, do_sample=False)
    engine = enable_nosa(model, cfg=make_config(512, 0.25, 32, "vnorm"), decoder="slot", fused=False)
    try:
        cache = engine.new_cache(max_new_tokens=4)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    finally:
        disable_nosa(model)
    assert [isinstance(layer, SlotNosaLayer) for layer in cache.layers] == [t == "full_attention" for t in GEMMA_LAYER_TYPES]
    assert torch.equal(out, dense)


def test_right_aligned_strips_left_padding():
    x = torch.arange(2 * 1 * 5 * 1, dtype=torch.float32).view(2, 1, 5, 1) + 1
    got = right_aligned(x, torch.tensor([0, 2]))
    assert got[0, 0, :, 0].tolist() == [1, 2, 3, 4, 5] and got[1, 0, :, 0].tolist() == [8, 9, 10, 0, 0]


def test_decoder_choice_and_bad_input():
    assert resolve_decoder("auto", "vnorm", torch.device("cuda")) == "slot"
    assert resolve_decoder("auto", "trained", torch.device("cpu")) == "torch"  # the CPU reference
    assert resolve_decoder("auto", "h2o", torch.device("cuda")) == "torch"
    assert resolve_decoder("slot", "random", torch.device("cpu")) == "slot"
    vnorm = make_config(128, 0.25, 32, "vnorm")
    assert _fusable(vnorm, 64) and not _fusable(vnorm, 80) and not _fusable(make_config(192, 0.25, 48, "vnorm"), 64)  # else the torch step
    assert not _fusable(vnorm, 8)  # a power of two below 16: the fused selection refuses it, so the step must too
    model = tiny_llama(layers=1)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="decoder 'fast' is unknown; choose one of auto, slot, torch"):
        enable_nosa(model, cfg=make_config(128, 0.25, 32, "vnorm"), decoder="fast")
    for proxy in ("snapkv", "tova", "h2o", "persistence"):
        with pytest.raises(ValueError, match=f"decoder 'slot' serves proxies trained, vnorm, random, not '{proxy}'"):
            enable_nosa(model, cfg=make_config(128, 0.25, 32, proxy), decoder="slot")
    assert model.config._attn_implementation == before and not any(hasattr(m, "_sparsesearch_nosa_engine") for m in model.modules())


def test_fused_step_off_a_gpu_needs_the_interpreter(monkeypatch):
    """fused=True on a CPU model without TRITON_INTERPRET=1 would hand host tensors to compiled Triton
    launches: refused at prefill with one line instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match=r"fused=True runs Triton kernels: the model must be on a GPU \(or TRITON_INTERPRET=1 set\)"):
        generate(model, make_config(128, 0.25, 32, "vnorm"), "slot", fused=True)
    assert not any(hasattr(m, "_sparsesearch_nosa_engine") for m in model.modules())  # generate()'s finally detached it
