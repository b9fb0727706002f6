"""Offloaded NOSA decode: missed blocks land in their slots through kernels/gather.py, the engine holds exactly the selected
blocks and attends exactly over them, and generate() through the Cache subclass (batch 2, different
lengths) equals dense decoding when the budget covers the context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsesearch.nosa.config import make_config
from sparsesearch.nosa.engine import _gather, disable_nosa, enable_nosa
from sparsesearch.runtime.offload_cache import NosaLayer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_missed_blocks_land_in_their_slots(dtype):
    """The engine's store/slot layouts through kernels/gather.py: slot s of (b, h) holds block j of (b, h)."""
    torch.manual_seed(0)
    store_k, store_v = torch.randn(2, 3, 256, 16).to(dtype), torch.randn(2, 3, 256, 16).to(dtype)
    layer = SimpleNamespace(keys_host=store_k, values_host=store_v,
                            slots_k=torch.zeros(2, 3, 4, 32, 16, dtype=dtype), slots_v=torch.zeros(2, 3, 4, 32, 16, dtype=dtype))
    b, h = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([2, 0, 1, 1, 2])
    blocks, slot_ids = torch.tensor([7, 0, 3, 5, 6]), torch.tensor([3, 0, 2, 1, 0])
    _gather(layer, b, h, blocks, slot_ids)
    for i in range(5):
        rows = slice(int(blocks[i]) * 32, (int(blocks[i]) + 1) * 32)
        assert torch.equal(layer.slots_k[b[i], h[i], slot_ids[i]], store_k[b[i], h[i], rows])
        assert torch.equal(layer.slots_v[b[i], h[i], slot_ids[i]], store_v[b[i], h[i], rows])
    assert int((layer.slots_k.flatten(3).abs().sum(-1) > 0).sum()) == 5, "no other slot written"


def dense_over(layer: NosaLayer, q: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, Hq, 1, D] over the host store's keys in the selected blocks plus the tail block."""
    batch, heads, _, dim = q.shape
    out = torch.zeros(batch, heads, dim)
    block = layer.cfg.block
    for b in range(batch):
        last = int(layer.lengths[b]) - 1
        for h in range(heads):
            kv = h // layer.group
            keys = [j for j in range(last + 1) if selected[b, kv, j // block] or j // block == last // block]
            k, v = layer.keys_host[b, kv, keys].float(), layer.values_host[b, kv, keys].float()
            p = torch.softmax(k @ q[b, h, 0].float() * layer.scale, -1)
            out[b, h] = p @ v
    return out


@pytest.mark.parametrize("proxy,budget,ratio", [("vnorm", 256, 0.25), ("snapkv", 320, 0.5), ("tova", 192, 0.0), ("random", 256, 0.5)])
def test_engine_holds_and_attends_exactly_the_selected_blocks(proxy, budget, ratio):
    torch.manual_seed(1)
    cfg = make_config(budget, ratio, 32, proxy)
    layer = NosaLayer(cfg)
    batch, hkv, g, dim, n = 2, 2, 2, 8, 300
    k, v, q = torch.randn(batch, hkv, n, dim), torch.randn(batch, hkv, n, dim), torch.randn(batch, hkv * g, n, dim)
    layer.lazy_initialization(k, v)
    layer.prefill(k, v, q, torch.tensor([0, 37]), 0.35)  # sequence 1 is left-padded by 37
    assert layer.lengths.tolist() == [300, 263]
    for step in range(45):
        kn, vn, qn = torch.randn(batch, hkv, 1, dim), torch.randn(batch, hkv, 1, dim), torch.randn(batch, hkv * g, 1, dim)
        layer.update(kn, vn)
        out = layer.decode(qn)
        sel = layer.last_selected
        for b in range(batch):
            for h in range(hkv):
                mapped = layer.slot_map[b, h]
                assert set(mapped[mapped >= 0].tolist()) == set(sel[b, h].nonzero().flatten().tolist())
                for s, blk in enumerate(mapped.tolist()):
                    if blk >= 0:
                        assert torch.equal(layer.slots_k[b, h, s], layer.keys_host[b, h, blk * 32 : blk * 32 + 32])
                        assert torch.equal(layer.slots_v[b, h, s], layer.values_host[b, h, blk * 32 : blk * 32 + 32])
        tails = torch.div(layer.lengths - 1, 32, rounding_mode="floor")  # complete blocks before the tail
        assert torch.equal(sel.sum(-1), torch.minimum(tails, torch.tensor(cfg.k))[:, None].expand(-1, hkv))
        torch.testing.assert_close(out[:, 0].float(), dense_over(layer, qn, sel), atol=1e-5, rtol=1e-5)
    mem = layer.memory()
    assert mem["h2d_bytes"] > 0 and mem["blocks_moved_from_tail"] > 0 and mem["steps"] == 45


def test_generate_with_the_cache_equals_dense_when_everything_fits():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)).eval()
    ids = torch.randint(0, 300, (2, 200))
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    engine = enable_nosa(model, cfg=make_config(512, 0.25, 32, "vnorm"))
    try:
        cache = engine.new_cache()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        report = cache.memory_report()
    finally:
        disable_nosa(model)
    assert torch.equal(out, dense)
    assert "device" in report and "host" in report
    assert model.config._attn_implementation != "sparsesearch_nosa"


def test_runtime_apply_offloads_decode_from_an_artifact(tmp_path):
    """An artifact's methods.nosa through the existing runtime: runtime.apply + nosa_cache + generate()."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsesearch.artifacts import load_artifact, write_artifact
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.models import info_from_model
    from sparsesearch.runtime import apply, nosa_cache, remove

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)).eval()
    rec = {"proxy": "vnorm", "block": 32, "budget": 128, "k": 4, "k_q": 1, "k_e": 1, "kq_ratio": 0.25, "n_init": 1, "n_win": 1, "kernel": 32, "stride": 16}
    section = {"table": "nosa.parquet", "recommended": rec, "rule": "test", "sweep": {}, "configs": []}
    import pandas as pd

    info = info_from_model(model, spec="tiny-random-llama")
    path = write_artifact(tmp_path / "art", new_manifest(info, head_index_space="kv", provenance={"kind": "manual"}, methods={"nosa": section}),
                          {"heads.parquet": [], "nosa.parquet": pd.DataFrame({"config": ["x"]})})
    ids = torch.randint(0, 300, (1, 300))
    dense = model.generate(ids, max_new_tokens=4, do_sample=False)
    apply(model, load_artifact(path, model_info=info))
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), dense)  # no NOSA cache: decode as before
        cache = nosa_cache(model)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
        layer = cache.layers[0]
        assert layer.steps == 3 and layer.slot_map.ge(0).sum(-1).eq(4).all()  # 4 slots filled, 9 blocks in the cache
        assert out.shape == dense.shape and torch.equal(out[:, :301], dense[:, :301])  # first token from the prefill
    finally:
        remove(model)
    with pytest.raises(ValueError, match="no NOSA configuration"):
        nosa_cache(model)


@pytest.mark.parametrize("proxy", ["vnorm", "snapkv", "tova"])
def test_engine_selects_what_the_sweep_measured(proxy):
    """The runtime and the sweep share one definition: the same stream gives the same blocks at every step."""
    from sparsesearch.nosa import LayerInputs
    from sparsesearch.nosa.simulate import block_scores
    from sparsesearch.nosa.selection import select_blocks

    torch.manual_seed(4)
    cfg = make_config(256, 0.25, 32, proxy)
    hkv, g, dim, prompt, steps = 2, 2, 8, 290, 50
    k, v, q = torch.randn(hkv, prompt + steps, dim), torch.randn(hkv, prompt + steps, dim), torch.randn(hkv, g, prompt + steps, dim)
    sq, se, tail, _, _ = block_scores(LayerInputs(q[:, :, prompt:], k, v, q[:, :, prompt - 64 : prompt], 0.3), cfg)
    want, _ = select_blocks(sq, se, tail, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
    layer = NosaLayer(cfg)
    layer.lazy_initialization(k[None], v[None])
    layer.prefill(k[None, :, :prompt], v[None, :, :prompt], q[None, :, :, :prompt].reshape(1, hkv * g, prompt, dim), torch.tensor([0]), 0.3)
    for t in range(steps):
        p = prompt + t
        layer.update(k[None, :, p : p + 1], v[None, :, p : p + 1])
        layer.decode(q[None, :, :, p : p + 1].reshape(1, hkv * g, 1, dim))
        got = layer.last_selected[0]
        assert torch.equal(got, want[:, t, : got.shape[-1]]), t


def test_engine_on_a_hybrid_model_offloads_global_layers_only(tmp_path):
    """Gemma 3 hybrid: global layers get NosaLayers, sliding layers transformers' own cache; with a budget
    that covers the context, generate() equals dense decoding."""
    from transformers import Gemma3ForCausalLM

    from tiny_model import GEMMA_LAYER_TYPES, tiny_gemma_config

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_gemma_config()).eval()
    ids = torch.randint(0, 128, (1, 150))
    dense = model.generate(ids, max_new_tokens=4, do_sample=False)
    engine = enable_nosa(model, cfg=make_config(512, 0.25, 32, "vnorm"))
    try:
        cache = engine.new_cache()
        out = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    finally:
        disable_nosa(model)
    kinds = [isinstance(layer, NosaLayer) for layer in cache.layers]
    assert kinds == [t == "full_attention" for t in GEMMA_LAYER_TYPES]
    assert torch.equal(out, dense)
