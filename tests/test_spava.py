"""SPAVA attention (sparsesearch/spava): layout, lse merge, one-process oracle, and the distributed
version on gloo with 1, 2 and 4 processes. Every rank asserts; a failing rank fails the test."""

from __future__ import annotations

import os

import pytest
import torch

from sparsesearch.merge import merge_partials
from sparsesearch.reference import masked_attention, relative_error
from sparsesearch.spava.attention import attend, spava_attention
from sparsesearch.spava.group import check_backend, spawn
from sparsesearch.spava.layout import Layout, check_lengths, default_lengths
from sparsesearch.spava.reference import spava_reference

TOL = 2e-5  # fp32 against fp32: only summation order differs


def _qkv(layout: Layout, batch=2, hq=4, hkv=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (batch, h, layout.n, dim)
    return torch.randn(shape(hq), generator=g), torch.randn(shape(hkv), generator=g), torch.randn(shape(hkv), generator=g)


@pytest.mark.parametrize("n_ctx,q,world,l_a", [(101, 7, 2, 9), (77, 3, 4, 0), (64, 5, 1, 5), (35, 1, 3, 3)])
def test_zigzag_ownership_and_positions(n_ctx, q, world, l_a):
    lay = Layout(n_ctx, q, world, l_a, 0)
    blocks = [lay.block(j) for j in range(lay.hosts)]
    assert blocks[0][0] == l_a and blocks[-1][1] == n_ctx
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, in order
    assert max(e - s for s, e in blocks) - min(e - s for s, e in blocks) <= 1  # balanced, none empty
    owners = {}
    for r in range(world):
        assert lay.vhosts(r) == (r, 2 * world - 1 - r)
        pos = lay.local_positions(r)
        assert pos[:l_a] == list(range(l_a)) and pos[-q:] == list(range(n_ctx, n_ctx + q))
        assert len(pos) == sum(lay.local_sizes(r))
        for p in pos[l_a:-q]:
            assert p not in owners
            owners[p] = r
        s0, s1 = lay.anchor_slice(r)
        assert s1 - s0 in (l_a // world, l_a // world + 1)
    assert sorted(owners) == list(range(l_a, n_ctx))  # every context token on exactly one rank


def test_defaults_and_length_rules():
    assert default_lengths(2048) == (128, 128) and default_lengths(32768) == (512, 256)
    check_lengths(Layout(2048 + 16, 16, 2, 128, 128))
    with pytest.raises(ValueError, match="multiple of 128"):
        check_lengths(Layout(2048, 16, 2, 100, 128))
    with pytest.raises(ValueError, match="larger than a block"):
        check_lengths(Layout(1024, 16, 4, 0, 256))
    with pytest.raises(ValueError, match=r"anchor \(l_a\) 512 is larger than a block"):
        check_lengths(Layout(2048, 16, 4, 512, 128))
    with pytest.raises(ValueError, match="larger than this context allows"):
        Layout(10, 2, 8, 0, 0)
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        Layout(10, 2, 0, 0, 0)


def test_backend_rules():
    assert check_backend("gloo", 4) == "gloo"
    if not torch.cuda.is_available():
        assert check_backend("auto", 2) == "gloo"
        with pytest.raises(ValueError, match="no CUDA device"):
            check_backend("nccl", 1)
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        check_backend("gloo", 0)


def test_nccl_more_ranks_than_gpus(monkeypatch):
    """The GPU-host rule, on a machine without GPUs: torch's device count stands in for two GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_backend("auto", 2) == "nccl" and check_backend("nccl", 1) == "nccl"
    with pytest.raises(ValueError, match="nproc 3 is more than the 2 GPUs here"):
        check_backend("nccl", 3)
    assert check_backend("gloo", 3) == "gloo"  # gloo runs any number of CPU ranks


@pytest.mark.parametrize("empty", [0, 1, 3])
def test_lse_merge_exact_with_empty_shards(empty):
    g = torch.Generator().manual_seed(empty)
    q, k, v = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    cuts = [0, 0, 13, 13, 40] if empty else [0, 10, 20, 30, 40]  # repeated cuts = empty shards
    if empty == 3:
        cuts = [0, 0, 0, 0, 40]
    parts = [attend(q, k[:, :, s:e], v[:, :, s:e], 0.3, causal=False) for s, e in zip(cuts, cuts[1:])]
    out, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ref, ref_lse = attend(q, k, v, 0.3, causal=False)
    assert relative_error(out, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-5)
    all_empty = merge_partials(torch.zeros(3, 2, 5, 8), torch.full((3, 2, 5), float("-inf")))
    assert not all_empty[0].isnan().any() and (all_empty[0] == 0).all() and (all_empty[1] == float("-inf")).all()


def test_oracle_equals_dense_when_passing_covers_blocks():
    lay = Layout(16 + 4 * 24, 6, 2, 16, 24)  # equal blocks of 24 = l_p: every context key passes
    q, k, v = _qkv(lay)
    dense = masked_attention(q, k, v, scale=0.25)[0]
    assert relative_error(spava_reference(q, k, v, lay, 0.25), dense) < TOL
    narrow = spava_reference(q, k, v, Layout(lay.n_ctx, 6, 2, 16, 4), 0.25)
    assert relative_error(narrow, dense) > 1e-3  # the oracle does drop keys when l_p is small
    assert relative_error(narrow[:, :, -6:], dense[:, :, -6:]) < TOL  # query rows are always exact


def _attention_worker(rank, world, n_ctx, q_len, l_a, l_p, dense):
    lay = Layout(n_ctx, q_len, world, l_a, l_p)
    q, k, v = _qkv(lay)
    pos = torch.tensor(lay.local_positions(rank))
    stats = {}
    out = spava_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], lay, rank, 0.25, stats=stats)
    ref = spava_reference(q, k, v, lay, 0.25)[:, :, pos]
    err = relative_error(out, ref)
    assert err < TOL, f"rank {rank}: SPAVA vs one-process oracle {err:.2e}"
    if dense:
        err = relative_error(out, masked_attention(q, k, v, scale=0.25)[0][:, :, pos])
        assert err < TOL, f"rank {rank}: SPAVA with covering l_p vs dense {err:.2e}"
    assert (stats["bytes_sent"] > 0) == (world > 1)


def _both_worker(rank, world):
    _attention_worker(rank, world, 203, 5, 11, 9, False)  # odd lengths, uneven blocks
    _attention_worker(rank, world, 8 + 2 * world * 20, 7, 8, 20, True)  # l_p covers every block


@pytest.fixture
def one_process_group():
    """A gloo group of one in this process: the W = 1 path without the cost of spawning."""
    import torch.distributed as dist

    from sparsesearch.spava.group import free_port, init_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_group("gloo", 30, rank=0, world=1)
    yield
    dist.destroy_process_group()


def test_one_process_equals_oracle_and_dense(one_process_group):
    _both_worker(0, 1)


def test_two_processes_equal_oracle_and_dense():
    """The attention checks, then the simulation against what each rank really received (one spawn)."""
    spawn(_spawned_worker, 2, timeout_s=60)


@pytest.mark.slow
def test_one_and_four_spawned_processes():
    spawn(_both_worker, 1, timeout_s=60)
    spawn(_spawned_worker, 4, timeout_s=90)


def _dying_worker(rank, world):
    if rank == 1:
        os._exit(3)  # a rank that dies mid-run without a word
    lay = Layout(64, 4, world, 8, 4)
    q, k, v = _qkv(lay)
    pos = torch.tensor(lay.local_positions(rank))
    spava_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], lay, rank, 0.25)


def test_killed_rank_ends_run_with_one_line():
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(_dying_worker, 2, timeout_s=20)
    assert "rank 1 died (exit code 3)" in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - start < 50


# ------------------------------------------------------------------ fused path, zigzag steps, simulation

from conftest import DEVICE  # noqa: E402
from sparsesearch.reference import error_floor  # noqa: E402
from sparsesearch.spava.comm import Collectives  # noqa: E402
from sparsesearch.spava.exact import position_mask, ring_attention, zigzag_positions, zigzag_step  # noqa: E402
from sparsesearch.spava.fused import Engine  # noqa: E402
from sparsesearch.spava.simulate import ring_world, spava_world  # noqa: E402

FAST = Engine("triton", block=16)  # the kernel under TRITON_INTERPRET=1 on CPU; 16-blocks so pieces span several
PLAIN = Engine("torch")


def _within_kernel_tolerance(fast: torch.Tensor, plain: torch.Tensor, low: torch.Tensor, what: str) -> None:
    """flash-attention's rule (STYLE habit 4): error vs the fp32 path <= 2x the low-precision path's + floor."""
    budget = 2 * relative_error(low, plain) + error_floor(fast.dtype, fast.device)
    err = relative_error(fast, plain)
    assert err <= budget, f"{what}: fused {err:.2e} > budget {budget:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,kv,causal", [(37, 37, True), (21, 90, True), (19, 53, False), (1, 40, False)])
def test_engine_pieces_match_plain(dtype, m, kv, causal):
    g = torch.Generator().manual_seed(m + kv)
    q, k, v = (torch.randn(1, h, n, 64, generator=g).to(dtype).to(DEVICE) for h, n in ((8, m), (2, kv), (2, kv)))
    out, lse = FAST.attend(q, k, v, 0.125, causal)
    ref, ref_lse = PLAIN.attend(q, k, v, 0.125, causal)
    low = Engine("torch")  # the same math in the inputs' precision: the yardstick
    low_o = masked_attention(q, k, v, None if causal else (lambda rows: torch.ones(1, 1, rows.numel(), kv, dtype=torch.bool, device=rows.device)),
                             scale=0.125, upcast=False)[0]
    assert low.kind == "torch" and out.dtype == dtype and lse.dtype == torch.float32
    _within_kernel_tolerance(out, ref, low_o, f"{m}x{kv} causal={causal}")
    # fp32 dots run as TF32 in the kernel on a GPU (~1e-3 relative on the logits); the interpreter is fp32.
    fp32_atol = 1e-4 if torch.device(DEVICE).type == "cpu" else 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-2 if dtype == torch.bfloat16 else fp32_atol, rtol=0)
    if causal and m == kv:  # the anchor-row shape: SDPA (flash on CUDA), no lse
        sdpa, none = FAST.attend(q, k, v, 0.125, causal, need_lse=False)
        assert none is None
        _within_kernel_tolerance(sdpa, ref, low_o, "sdpa square causal")


def test_engine_rules():
    with pytest.raises(ValueError, match="engine must be one of"):
        Engine("flash")
    with pytest.raises(ValueError, match="engine block must be"):
        Engine("triton", block=100)
    assert Engine("auto").resolve(torch.device("cpu")) == "torch"
    q = torch.randn(1, 2, 5, 64)
    o, lse = FAST.attend(q, q[:, :1, :0], q[:, :1, :0], 1.0, False)  # no keys: (0, -inf), no launch
    assert (o == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("n,world", [(40, 1), (50, 2), (61, 3), (64, 4)])
def test_zigzag_step_is_the_position_mask(n, world):
    """Each ring step's (rows, key prefix, causal) admits exactly the keys the global positions admit."""
    for rank in range(world):
        qp = torch.tensor(zigzag_positions(n, world, rank))
        for src in range(world):
            kp = torch.tensor(zigzag_positions(n, world, src))
            want = position_mask(qp, kp)(torch.arange(len(qp)))[0, 0]
            row0, stop, causal = zigzag_step(n, world, rank, src)
            got = torch.zeros_like(want)
            rows, cols = torch.arange(len(qp) - row0)[:, None], torch.arange(stop)[None, :]
            got[row0:, :stop] = (cols <= rows + stop - (len(qp) - row0)) if causal else True
            assert torch.equal(got, want), (n, world, rank, src)


def _global_qkv(n, dtype=torch.float32, seed=0, hq=4, hkv=2, dim=64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, dim, generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_simulated_ranks_fast_path_equals_plain(world):
    """Every simulated rank's SPAVA and ring output: the kernels equal the plain path to kernel tolerance,
    the plain path equals the one-process oracle (SPAVA) and dense attention (ring)."""
    lay = Layout(16 + 2 * world * 24 + 3, 13, world, 16, 16)
    q, k, v = _global_qkv(lay.n, torch.bfloat16, seed=world)
    oracle = spava_reference(q, k, v, lay, 0.125)
    dense = masked_attention(q, k, v, scale=0.125)[0]
    for fast, plain in zip(spava_world(q, k, v, lay, 0.125, FAST), spava_world(q, k, v, lay, 0.125, PLAIN)):
        o_fast = spava_attention(fast.q, fast.k, fast.v, lay, fast.rank, 0.125, engine=FAST, exchange=fast.replay)
        o_plain = spava_attention(plain.q, plain.k, plain.v, lay, plain.rank, 0.125, engine=PLAIN, exchange=plain.replay)
        assert relative_error(o_plain, oracle[:, :, plain.pos]) < 1e-2  # bf16 output of an fp32 computation
        _within_kernel_tolerance(o_fast, oracle[:, :, fast.pos], o_plain, f"spava rank {fast.rank}")
    for r in ring_world(q, k, v, world):
        o_fast = ring_attention(r.q, r.k, r.v, r.pos, lay.n, 0.125, engine=FAST, exchange=r.replay)
        o_plain = ring_attention(r.q, r.k, r.v, r.pos, lay.n, 0.125, engine=PLAIN, exchange=r.replay)
        assert relative_error(o_plain, dense[:, :, r.pos]) < 1e-2, f"ring rank {r.rank}: plain path is not exact"
        _within_kernel_tolerance(o_fast, dense[:, :, r.pos], o_plain, f"ring rank {r.rank}")


def _replay_worker(rank, world):
    """A real gloo run records what arrives; the simulation must build the same tensors and outputs."""
    lay = Layout(9 + 2 * world * 15, 6, world, 9, 7)
    q, k, v = _qkv(lay, batch=1, dim=16, seed=5)
    pos = torch.tensor(lay.local_positions(rank))
    real = Collectives(record=True)
    out = spava_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], lay, rank, 0.25, engine=PLAIN, exchange=real)
    sim = spava_world(q, k, v, lay, 0.25, PLAIN)[rank]
    for t_real, t_sim in ((q[:, :, pos], sim.q), (k[:, :, pos], sim.k), (v[:, :, pos], sim.v)):
        assert torch.equal(t_real, t_sim), f"rank {rank}: local inputs differ"
    assert sorted(real.received) == sorted(sim.replay.arrivals), f"rank {rank}: {sorted(real.received)}"
    for name, got in real.received.items():
        assert torch.equal(got, sim.replay.arrivals[name]), f"rank {rank}: {name} differs from the simulation"
    replayed = spava_attention(sim.q, sim.k, sim.v, lay, rank, 0.25, engine=PLAIN, exchange=sim.replay)
    assert torch.equal(out, replayed), f"rank {rank}: replayed output differs"
    assert sim.replay.bytes_sent == real.bytes_sent > 0
    n = lay.n
    zz = torch.tensor(zigzag_positions(n, world, rank))
    real = Collectives(record=True)
    ring_out = ring_attention(q[:, :, zz], k[:, :, zz], v[:, :, zz], zz, n, 0.25, engine=PLAIN, exchange=real)
    sim = ring_world(q, k, v, world)[rank]
    assert sorted(real.received) == sorted(sim.replay.arrivals), f"rank {rank}: ring {sorted(real.received)}"
    for name, got in real.received.items():
        assert torch.equal(got, sim.replay.arrivals[name]), f"rank {rank}: ring {name} differs from the simulation"
    assert torch.equal(ring_out, ring_attention(sim.q, sim.k, sim.v, sim.pos, n, 0.25, engine=PLAIN, exchange=sim.replay))
    assert sim.replay.bytes_sent == real.bytes_sent > 0


def _spawned_worker(rank, world):
    _both_worker(rank, world)
    _replay_worker(rank, world)


# ------------------------------------------------------------------ split-K and the query partial's locality

from sparsesearch.spava.fused import key_splits  # noqa: E402


@pytest.mark.parametrize("kv,rows,causal,split", [(10, 3, True, 4), (10, 3, False, 4), (8, 8, True, 3), (9, 2, False, 9), (100, 16, True, 7)])
def test_key_splits_cover_the_piece(kv, rows, causal, split):
    pieces = key_splits(kv, rows, causal, split)
    assert pieces[0][0] == 0 and pieces[-1][1] == kv and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert [c for *_, c in pieces] == [False] * (len(pieces) - causal) + [True] * causal  # causal: the last only
    assert all(e - s <= split for s, e, c in pieces if not c)
    if causal:
        assert pieces[-1][:2] == (kv - rows, kv)  # the square over the rows' own keys
    with pytest.raises(ValueError, match="kv_len >= rows"):
        key_splits(2, 3, True, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,kv,causal", [(5, 90, False), (16, 83, True), (1, 64, False), (9, 40, True)])
def test_split_k_equals_unsplit(dtype, m, kv, causal):
    """A few-row piece cut along K (chunks of 16 keys, merged by lse) equals the unsplit piece: the plain path
    to fp32 summation order, the kernel (equal chunks folded into the batch) to kernel tolerance."""
    g = torch.Generator().manual_seed(m * kv)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).to(dtype).to(DEVICE) for h, n in ((4, m), (2, kv), (2, kv)))
    ref, ref_lse = PLAIN.attend(q, k, v, 0.125, causal)
    split_plain = Engine("torch", split_k=16)
    out, lse = split_plain.attend(q, k, v, 0.125, causal)
    assert relative_error(out, ref) < TOL and torch.allclose(lse, ref_lse, atol=1e-5)
    fast, fast_lse = Engine("triton", block=16, split_k=16).attend(q, k, v, 0.125, causal)
    low = masked_attention(q, k, v, None if causal else (lambda rows: torch.ones(1, 1, rows.numel(), kv, dtype=torch.bool, device=rows.device)),
                           scale=0.125, upcast=False)[0]
    assert fast.dtype == dtype
    _within_kernel_tolerance(fast, ref, low, f"split-K {m}x{kv} causal={causal}")
    torch.testing.assert_close(fast_lse, ref_lse, atol=1e-2 if dtype == torch.bfloat16 else 1e-2, rtol=0)


def test_spava_ranks_with_split_k_equal_unsplit():
    """Every simulated rank's SPAVA output with the query partial split along K (split 8 < shards of ~40 keys)."""
    lay = Layout(16 + 2 * 2 * 24 + 3, 13, 2, 16, 8)
    q, k, v = _global_qkv(lay.n, seed=7)
    for split in (Engine("torch", block=16, split_k=8), Engine("triton", block=16, split_k=8)):
        for plain, sim in zip(spava_world(q, k, v, lay, 0.125, PLAIN), spava_world(q, k, v, lay, 0.125, split)):
            want = spava_attention(plain.q, plain.k, plain.v, lay, plain.rank, 0.125, engine=PLAIN, exchange=plain.replay)
            got = spava_attention(sim.q, sim.k, sim.v, lay, sim.rank, 0.125, engine=split, exchange=sim.replay)
            # the Triton engine's fp32 dots run as TF32 on a GPU (9e-4 on an H200): its floor, not 1e-4
            assert relative_error(got, want) < max(1e-4, error_floor(q.dtype, q.device)), f"{split.kind} rank {sim.rank}"


@pytest.mark.parametrize("world", [2, 3])
def test_query_partial_is_computed_where_its_keys_live(world):
    """Each rank sends only its two selections and its query partial (out, lse): the bytes are the formula's and
    do not grow with the context. A rank that gathered its peers' keys for the query would send more, and more
    with every longer block."""
    b, hq, hkv, d, q_len, p = 1, 4, 2, 64, 13, 8
    sent = []
    for block in (24, 72):
        lay = Layout(16 + 2 * world * block, q_len, world, 16, p)
        q, k, v = _global_qkv(lay.n, seed=block, hq=hq, hkv=hkv, dim=d)
        for r in spava_world(q, k, v, lay, 0.125, PLAIN):
            stats = {}
            spava_attention(r.q, r.k, r.v, lay, r.rank, 0.125, engine=PLAIN, exchange=r.replay, stats=stats)
            assert set(r.replay.sent_by) == {"passing_a", "passing_b", "query_out", "query_lse"}
            want = (2 * b * hkv * p * 2 * d * 4 + b * hq * q_len * d * 4 + b * hq * q_len * 4) * (world - 1)  # fp32 throughout
            assert r.replay.bytes_sent == stats["bytes_sent"] == want, (block, r.rank)
            assert stats["bytes_passing"] == 2 * b * hkv * p * 2 * d * 4 * (world - 1)
            sent.append(stats["bytes_sent"])
    assert len(set(sent)) == 1
