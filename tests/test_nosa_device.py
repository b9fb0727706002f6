"""The sync-free NOSA decoder (runtime/nosa_device.py) against brute force on the whole history: selection (Eq. 3-5
with agnostic scores frozen between block starts), the host store, the slot contents, attention over the
selected blocks plus the tail, and the fetch list sized by the locality bound (nothing dropped)."""

import pytest
import torch

from sparsesearch.runtime.nosa_config import NosaConfig
from sparsesearch.runtime.nosa_device import SlotDecoder, token_scores
from sparsesearch.runtime.nosa_selection import agnostic_unit_scores, compress, pool_blocks, query_unit_scores, select_blocks, unit_count


def _config(proxy: str, block: int = 32, k: int = 6, k_q: int = 2) -> NosaConfig:
    return NosaConfig(block=block, k=k, k_q=k_q, n_init=1, n_win=1, proxy=proxy)


def _brute_select(cfg, keys, scores, q, frozen_se, group, n_blocks):
    """keys [Hkv, n, D] and per-token scores [Hkv, n] of one sequence, q [Hq, D] -> selected bool [Hkv, N]."""
    heads, n, dim = keys.shape
    units = compress(keys.double(), cfg.kernel, cfg.stride)
    m = units.shape[1]
    n_units = torch.tensor([m])
    sq = query_unit_scores(q.double().view(heads, group, 1, dim), units, n_units, dim ** -0.5)[:, 0]
    sq = pool_blocks(sq, n_blocks, cfg.ratio)
    tail = torch.tensor([(n - 1) // cfg.block])
    sel, _ = select_blocks(sq[:, None], frozen_se[:, None], tail, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
    return sel[:, 0]


def _brute_se(cfg, scores, n, n_blocks):
    """Agnostic block scores from per-token scores [Hkv, n]."""
    m = unit_count(n, cfg.kernel, cfg.stride)
    units = agnostic_unit_scores(scores[:, None, :n].double(), torch.tensor([m]), cfg.kernel, cfg.stride)[:, 0]
    return pool_blocks(units, n_blocks, cfg.ratio)


@pytest.mark.parametrize("proxy,block,k,k_q", [("vnorm", 32, 6, 2), ("trained", 32, 6, 2), ("random", 16, 8, 3), ("vnorm", 16, 4, 0)])
def test_decoder_matches_brute_force(proxy, block, k, k_q):
    torch.manual_seed(block + k + k_q)
    cfg = _config(proxy, block, k, k_q)
    batch, heads, group, dim = 2, 2, 2, 16
    lengths = torch.tensor([block * 5 + 7, block * 3 + block - 1])  # one sequence one token short of a block
    steps = block + 6  # crosses one block start in each sequence
    capacity = int(lengths.max()) + steps + 1
    eviction = (torch.randn(heads, dim, dtype=torch.float64), torch.rand(heads, dtype=torch.float64) + 0.5) if proxy == "trained" else None
    dec = SlotDecoder(cfg, batch=batch, kv_heads=heads, group=group, dim=dim, capacity=capacity, dtype=torch.float64, device="cpu", eviction=eviction, seed=3)
    n0 = int(lengths.max())
    keys, values = torch.randn(batch, heads, n0, dim, dtype=torch.float64), torch.randn(batch, heads, n0, dim, dtype=torch.float64)
    dec.prefill(keys, values, lengths)
    hist_k = [keys[b, :, : int(lengths[b])] for b in range(batch)]
    hist_v = [values[b, :, : int(lengths[b])] for b in range(batch)]
    frozen = [_brute_se(cfg, token_scores(proxy, hist_v[b], eviction, torch.arange(hist_v[b].shape[1]), 3), hist_v[b].shape[1], dec.n_blocks) for b in range(batch)]
    fetched = 0
    for _ in range(steps):
        q = torch.randn(batch, heads * group, dim, dtype=torch.float64)
        k_new, v_new = torch.randn(batch, heads, dim, dtype=torch.float64), torch.randn(batch, heads, dim, dtype=torch.float64)
        before = dec.slot_map.clone()
        out = dec.step(q, k_new, v_new)
        for b in range(batch):
            hist_k[b] = torch.cat([hist_k[b], k_new[b, :, None]], 1)
            hist_v[b] = torch.cat([hist_v[b], v_new[b, :, None]], 1)
            n = hist_k[b].shape[1]
            scores = token_scores(proxy, hist_v[b], eviction, torch.arange(n), 3)
            if (n - 1) % block == 0:  # a new block: the agnostic order is refreshed here only
                frozen[b] = _brute_se(cfg, scores, n, dec.n_blocks)
            want = _brute_select(cfg, hist_k[b], scores, q[b], frozen[b], group, dec.n_blocks)
            assert torch.equal(dec.last_selected[b], want)
            # the host store holds the whole history; the slots hold exactly the selected blocks
            assert torch.equal(dec.keys_host[b, :, :n], hist_k[b])
            assert torch.equal(dec.values_host[b, :, :n], hist_v[b])
            for h in range(heads):
                resident = sorted(int(x) for x in dec.slot_map[b, h] if x >= 0)
                assert resident == want[h].nonzero().flatten().tolist()
                for s, blk in enumerate(dec.slot_map[b, h].tolist()):
                    if blk >= 0:
                        assert torch.equal(dec.slots_k[b, h, s * block:(s + 1) * block], hist_k[b][h, blk * block:(blk + 1) * block])
                # attention = dense softmax over the selected blocks' tokens and the tail's
                tail0 = (n - 1) // block * block
                tokens = torch.cat([torch.arange(j * block, (j + 1) * block) for j in want[h].nonzero().flatten().tolist()] + [torch.arange(tail0, n)])
                logits = q[b, h * group:(h + 1) * group] @ hist_k[b][h, tokens].T * dim ** -0.5
                if proxy == "trained":
                    logits = logits + scores[h, tokens]
                ref = torch.softmax(logits, -1) @ hist_v[b][h, tokens]
                tol = 1e-6 if proxy == "trained" else 1e-9  # float32 scores, reduced in another batch shape
                torch.testing.assert_close(out[b, h * group:(h + 1) * group], ref, rtol=tol, atol=tol)
        fetched += int(((dec.slot_map >= 0) & ~((before >= 0) & (dec.slot_map == before))).sum())
    assert int(dec.dropped) == 0
    assert int(dec.fetched) == fetched


def test_decoder_bf16_keeps_the_bound_and_drops_nothing():
    torch.manual_seed(0)
    cfg = _config("vnorm", 32, 8, 2)
    dec = SlotDecoder(cfg, batch=3, kv_heads=2, group=4, dim=32, capacity=700, dtype=torch.bfloat16, device="cpu")
    lengths = torch.tensor([500, 431, 320])
    dec.prefill(torch.randn(3, 2, 500, 32, dtype=torch.bfloat16), torch.randn(3, 2, 500, 32, dtype=torch.bfloat16), lengths)
    prev = None
    for _ in range(100):
        dec.step(torch.randn(3, 8, 32, dtype=torch.bfloat16), torch.randn(3, 2, 32, dtype=torch.bfloat16), torch.randn(3, 2, 32, dtype=torch.bfloat16))
        sel = dec.last_selected
        starts = (dec.lengths - 1) % cfg.block == 0
        if prev is not None:
            kept = (sel & prev).sum(-1)
            stable = ~starts[:, None].expand_as(kept)
            assert bool((kept[stable] >= cfg.k - cfg.k_q).all())  # at most k_q new blocks inside a block
        prev = sel
    assert int(dec.dropped) == 0


def test_decoder_refuses_history_proxies_and_missing_head():
    with pytest.raises(ValueError, match="snapkv"):
        SlotDecoder(_config("snapkv"), batch=1, kv_heads=1, group=1, dim=8, capacity=64, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="eviction head"):
        SlotDecoder(_config("trained"), batch=1, kv_heads=1, group=1, dim=8, capacity=64, dtype=torch.float32, device="cpu")
