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
    spawn(_both_worker, 2, timeout_s=60)


@pytest.mark.slow
def test_one_and_four_spawned_processes():
    spawn(_both_worker, 1, timeout_s=60)
    spawn(_both_worker, 4, timeout_s=90)


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
