"""Offloaded NOSA decode: missed blocks land in their slots through kernels/gather.py, the engine holds exactly the selected
blocks and attends exactly over them, and generate() through the Cache subclass (batch 2, different
lengths) equals dense decoding when the budget covers the context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsesearch.nosa.config import make_config
from sparsesearch.runtime.nosa_engine import _gather, disable_nosa, enable_nosa
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


def assert_slots_hold_the_selection(layer: NosaLayer) -> None:
    """Every (sequence, KV head): the slot map holds exactly the last selection, each slot the host store's block."""
    block = layer.cfg.block
    for b in range(layer.slot_map.shape[0]):
        for h in range(layer.kv_heads):
            mapped = layer.slot_map[b, h]
            assert set(mapped[mapped >= 0].tolist()) == set(layer.last_selected[b, h].nonzero().flatten().tolist())
            for s, blk in enumerate(mapped.tolist()):
                if blk >= 0:
                    assert torch.equal(layer.slots_k[b, h, s], layer.keys_host[b, h, blk * block : (blk + 1) * block])
                    assert torch.equal(layer.slots_v[b, h, s], layer.values_host[b, h, blk * block : (blk + 1) * block])


def tiny_llama(layers: int = 2):
    """A random 4-head (2 KV heads) Llama, hidden 64, vocabulary 300."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)).eval()


def ragged_batch(n: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of n tokens, the second left-padded by ``pad``: (ids, attention mask) [2, n]."""
    ids = torch.randint(0, 300, (2, n))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


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
        assert_slots_hold_the_selection(layer)
        tails = torch.div(layer.lengths - 1, 32, rounding_mode="floor")  # complete blocks before the tail
        assert torch.equal(sel.sum(-1), torch.minimum(tails, torch.tensor(cfg.k))[:, None].expand(-1, hkv))
        torch.testing.assert_close(out[:, 0].float(), dense_over(layer, qn, sel), atol=1e-5, rtol=1e-5)
    mem = layer.memory()
    assert mem["h2d_bytes"] > 0 and mem["blocks_moved_from_tail"] > 0 and mem["steps"] == 45


@pytest.mark.parametrize("proxy", ["vnorm", "h2o", "persistence"])
def test_generate_with_the_cache_equals_dense_when_everything_fits(proxy):
    model = tiny_llama()
    ids, mask = ragged_batch(200, 50)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    engine = enable_nosa(model, cfg=make_config(512, 0.25, 32, proxy))
    try:
        cache = engine.new_cache()
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        report = cache.memory_report()
    finally:
        disable_nosa(model)
    assert torch.equal(out, dense)
    assert "device" in report and "host" in report
    assert model.config._attn_implementation != "sparsesearch_nosa"


@pytest.mark.parametrize("proxy", ["vnorm", "h2o", "persistence"])
def test_runtime_apply_offloads_decode_from_an_artifact(tmp_path, proxy):
    """An artifact's methods.nosa through the existing runtime: runtime.apply + nosa_cache + generate()."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparsesearch.artifacts import load_artifact, write_artifact
    from sparsesearch.artifacts.manifest import new_manifest
    from sparsesearch.models import info_from_model
    from sparsesearch.runtime import apply, nosa_cache, remove

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)).eval()
    rec = {"proxy": proxy, "block": 32, "budget": 128, "k": 4, "k_q": 1, "k_e": 1, "kq_ratio": 0.25, "n_init": 1, "n_win": 1, "kernel": 32, "stride": 16}
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


@pytest.mark.parametrize("proxy", ["vnorm", "snapkv", "tova", "persistence"])
def test_engine_selects_what_the_sweep_measured(proxy):
    """The runtime and the sweep share one definition: the same stream gives the same blocks at every step."""
    from sparsesearch.nosa import LayerInputs
    from sparsesearch.nosa.simulate import block_scores
    from sparsesearch.runtime.nosa_selection import select_blocks

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


# ------------------------------------------------------------------ h2o and persistence: the engine's reading


class Recorder:
    """What one engine layer saw, for brute-force references: each sequence's prompt queries (own
    coordinates), and per decode step the query, the selection and the per-token scores after the step.
    It wraps the layer's own prefill/decode (the real ones run)."""

    def __init__(self, layer: NosaLayer):
        self.layer, self.steps = layer, []
        prefill, decode = layer.prefill, layer.decode

        def recorded_prefill(keys, values, queries, starts, scale):
            self.prompt = [queries[b, :, int(starts[b]):].float().clone() for b in range(queries.shape[0])]
            prefill(keys, values, queries, starts, scale)
            self.prefill_scores = layer.scores.clone()

        def recorded_decode(query):
            out = decode(query)
            self.steps.append(SimpleNamespace(q=query[:, :, 0].float().clone(), selected=layer.last_selected.clone(),
                                              scores=layer.scores.clone(), lengths=layer.lengths.clone()))
            return out

        layer.prefill, layer.decode = recorded_prefill, recorded_decode

    def row(self, b: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row r of sequence b: its query [Hq, D] and the keys it attended, bool [Hkv, r + 1] (a prompt row:
        every key up to r; a decode row: its selected blocks and its tail block up to r)."""
        layer, block = self.layer, self.layer.cfg.block
        n0 = self.prompt[b].shape[1]
        if r < n0:
            return self.prompt[b][:, r], torch.ones(layer.kv_heads, r + 1, dtype=torch.bool)
        step = self.steps[r - n0]
        key_block = torch.arange(r + 1) // block
        return step.q[b], step.selected[b][:, key_block] | (key_block == r // block)[None]

    def refresh_at(self, b: int, last: int) -> int:
        """The refresh position in force at a step whose token is at ``last``: the prompt's end, or the
        latest block start decoded since."""
        n0, block = self.prompt[b].shape[1], self.layer.cfg.block
        return max([n0, *[p for p in range(n0, last + 1) if p % block == 0]])


def brute_h2o(rec: Recorder, b: int, p: int) -> torch.Tensor:
    """The engine's h2o reading recomputed from the rows it saw: each row r < p adds its attention over
    the keys it attended (summed over the group); divided by p - i, the rows that could see token i.
    Returns [Hkv, p] (tokens >= p score 0)."""
    layer = rec.layer
    rows = [rec.row(b, r) for r in range(p)]
    q = torch.stack([q for q, _ in rows], 1).view(layer.kv_heads, layer.group, p, -1)
    attended = torch.zeros(layer.kv_heads, p, p, dtype=torch.bool)  # [Hkv, row, key]
    for r, (_, keys_of_row) in enumerate(rows):
        attended[:, r, : r + 1] = keys_of_row
    logits = torch.einsum("hgrd,htd->hgrt", q, layer.keys_host[b, :, :p].float()) * layer.scale
    probs = torch.softmax(logits.masked_fill(~attended[:, None], float("-inf")), -1)
    return probs.sum((1, 2)) / (p - torch.arange(p)).float()


def brute_persistence_set(rec: Recorder, b: int, r: int) -> list[set[int]]:
    """Row r's persistence set per KV head, by loops: compressed keys as window means, per-head softmax
    summed over the group, block max over units [ratio*j - 1, ratio*j + ratio - 1], sink and window
    forced, then the best blocks by (score desc, block asc) up to sink + window + max(k_q, k/4)."""
    layer, cfg = rec.layer, rec.layer.cfg
    q, _ = rec.row(b, r)
    keys = layer.keys_host[b].float()
    units = range((r + 1 - cfg.kernel) // cfg.stride + 1) if r + 1 >= cfg.kernel else range(0)
    tail, size = r // cfg.block, cfg.n_init + cfg.n_win + max(cfg.k_q, cfg.k // 4)
    sets = []
    for h in range(layer.kv_heads):
        c = torch.stack([keys[h, m * cfg.stride : m * cfg.stride + cfg.kernel].mean(0) for m in units]) if len(units) else torch.zeros(0, keys.shape[-1])
        p_units = sum(torch.softmax(c @ q[h * layer.group + g] * layer.scale, -1) for g in range(layer.group)) if len(units) else c[:, 0]
        def score(j):
            got = [float(p_units[m]) for m in range(cfg.ratio * j - 1, cfg.ratio * j + cfg.ratio) if 0 <= m < len(units)]
            return max(got) if got else float("-inf")
        forced = {j for j in range(tail) if j < cfg.n_init or j >= tail - cfg.n_win}
        rest = sorted((j for j in range(tail) if j not in forced), key=lambda j: (-score(j), j))
        sets.append(forced | set(rest[: max(0, size - len(forced))]))
    return sets


def brute_persistence(rec: Recorder, b: int, p: int) -> torch.Tensor:
    """Persistence at p: the fraction of rows p - block .. p - 1 whose set holds block(i), [Hkv, p]."""
    block = rec.layer.cfg.block
    rows = range(max(0, p - block), p)
    counts = torch.zeros(rec.layer.kv_heads, -(-p // block))
    for r in rows:
        for h, members in enumerate(brute_persistence_set(rec, b, r)):
            counts[h, sorted(members)] += 1
    return (counts / len(rows)).repeat_interleave(block, -1)[:, :p]


BRUTE = {"h2o": brute_h2o, "persistence": brute_persistence}


def check_scores_against_brute_force(rec: Recorder) -> int:
    """At the prefill and at every step: the per-token scores equal the brute-force reading at the refresh
    in force, and they are frozen (bit for bit) between refreshes. Returns the refreshes checked."""
    layer, checked = rec.layer, 0
    brute = BRUTE[layer.cfg.proxy]
    for b, prompt in enumerate(rec.prompt):
        n0 = prompt.shape[1]
        want = brute(rec, b, n0)
        torch.testing.assert_close(rec.prefill_scores[b, :, :n0], want, rtol=1e-5, atol=1e-6)
        previous, prev_p = rec.prefill_scores[b], n0
        for step in rec.steps:
            last = int(step.lengths[b]) - 1
            p = rec.refresh_at(b, last)
            got = step.scores[b, :, : last + 1]
            if p == prev_p:  # frozen inside a block: condition (2) of the locality bound
                assert torch.equal(got, previous[:, : last + 1]), (b, last)
                continue
            want = torch.zeros_like(got)
            want[:, :p] = brute(rec, b, p)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            previous, prev_p, checked = step.scores[b], p, checked + 1
    return checked


def random_stream(layer: NosaLayer, *, steps: int, seed: int, pads=(0, 37), n: int = 300, hkv: int = 2, g: int = 2, dim: int = 8):
    """Prefill a batch of 2 left-padded random sequences, then ``steps`` random decode tokens; yields after each."""
    torch.manual_seed(seed)
    batch = len(pads)
    k, v, q = torch.randn(batch, hkv, n, dim), torch.randn(batch, hkv, n, dim), torch.randn(batch, hkv * g, n, dim)
    layer.lazy_initialization(k, v)
    layer.prefill(k, v, q, torch.tensor(pads), 0.35)
    for _ in range(steps):
        kn, vn, qn = torch.randn(batch, hkv, 1, dim), torch.randn(batch, hkv, 1, dim), torch.randn(batch, hkv * g, 1, dim)
        layer.update(kn, vn)
        yield layer.decode(qn), qn


@pytest.mark.parametrize("proxy,budget,ratio", [("h2o", 192, 0.25), ("persistence", 192, 0.0), ("persistence", 256, 0.5)])
def test_h2o_and_persistence_equal_a_brute_force_of_the_engines_reading(proxy, budget, ratio):
    """Random streams, batch 2 of different lengths (one left-padded): the scores at each refresh equal the
    reading recomputed from every row the layer saw, and stay frozen between refreshes."""
    layer = NosaLayer(make_config(budget, ratio, 32, proxy))
    rec = Recorder(layer)
    for _ in random_stream(layer, steps=46, seed=5, n=280):  # block starts at 288, 320 and 256, 288
        pass
    assert check_scores_against_brute_force(rec) >= 4  # two block starts per sequence at least
    assert layer.scores.abs().sum() > 0


def test_engine_h2o_is_the_sweeps_when_the_budget_covers_the_context():
    """With every block resident a decode row attends every key, so the engine's h2o is the sweep's
    (proxies.proxy_versions over dense rows)."""
    from sparsesearch.runtime.nosa_proxies import h2o_column_sums, proxy_versions

    cfg = make_config(1024, 0.25, 32, "h2o")
    layer = NosaLayer(cfg)
    rec = Recorder(layer)
    for _ in random_stream(layer, steps=40, seed=6, pads=(0,), n=200):
        pass
    n = int(layer.lengths[0])
    k, v = layer.keys_host[0, :, :n], layer.values_host[0, :, :n]
    q = torch.cat([rec.prompt[0], torch.stack([s.q[0] for s in rec.steps], 1)], 1).view(layer.kv_heads, layer.group, n, -1)
    colsum = torch.zeros(layer.kv_heads, n)
    colsum[:, :200] = h2o_column_sums(q[:, :, :200], k[:, :200], layer.scale)
    refresh = [200, 224]
    want = proxy_versions("h2o", k=k, v=v, rows_q=q[:, :, 200:], rows_pos=torch.arange(200, n), refresh=refresh, scale=layer.scale, colsum_before=colsum)
    torch.testing.assert_close(rec.prefill_scores[0, :, :n], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rec.steps[-1].scores[0, :, :n], want[1], rtol=1e-5, atol=1e-6)


def locality_holds(cfg, previous: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """gamma >= (k - k_q)/k per (sequence, KV head) in integers: |S_t & S_t-1| * k >= (k - k_q) * |S_t|."""
    n = min(previous.shape[-1], selected.shape[-1])
    inter = (previous[..., :n] & selected[..., :n]).sum(-1)
    return inter * cfg.k >= (cfg.k - cfg.k_q) * selected.sum(-1)


@pytest.mark.parametrize("proxy", ["snapkv", "h2o", "tova", "vnorm", "persistence", "random"])
def test_the_locality_bound_holds_at_every_step_inside_a_block(proxy):
    """Scores are frozen between refreshes, so with n_win >= 2 (docs/peers.md "NOSA fine print") every step that
    does not start a block keeps gamma >= (k - k_q)/k, for every sequence of a ragged batch and KV head."""
    cfg = make_config(320, 0.25, 32, proxy)
    assert cfg.n_win >= 2 and cfg.k_q > 0
    layer = NosaLayer(cfg)
    previous, checked = None, 0
    for _ in random_stream(layer, steps=40, seed=7, n=600):  # 18 candidate blocks for k = 10; a block start in each sequence
        selected, last = layer.last_selected.clone(), layer.lengths - 1
        if previous is not None:
            inside = (last % cfg.block != 0)[:, None].expand(-1, selected.shape[1])
            assert locality_holds(cfg, previous, selected)[inside].all()
            checked += int(inside.sum())
        previous = selected
    assert checked > 120


@pytest.mark.parametrize("proxy", ["h2o", "persistence"])
def test_generate_runs_h2o_and_persistence_as_their_brute_force_reading(proxy):
    """generate() on a tiny Llama, batch 2 of different lengths, a budget below the context: in every
    offloaded layer the slots hold exactly the selected blocks, and the scores equal the brute-force
    reading of the rows the layer saw at every refresh (and are frozen in between)."""
    model = tiny_llama(layers=1)
    ids, mask = ragged_batch(300, 45)
    engine = enable_nosa(model, cfg=make_config(192, 0.25, 32, proxy))
    try:
        cache = engine.new_cache()
        recorders = [Recorder(layer) for layer in cache.layers]
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=25, min_new_tokens=25, do_sample=False)
    finally:
        disable_nosa(model)
    assert out.shape == (2, 325)
    for rec in recorders:
        layer = rec.layer
        assert len(rec.steps) == 24 and layer.lengths.tolist() == [324, 279]
        assert check_scores_against_brute_force(rec) == 2  # block starts at 320 and 256
        assert_slots_hold_the_selection(layer)
        assert layer.last_selected.sum(-1).eq(layer.cfg.k).all()  # 10 and 8 candidate blocks for k = 6


def test_a_swept_h2o_recommendation_runs_in_the_runtime(tmp_path):
    """sparsesearch sweep-nosa --proxy h2o writes methods.nosa; runtime.apply loads it and generate() runs
    through the offload engine with h2o; `sparsesearch evaluate` takes the artifact. A recommendation the
    model cannot run (proxy 'trained' on a stock model) is one error line and exit 2. (persistence from an
    artifact: test_runtime_apply_offloads_decode_from_an_artifact.)"""
    import json

    from typer.testing import CliRunner

    from sparsesearch.artifacts import load_artifact
    from sparsesearch.models import load_model
    from sparsesearch.runtime import apply, nosa_cache, remove
    from sparsesearch_cli.app import app
    from tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", layers=2, heads=4, kv_heads=2)
    out = tmp_path / "art"
    args = ["sweep-nosa", "--model", model_dir, "--budget", "128", "--kq-ratio", "0.25", "--block-size", "32", "--context", "300",
            "--decode-steps", "8", "--proxy", "h2o", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    art = load_artifact(out)
    assert art.manifest["methods"]["nosa"]["recommended"]["proxy"] == "h2o"
    model, _, _ = load_model(model_dir, dtype="float32", device="cpu")
    ids = torch.randint(0, 1000, (1, 220))
    apply(model, art)
    try:
        cache = nosa_cache(model)
        model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, past_key_values=cache)  # a refresh at 224
        layer = cache.layers[0]
        assert layer.cfg.proxy == "h2o" and layer.steps == 9 and layer.scores[0, :, :224].gt(0).all()
        assert layer.last_selected.sum(-1).eq(layer.cfg.k).all()
    finally:
        remove(model)
    evaluated = CliRunner().invoke(app, ["evaluate", str(out), "--model", model_dir, "--samples", "1", "--tokens", "128", "--min-tokens", "64", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["methods"]["nosa"]["recommended"]["proxy"] = "trained"
    (out / "manifest.json").write_text(json.dumps(manifest))
    refused = CliRunner().invoke(app, ["evaluate", str(out), "--model", model_dir, "--samples", "1", "--tokens", "128", "--min-tokens", "64"])
    errors = [line for line in refused.output.splitlines() if "error" in line]
    assert refused.exit_code == 2 and len(errors) == 1 and "eviction head" in errors[0], refused.output


def test_config_from_artifact_names_what_it_cannot_run():
    from sparsesearch.runtime.nosa_engine import config_from_artifact

    rec = {"proxy": "h2o", "block": 32, "k": 6, "k_q": 1, "n_init": 1, "n_win": 1, "kernel": 32, "stride": 16}
    art = lambda r: SimpleNamespace(manifest={"methods": {"nosa": {"recommended": r}}})  # noqa: E731
    assert config_from_artifact(art(rec)).proxy == "h2o"
    for bad, match in (({"proxy": "lru"}, "proxy 'lru' is unknown"), ({"block": 40}, "block 40 is not a positive multiple"),
                       ({"k_q": 5}, "k 6 < sink 1 \\+ window 1 \\+ k_q 5")):
        with pytest.raises(ValueError, match=match):
            config_from_artifact(art(rec | bad))
    with pytest.raises(ValueError, match="lacks stride"):
        config_from_artifact(art({key: val for key, val in rec.items() if key != "stride"}))


@pytest.mark.slow
def test_smollm2_generates_with_h2o_and_persistence():
    """The real SmolLM2-135M (30 layers, GQA 9/3), a ragged batch of 2 over 600 tokens of text, budget
    256 (k = 8 of up to 18 blocks): in the first and last layers the scores equal the brute-force reading at
    every refresh, and the locality bound holds at every step inside a block in every layer."""
    from conftest import smollm2_gguf

    from sparsesearch.models import load_model

    smollm2_gguf()
    model, tokenizer, _ = load_model("smollm2-135m", dtype="float32", device="cpu")
    text = " ".join(f"Line {i}: the river runs past the mill and the miller counts {i * 7} sacks of grain." for i in range(60))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :600].expand(2, -1).clone()
    mask = torch.ones_like(ids)
    mask[1, :70] = 0
    for proxy in ("h2o", "persistence"):
        cfg = make_config(256, 0.25, 32, proxy)
        engine = enable_nosa(model, cfg=cfg)
        try:
            cache = engine.new_cache()
            recorders = [Recorder(layer) for layer in cache.layers]
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        finally:
            disable_nosa(model)
        for rec in (recorders[0], recorders[-1]):
            assert check_scores_against_brute_force(rec) == 2  # block starts at 608 and 544
        for rec in recorders:
            previous = rec.steps[0].selected
            for step in rec.steps[1:]:
                inside = ((step.lengths - 1) % cfg.block != 0)[:, None].expand(-1, previous.shape[1])
                assert locality_holds(cfg, previous, step.selected)[inside].all(), proxy
                previous = step.selected
