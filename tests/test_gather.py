"""Block gather (kernels/gather.py) against torch indexing: every dtype and block width, duplicate rows,
out-of-range ids skipped (or refused with check=True). On a CPU the kernel runs under TRITON_INTERPRET=1
(conftest); on a GPU its source is pinned host memory, read through UVA."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from sparsesearch.kernels.gather import gather_blocks


def source(blocks: int, shape: tuple[int, ...], dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(blocks, *shape, generator=gen).to(dtype)
    return src.pin_memory() if DEVICE == "cuda" else src


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("shape", [(16, 64), (8, 3), (5,), (64, 128)])  # odd widths take narrower words
def test_gather_equals_indexing(dtype, shape):
    src = source(40, shape, dtype if dtype != torch.int8 else torch.float32)
    if dtype == torch.int8:
        src = (src * 20).to(torch.int8)
        src = src.pin_memory() if DEVICE == "cuda" else src
    dst = torch.zeros(12, *shape, dtype=src.dtype, device=DEVICE)
    rows = torch.tensor([39, 0, 7, 7, 21, 3], device=DEVICE)  # a row fetched twice into two slots
    slots = torch.tensor([11, 0, 4, 5, 2, 9], device=DEVICE)
    gather_blocks(src, rows, dst, slots)
    want = torch.zeros_like(dst)
    want[slots.cpu()] = src[rows.cpu()].to(DEVICE)
    assert torch.equal(dst, want)


def test_out_of_range_ids_are_skipped_or_refused():
    src = source(10, (4, 8), torch.float32)
    dst = torch.full((4, 4, 8), 7.0, device=DEVICE)
    rows = torch.tensor([2, 10, -1, 5], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1, 2, 4], dtype=torch.int32, device=DEVICE)  # slot 4 is past dst
    gather_blocks(src, rows, dst, slots)
    assert torch.equal(dst[0].cpu(), src[2]) and bool((dst[1:] == 7.0).all())
    with pytest.raises(ValueError, match=r"rows must be in \[0, 10\), got values in \[-1, 10\]"):
        gather_blocks(src, rows, dst, slots, check=True)


def test_bad_arguments_name_the_problem():
    src = source(4, (2, 8), torch.float32)
    ids = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="share dtype and block shape"):
        gather_blocks(src, ids, torch.zeros(2, 2, 4, device=DEVICE), ids)
    with pytest.raises(ValueError, match="int32/int64"):
        gather_blocks(src, ids.float(), torch.zeros(2, 2, 8, device=DEVICE), ids)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two, got 3"):
        gather_blocks(src, ids, torch.zeros(2, 2, 8, device=DEVICE), ids, rows_per_program=3)
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(src.transpose(1, 2), ids, torch.zeros(2, 8, 2, device=DEVICE), ids)


def test_empty_gather_leaves_dst():
    src = source(4, (2, 8), torch.float32)
    dst = torch.ones(2, 2, 8, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert torch.equal(gather_blocks(src, empty, dst, empty), torch.ones(2, 2, 8, device=DEVICE))


@pytest.mark.parametrize("rows_per_program, chunk_bytes", [(1, 4096), (2, 64), (4, 16), (8, 4096)])
def test_launch_settings_copy_the_same_blocks(rows_per_program, chunk_bytes):
    """Several blocks per program and chunks smaller than a block (several programs per block), with a
    tail of blocks that does not fill the last program."""
    src = source(30, (8, 16), torch.bfloat16, seed=1)
    rows = torch.tensor([29, 3, 3, 17, 0, 11, 8], device=DEVICE)
    slots = torch.tensor([6, 0, 1, 2, 5, 4, 3], device=DEVICE)
    dst = torch.zeros(7, 8, 16, dtype=torch.bfloat16, device=DEVICE)
    gather_blocks(src, rows, dst, slots, chunk_bytes=chunk_bytes, rows_per_program=rows_per_program)
    assert torch.equal(dst.cpu(), src[rows.cpu()][slots.argsort().cpu()])
