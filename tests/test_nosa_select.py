"""The fused NOSA step (kernels/nosa_select.py and nosa_append.py, through SlotDecoder(fused=True)) against the
torch path of the same decoder, which tests/test_nosa_device.py checks against brute force: the same
selected blocks, slot map, fetch counts and attention output at every step, over block starts, several
tiles of units and blocks, GQA groups that pad the dot, batches of different lengths, exact ties, and the
trained proxy's logit bias. bf16 is checked against its own selection (the torch path rounds the query
logits to bf16, the kernel keeps them in fp32, so near-ties may differ)."""

import pytest
import torch
from conftest import DEVICE

from sparsesearch.kernels.nosa_select import SelectScratch, select_and_map
from sparsesearch.runtime.nosa_config import NosaConfig
from sparsesearch.runtime.nosa_device import SlotDecoder


def _pair(cfg, lengths, *, heads=2, group=2, dim=16, steps=20, dtype=torch.float32, seed=0, same_keys=False, attention=None):
    """A torch-path and a fused decoder (its attention: ``attention``, default the Triton slot attention) over
    one random prompt; yields (decoders, q, outputs) after every step."""
    torch.manual_seed(seed)
    batch = lengths.numel()
    eviction = (torch.randn(heads, dim, device=DEVICE), torch.rand(heads, device=DEVICE) + 0.5) if cfg.proxy == "trained" else None
    capacity = int(lengths.max()) + steps + 1
    decs = [SlotDecoder(cfg, batch=batch, kv_heads=heads, group=group, dim=dim, capacity=capacity, dtype=dtype, device=DEVICE,
                        eviction=eviction, seed=3, fused=fused, attention=attention if fused else None) for fused in (False, True)]
    n0 = int(lengths.max())
    keys = torch.ones(batch, heads, n0, dim, dtype=dtype) if same_keys else torch.randn(batch, heads, n0, dim, dtype=dtype)
    values = torch.ones_like(keys) if same_keys else torch.randn(batch, heads, n0, dim, dtype=dtype)
    for d in decs:
        d.prefill(keys.to(DEVICE), values.to(DEVICE), lengths.to(DEVICE))
    for i in range(steps):
        # same_keys: q = 0 too, so every logit is exactly 0 (a dot's rounding can differ between columns)
        q = torch.zeros(batch, heads * group, dim, dtype=dtype) if same_keys else torch.randn(batch, heads * group, dim, dtype=dtype)
        k_new = torch.ones(batch, heads, dim, dtype=dtype) if same_keys else torch.randn(batch, heads, dim, dtype=dtype)
        v_new = torch.ones_like(k_new) if same_keys else torch.randn(batch, heads, dim, dtype=dtype)
        q, k_new, v_new = q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE)
        yield decs, q, [d.step(q, k_new, v_new) for d in decs]


CASES = [
    # proxy, block, k, k_q, lengths, group: block starts in every run; the long one spans 2 tiles of units and blocks
    ("vnorm", 32, 6, 2, [167, 127], 2),
    ("trained", 32, 6, 2, [167, 127], 2),
    ("random", 16, 8, 3, [90, 47, 200], 4),
    ("vnorm", 16, 4, 0, [95, 64], 1),
    ("trained", 16, 24, 6, [1400, 1100], 4),
]


@pytest.mark.parametrize("proxy,block,k,k_q,lengths,group", CASES, ids=[f"{c[0]}-b{c[1]}-k{c[2]}-kq{c[3]}-n{max(c[4])}" for c in CASES])
def test_fused_step_equals_the_torch_path(proxy, block, k, k_q, lengths, group):
    cfg = NosaConfig(block=block, k=k, k_q=k_q, n_init=1, n_win=1, proxy=proxy)
    steps = block + 4 if max(lengths) < 1000 else 18  # crosses a block start in every sequence (the long case: in some)
    for decs, _, (plain, fused) in _pair(cfg, torch.tensor(lengths), group=group, steps=steps):
        assert torch.equal(decs[0].last_selected, decs[1].last_selected)
        assert torch.equal(decs[0].slot_map, decs[1].slot_map)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        # the fused append wrote the token where the torch path does (kernels/nosa_append.py)
        for name in ("slots_k", "slots_v", "ring"):
            assert torch.equal(getattr(decs[0], name), getattr(decs[1], name)), name
        for b, n in enumerate(decs[0].lengths.tolist()):  # the stores are uninitialised past each length
            assert torch.equal(decs[0].keys_host[b, :, :n], decs[1].keys_host[b, :, :n])
            assert torch.equal(decs[0].values_host[b, :, :n], decs[1].values_host[b, :, :n])
        torch.testing.assert_close(decs[1].units, decs[0].units, rtol=1e-6, atol=1e-6)
        for b, n in enumerate(decs[0].lengths.tolist()):
            torch.testing.assert_close(decs[1].scores[b, :, :n], decs[0].scores[b, :, :n], rtol=1e-6, atol=1e-6)
    assert torch.equal(decs[0].counters, decs[1].counters) and int(decs[1].dropped) == 0


def test_ties_resolve_to_the_lower_block_like_the_stable_sort():
    """Identical keys and values and a zero query: every block scores exactly the same on both sides, so the
    order is the index."""
    cfg = NosaConfig(block=16, k=5, k_q=2, n_init=1, n_win=1, proxy="vnorm")
    for decs, _, _ in _pair(cfg, torch.tensor([150, 99]), steps=20, same_keys=True):
        assert torch.equal(decs[0].last_selected, decs[1].last_selected)
        assert torch.equal(decs[0].slot_map, decs[1].slot_map)
    sel = decs[1].last_selected[0, 0].nonzero().flatten().tolist()
    tail = (int(decs[1].lengths[0]) - 1) // 16
    assert sel == [0, 1, 2, 3, tail - 1]  # sink, then the lowest blocks, then the window


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_bf16_fused_attends_exactly_its_selection_and_keeps_the_bound(attention):
    """bf16: the slots hold exactly the kernel's own selection (as the host store has it: the Triton
    attention fetched the missed blocks itself), the output is attention over exactly that slot map
    (eviction bias included; for SDPA the kernel's mask is the one the torch path builds from it); inside
    a block at most k_q selected blocks are new."""
    cfg = NosaConfig(block=16, k=8, k_q=2, n_init=1, n_win=1, proxy="trained")
    prev = None
    for decs, q, (_, out) in _pair(cfg, torch.tensor([300, 211]), heads=2, group=4, dim=32, steps=24, dtype=torch.bfloat16, seed=1,
                                   attention=attention):
        dec = decs[1]
        sel = dec.last_selected.cpu()
        if prev is not None:
            stable = ((dec.lengths.cpu() - 1) % cfg.block != 0)[:, None].expand(-1, sel.shape[1])
            assert bool(((sel & prev).sum(-1)[stable] >= cfg.k - cfg.k_q).all())
        prev = sel
        for b in range(2):
            for h in range(2):
                resident = sorted(int(x) for x in dec.slot_map[b, h] if x >= 0)
                assert resident == sel[b, h].nonzero().flatten().tolist()
                for slot, blk in enumerate(dec.slot_map[b, h].tolist()):
                    if blk >= 0:
                        assert torch.equal(dec.slots_k[b, h, slot * 16:(slot + 1) * 16].cpu(), dec.keys_host[b, h, blk * 16:(blk + 1) * 16])
                        assert torch.equal(dec.slots_v[b, h, slot * 16:(slot + 1) * 16].cpu(), dec.values_host[b, h, blk * 16:(blk + 1) * 16])
        want = dec._mask(q)
        if attention == "triton":  # against float32 attention over the same slots and float32 bias (bf16 SDPA rounds both)
            ref = torch.nn.functional.scaled_dot_product_attention(q.view(2, 2, 4, 32).float(), dec.slots_k.float(), dec.slots_v.float(),
                                                                   attn_mask=dec._mask(q.float()), scale=dec.scale)
            torch.testing.assert_close(out.float(), ref.reshape(2, 8, 32), rtol=2 ** -7, atol=2 ** -7)  # about 1 bf16 ulp
            continue
        mask = dec.scratch.mask.view(2, 2, 1, -1)
        assert torch.equal(torch.isinf(mask), torch.isinf(want))
        # the bias within one bf16 step: the interpreter's float32 -> bf16 cast need not round as torch's does
        torch.testing.assert_close(mask.float(), want.float(), rtol=2 ** -7, atol=0)
        assert torch.equal(out, dec.attend(q, mask))  # the step attended with that mask
    assert int(dec.dropped) == 0


def test_fused_selection_refuses_shapes_it_cannot_tile():
    scratch = SelectScratch(1, 1, 4, 4, 2, 32, torch.float32, "cpu")
    units = torch.zeros(1, 1, 4, 24)
    args = (units, torch.zeros(1, 1, 24), torch.tensor([100]), torch.zeros(1, 1, 4), torch.zeros(1, 1, 128),
            torch.full((1, 1, 2), -1), torch.zeros(2, dtype=torch.long), scratch)
    kw = dict(block=32, k=2, k_q=1, n_init=1, n_win=0, kernel=32, stride=16, ranks=2, scale=1.0, bias=False)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16 for the fused selection, got 24"):
        select_and_map(*args, **kw)
    with pytest.raises(ValueError, match="block 40 must be a multiple of the pooling stride 16"):
        select_and_map(*args, **{**kw, "block": 40})


def test_narrow_tiles_give_the_same_steps(monkeypatch):
    """Tiles narrower than the rows (several unit chunks and block chunks per pair): the chunked softmax
    merge gives the torch path's steps."""
    from sparsesearch.kernels import nosa_select

    for name, value in (("BLOCK_UNITS", 16), ("BLOCK_BLOCKS", 16)):
        monkeypatch.setattr(nosa_select, name, value)
    cfg = NosaConfig(block=16, k=12, k_q=4, n_init=1, n_win=2, proxy="trained")
    for decs, _, (plain, fused) in _pair(cfg, torch.tensor([700, 515]), group=4, steps=6):
        assert torch.equal(decs[0].last_selected, decs[1].last_selected)
        assert torch.equal(decs[0].slot_map, decs[1].slot_map)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert decs[1].scratch.stats.shape[1] > 1


def test_fused_append_refuses_what_it_cannot_score_or_tile():
    from sparsesearch.kernels.nosa_append import append_token

    x = torch.zeros(1, 1, 24)
    kw = dict(eviction=None, seed=0, block=32, kernel=32, stride=16)
    with pytest.raises(ValueError, match="the fused append scores trained, vnorm, random, got proxy 'snapkv'"):
        append_token(x, x, torch.zeros(1, dtype=torch.long), *[x] * 7, proxy="snapkv", **kw)
    with pytest.raises(ValueError, match="head_dim 24 and the pooling kernel 32 must be powers of two"):
        append_token(x, x, torch.zeros(1, dtype=torch.long), *[x] * 7, proxy="vnorm", **kw)


@pytest.mark.parametrize("splits", [3, 8])
def test_split_slot_attention_merges_to_the_same_steps(monkeypatch, splits):
    """The slot attention split along the slots (flash-decoding; 8 splits of 2 slots leave the last split
    empty: max -inf, weight 0 in the merge) gives the torch path's steps."""
    from sparsesearch.runtime import nosa_device as device

    monkeypatch.setattr(device, "default_splits", lambda pairs, slots, dev: splits)
    cfg = NosaConfig(block=16, k=12, k_q=4, n_init=1, n_win=2, proxy="trained")
    for decs, _, (plain, fused) in _pair(cfg, torch.tensor([400, 215]), group=4, steps=6):
        assert torch.equal(decs[0].slot_map, decs[1].slot_map)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert decs[1].attend_scratch.splits == splits


def test_slot_attention_refuses_what_it_cannot_serve():
    cfg = NosaConfig(block=16, k=4, k_q=1, n_init=1, n_win=1, proxy="vnorm")
    kw = dict(batch=1, kv_heads=1, group=1, dim=16, capacity=64, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="attention 'triton' fetches from the fused selection's slot list: it needs fused=True"):
        SlotDecoder(cfg, fused=False, attention="triton", **kw)
    with pytest.raises(ValueError, match="attention must be 'triton' or 'sdpa', got 'flash'"):
        SlotDecoder(cfg, fused=True, attention="flash", **kw)
