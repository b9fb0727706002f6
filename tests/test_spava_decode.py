"""Decoding after a distributed prefill (sparsesearch/spava/decode.py) on gloo.

Two decoders: the paper's distributed decode (each rank attends the keys it owns, one all-gather of
(out, lse) per layer, lse merge) and the gather path (the cache assembled on rank 0). With l_p covering
every context token (or the exact ring) both equal greedy decoding by full forwards of the ordinary model;
at small l_p both decode over the same approximate K/V, so their step logits agree to rounding. Every rank
asserts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sparsesearch.reference import masked_attention, relative_error
from sparsesearch.spava import comm
from sparsesearch.spava.decode import decode, decode_attention, dense_generate, local_kv, owned_positions, spava_generate
from sparsesearch.spava.exact import position_mask
from sparsesearch.spava.group import spawn
from sparsesearch.spava.layout import Layout
from sparsesearch.spava.model import RankContext, tail_logits
from test_spava import one_process_group  # noqa: F401  (fixture: a gloo group of one in this process)
from tiny_model import make_tiny_gemma, make_tiny_model

STEPS = 6
LOGIT_TOL = 1e-4  # fp32 both ways; only the summation order of attention differs


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _reference(model, ids, steps=STEPS):
    """Greedy tokens by definition — each the argmax of a full forward over the prompt and the tokens before
    it, no cache — their logits fp32 [B, steps - 1, V] at the decoded positions, and the dense prefill's cache.
    (model.generate is not the oracle: on the tiny Gemma 3 it picked a token the full forward ranks second,
    by 0.025.)"""
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(input_ids=seq[:, :-1]).logits[:, ids.shape[1] :].float()
        cache = model(input_ids=ids, use_cache=True).past_key_values
    return seq[:, ids.shape[1]:], logits, cache


def _cache_in_order(cache, dense_cache, n, rank, layers, what):
    """The first n cached positions of each layer are the dense prefill's (keys and values), in position order."""
    for layer in layers:
        got, want = cache.layers[layer], dense_cache.layers[layer]
        for name in ("keys", "values"):
            a, b = getattr(got, name)[:, :, :n], getattr(want, name)[:, :, :n]
            assert a.shape == b.shape, f"rank {rank}: {what} layer {layer} {name} {tuple(a.shape)} vs {tuple(b.shape)}"
            assert relative_error(a, b) < 1e-4, f"rank {rank}: {what} layer {layer} {name} differ from dense"


def _shards_partition(model, shards, n, steps, rank, world, what):
    """Over the ranks, the LocalKVs hold each position once: the prompt and the generated tokens fed back
    (a sliding layer only those within its window of position n: the first decoded token's)."""
    from sparsesearch.spava.model import attention_windows

    got = [None] * world
    dist.all_gather_object(got, {layer: s.pos[: s.length].tolist() for layer, s in shards.items()})
    for layer, window in enumerate(attention_windows(model)):
        held = sorted(p for g in got for p in g[layer])
        first = 0 if window is None else max(0, n - window + 1)
        assert held == list(range(first, n + steps - 1)), f"rank {rank}: {what} layer {layer} holds {len(held)} keys over the ranks"


def _covering_cases(rank, world, model, ids, lay, contexts):
    """With l_p = the block (or the exact ring) both decoders give dense greedy's tokens and step logits."""
    want, want_logits, dense_cache = _reference(model, ids)
    for what, ctx_of in contexts:
        for decoder in ("distributed", "gather"):
            ctx = ctx_of()
            tokens, logits, step_logits, state = spava_generate(model, ids, ctx, STEPS, decoder=decoder)
            tag = f"{what}/{decoder}"
            assert torch.equal(tokens, want), f"rank {rank}: {tag} generated {tokens.tolist()}, dense {want.tolist()}"
            assert logits.shape == (ids.shape[0], 1, model.config.vocab_size) and ctx.kept is None
            if rank == 0:
                err = relative_error(step_logits, want_logits)
                assert err < LOGIT_TOL, f"rank {rank}: {tag} step logits vs full forwards {err:.2e}"
            else:
                assert step_logits is None
            if decoder == "distributed":
                _shards_partition(model, state, lay.n, STEPS, rank, world, tag)
            elif rank == 0:
                assert state.get_seq_length() == lay.n + STEPS - 1  # the prompt, then one position per fed token
                _cache_in_order(state, dense_cache, lay.n, rank, range(model.config.num_hidden_layers), tag)
            else:
                assert state is None and ctx.stats["cache_bytes_sent"] > 0


class _Sent:
    """Counts the bytes this rank hands to torch.distributed while active: the real collectives run, wrapped
    (all-gathers, gathers, all-reduces, sends: the input; broadcasts: the tensor, on the source only)."""

    def __enter__(self):
        self.bytes, self.saved, rank = 0, [], dist.get_rank()
        size = lambda t: t.numel() * t.element_size()
        picks = {"broadcast": lambda t, src, *a, **k: size(t) if src == rank else 0,
                 "gather": lambda t, *a, **k: size(t), "all_gather": lambda out, t, *a, **k: size(t),
                 "all_reduce": lambda t, *a, **k: size(t), "send": lambda t, *a, **k: size(t), "isend": lambda t, *a, **k: size(t),
                 "all_gather_into_tensor": lambda out, t, *a, **k: size(t)}
        for name, pick in picks.items():
            self._wrap(dist, name, pick)
        self._wrap(comm, "_ALL_GATHER", picks["all_gather_into_tensor"])
        return self

    def _wrap(self, owner, name, pick):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            self.bytes += pick(*args, **kwargs)
            return real(*args, **kwargs)

        self.saved.append((owner, name, real))
        setattr(owner, name, counted)

    def __exit__(self, *exc):
        for owner, name, real in self.saved:
            setattr(owner, name, real)


def _approximate_cases(rank, world, model, ids, lay):
    """Small l_p: both decoders decode over the same approximate K/V, so their step logits agree to rounding.
    The distributed decode moves exactly one query row's (out, lse) per layer per token (and rank 0 the
    next id): it fails if the cache, or any key, is sent. Layer 0's keys depend on the tokens alone, so the
    gathered cache still equals dense there at every position (the assembled order is right)."""
    got, sent, stats = {}, {}, {}
    for decoder in ("distributed", "gather"):
        ctx = RankContext.spava(lay, rank)
        ctx.kept = {}
        last = tail_logits(model, ids, ctx, 1, owner=rank == 0)[:, -1]
        with _Sent() as spy:
            got[decoder] = decode(model, ctx, last, STEPS, decoder)
        sent[decoder], stats[decoder] = spy.bytes, ctx.stats
    assert torch.equal(got["distributed"][0], got["gather"][0]), f"rank {rank}: approximate SPAVA, decoders disagree"
    cfg, b = model.config, ids.shape[0]
    per_token = cfg.num_hidden_layers * b * cfg.num_attention_heads * (cfg.head_dim + 1) * 4 + (8 * b if rank == 0 else 0)
    assert sent["distributed"] == (STEPS - 1) * per_token, f"rank {rank}: distributed decode sent {sent['distributed']} bytes"
    assert stats["distributed"]["decode_bytes_sent"] == (STEPS - 1) * per_token * (world - 1)  # to each peer
    if rank > 0:  # the gather path's bytes are the cache: what the distributed decode must not send
        assert sent["gather"] == stats["gather"]["cache_bytes_sent"] > 10 * sent["distributed"]
    if rank == 0:
        err = relative_error(got["distributed"][1], got["gather"][1])
        assert err < LOGIT_TOL, f"rank {rank}: approximate SPAVA, distributed vs gather step logits {err:.2e}"
        _, dense_logits, dense_cache = _reference(model, ids)
        _cache_in_order(got["gather"][2], dense_cache, lay.n, rank, [0], "approximate spava")
        # the approximation does reach the decode: the agreement above is not between two dense runs
        assert relative_error(got["distributed"][1], dense_logits) > LOGIT_TOL


def _merge_cases(rank, world):
    """decode_attention against masked attention over every key: shards by ownership, windows that leave
    some ranks (or all) without a visible key (lse = -inf), a rank that owns nothing."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, n = 2, 4, 2, 16, 40
    q, k, v = torch.randn(b, hq, 1, d, generator=g), torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    blocks = lambda p: (p // 7) % world
    for owner, window in ((blocks, None), (blocks, 5), (blocks, 12), (lambda p: 0, None), (blocks, 1)):
        mine = torch.tensor([p for p in range(n) if owner(p) == rank], dtype=torch.long)
        shard = local_kv(k, v, mine, mine.clone(), 0)
        out = decode_attention(q, None, None, shard, n, 0.3, window)
        if window == 1:  # no key is visible anywhere: every partial is empty, the merge gives 0, not NaN
            assert not out.any(), f"rank {rank}: empty merge gave {out.abs().max()}"
            continue
        want, _ = masked_attention(q, k, v, position_mask(torch.tensor([n]), torch.arange(n), window), scale=0.3)
        assert relative_error(out, want) < 1e-5, f"rank {rank}: window {window}: {relative_error(out, want):.2e}"


@pytest.mark.parametrize("keys", [300, 0])
def test_decode_partial_kernel_equals_matmuls(keys):
    """The GQA-packed rows on the block-sparse kernel (the CUDA path, here under TRITON_INTERPRET=1) against
    the fp32 matmuls and against masked attention: a shard length off the block, and an empty shard."""
    from conftest import DEVICE
    from sparsesearch.reference import error_floor
    from sparsesearch.spava.decode import decode_partial

    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(2, 6, 1, 64, generator=g), torch.randn(2, 2, keys, 64, generator=g), torch.randn(2, 2, keys, 64, generator=g)
    o_m, lse_m = decode_partial(q, k, v, 0.2, kernel=False)
    o_k, lse_k = (t.cpu() for t in decode_partial(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), 0.2, kernel=True))  # Triton: the GPU where there is one
    if keys == 0:
        assert not o_m.any() and not o_k.any() and torch.isinf(lse_m).all() and torch.isinf(lse_k).all()
        return
    want, want_lse = masked_attention(q, k, v, lambda rows: torch.ones(1, 1, rows.numel(), keys, dtype=torch.bool), scale=0.2)
    assert relative_error(o_m, want) < 1e-6 and (lse_m - want_lse).abs().max() < 1e-5
    floor = max(1e-5, error_floor(torch.float32, torch.device(DEVICE)))  # fp32 dots run as TF32 on a GPU
    assert relative_error(o_k, want) < floor and (lse_k - want_lse).abs().max() < 10 * floor


def _decode_worker(rank, world, path, ring=True):
    model = _load(path)
    lay = Layout(16 + 2 * world * 40, 9, world, 16, 40)  # l_p = the block: every context key passes
    small = Layout(201, 7, world, 13, 5)
    prompt = torch.randint(0, 1000, (2, max(lay.n, small.n)), generator=torch.Generator().manual_seed(3))
    contexts = [("spava", lambda: RankContext.spava(lay, rank))]
    contexts += [("ring", lambda: RankContext.ring(lay.n, rank, world))] if ring else []
    _covering_cases(rank, world, model, prompt[:, : lay.n], lay, contexts)
    _approximate_cases(rank, world, model, prompt[:, : small.n], small)
    _merge_cases(rank, world)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-decode"))


def test_owned_positions_partition_the_prompt():
    for world in (1, 2, 3, 4):
        lay = Layout(13 + 2 * world * 7 + 3, 5, world, 13, 4)
        for ctx_of in (lambda r: RankContext.spava(lay, r), lambda r: RankContext.ring(lay.n, r, world)):
            owned = [owned_positions(ctx_of(r), r, world) for r in range(world)]
            assert sorted(p for pos in owned for p in pos) == list(range(lay.n))
            for r, pos in enumerate(owned):  # a rank contributes only tokens it holds
                assert set(pos) <= set(ctx_of(r).pos.tolist())


def test_decode_one_process_equals_dense_greedy(tiny_llama, one_process_group):
    _decode_worker(0, 1, tiny_llama)


def test_decode_two_processes_equals_dense_greedy(tiny_llama):
    spawn(_decode_worker, 2, tiny_llama, False, timeout_s=120)  # the ring's decode: one process here, 2 in `slow`


@pytest.mark.slow
def test_decode_after_ring_two_processes(tiny_llama):
    spawn(_decode_worker, 2, tiny_llama, True, timeout_s=180)


def test_dense_generate_is_greedy(tiny_llama):
    model = _load(tiny_llama)
    ids = torch.randint(0, 1000, (1, 50), generator=torch.Generator().manual_seed(4))
    tokens, cache = dense_generate(model, ids, STEPS)
    assert torch.equal(tokens, _reference(model, ids)[0]) and cache.get_seq_length() == 50 + STEPS - 1


def _gemma_worker(rank, world, path):
    model = _load(path)
    lay = Layout(8 + 2 * world * 30, 5, world, 8, 30)
    ids = torch.randint(0, 100, (1, lay.n), generator=torch.Generator().manual_seed(5))
    want, want_logits, _ = _reference(model, ids)
    for decoder in ("distributed", "gather"):
        tokens, _, step_logits, state = spava_generate(model, ids, RankContext.spava(lay, rank), STEPS, decoder=decoder)
        assert torch.equal(tokens, want), f"rank {rank}: gemma {decoder} generated {tokens.tolist()}, dense {want.tolist()}"
        if rank == 0:
            err = relative_error(step_logits, want_logits)
            assert err < LOGIT_TOL, f"rank {rank}: gemma {decoder} step logits vs full forwards {err:.2e}"
        if decoder == "gather" and rank == 0:  # the hybrid cache: sliding layers keep their window, global layers every position
            assert type(state.layers[0]).__name__ == "DynamicSlidingWindowLayer" and state.get_seq_length() == lay.n + STEPS - 1
        if decoder == "distributed":  # sliding layers keep only keys a decoded position can see
            assert model.config.sliding_window < lay.n
            _shards_partition(model, state, lay.n, STEPS, rank, world, "gemma")


def test_decode_gemma_hybrid_one_process(tmp_path, one_process_group):
    _gemma_worker(0, 1, make_tiny_gemma(tmp_path / "gemma"))


@pytest.mark.slow
def test_decode_gemma_hybrid_two_processes(tmp_path):
    spawn(_gemma_worker, 2, make_tiny_gemma(tmp_path / "gemma"), timeout_s=120)
