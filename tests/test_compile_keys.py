"""benchmarks/compile_keys.py: Triton compile keys counted on a CPU, do_not_specialize honoured."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from benchmarks import compile_keys


@triton.jit(do_not_specialize=["n"])
def _toy(X, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs) + n + m)


def test_generic_args_reads_the_kernels_do_not_specialize():
    assert compile_keys.generic_args(_toy) == {"n"}


def test_launch_keys_split_on_specialised_ints_only():
    names, generic = ["X", "n", "m"], {"n"}
    x = torch.zeros(16)
    key = lambda n, m: compile_keys.launch_key(names, generic, (x, n, m), {"BLOCK": 16})
    assert key(16, 5) == key(17, 5)  # n is generic: its value does not matter
    assert key(5, 16) != key(5, 17)  # m is specialised: a multiple of 16 or not
    assert key(5, 1) != key(5, 3)  # ... and 1 or not
    assert key(5, 3) == key(5, 5)
    assert key(2**40, 3) != key(3, 3)  # int64 vs int32 is a type, generic or not
    assert compile_keys.launch_key(names, generic, (x, 1, 3), {"BLOCK": 32}) != key(1, 3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the interpreted kernel on CPU tensors")
def test_a_small_modal_search_records_its_launches():
    summary = compile_keys.run(layers=1, heads=4, kv_heads=2, dim=64, tokens=512)
    assert summary["keys"] >= summary["constexpr_sets"] >= 1
    assert set(summary["generic_args"]) == compile_keys.generic_args(compile_keys.block_sparse._block_sparse_fwd)
    assert compile_keys.block_sparse._block_sparse_fwd.__class__.__name__ != "KeyRecorder"  # restored
