"""Block gather for offloaded KV caches (NOSA, paper 004): copy whole blocks ``src[rows[i]] -> dst[slots[i]]``
where ``src`` may live in pinned host memory and ``dst`` on the GPU.

Pinned (page-locked) host memory is mapped into the GPU's address space under unified virtual addressing,
so a kernel can load from it directly: every program reads one chunk of one block over PCIe and writes it
to its slot. That turns a gather of scattered blocks into one launch at close to the contiguous
host-to-device copy rate; the alternative, ``index_select`` on the host and then a copy, moves the bytes
twice and runs at a few GB/s (ENVIRONMENT.md).

The same kernel writes the other way: with ``src`` on the GPU and ``dst`` pinned, every program stores its
chunk into host memory through UVA (a decode step appends each sequence's new token to the host store
without a host sync).

Layout: ``src`` [Ns, *block] and ``dst`` [Nd, *block], both contiguous, same dtype and block shape; a block
is one row (e.g. [block_tokens, head_dim] of one KV head). ``rows`` and ``slots`` are int [n] on the
launch device (the GPU side of the copy). Rows or slots out of range are skipped, never read or written (bounds-safe by
construction); ``gather_blocks(..., check=True)`` refuses them instead (a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting

CHUNK_BYTES = 4096  # one program's share of a block: many programs in flight keep PCIe reads outstanding
ROWS_PER_PROGRAM = 1  # blocks one program reads at once
NUM_WARPS = 8  # measured on an H200 host: 8 warps led in most cases (benchmarks/RESULTS.md)


@triton.jit
def _gather_kernel(src, dst, rows, slots, n, n_src, n_dst, row_words, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (p, c) copies words [c·CHUNK, (c+1)·CHUNK) of blocks rows[p·ROWS : (p+1)·ROWS] to their
    slots as one [ROWS, CHUNK] tile: one load and one store, so ROWS reads are in flight at once."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    ids = p * ROWS + tl.arange(0, ROWS)
    live = ids < n
    row = tl.load(rows + ids, mask=live, other=-1).to(tl.int64)
    slot = tl.load(slots + ids, mask=live, other=-1).to(tl.int64)
    ok = live & (row >= 0) & (row < n_src) & (slot >= 0) & (slot < n_dst)
    # An id out of range copies nothing: its words all fall past a limit of 0.
    limit = tl.where(ok, row_words, 0)
    row = tl.where(ok, row, 0)
    slot = tl.where(ok, slot, 0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs[None, :] < limit[:, None]
    words = tl.load(src + row[:, None] * row_words + offs[None, :], mask=mask)
    tl.store(dst + slot[:, None] * row_words + offs[None, :], words, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as [N, W] words of the widest integer type its block size allows (wide loads)."""
    row_bytes = t[0].numel() * t.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if row_bytes % size == 0:
            return t.view(t.shape[0], -1).view(dtype)
    raise AssertionError("unreachable: every size is a multiple of 1")


def check_gather(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Shape, dtype, layout and placement checks with messages that name the bad value."""
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} must share dtype and block shape")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if rows.dim() != 1 or rows.shape != slots.shape or rows.dtype not in (torch.int32, torch.int64) or slots.dtype != rows.dtype:
        raise ValueError(f"rows and slots must be int32/int64 [n] of one dtype, got {rows.dtype} {tuple(rows.shape)} and {slots.dtype} {tuple(slots.shape)}")
    if dst.is_cuda and not (src.is_cuda or src.is_pinned()):
        raise ValueError("src must be pinned host memory (tensor.pin_memory()) or on the GPU for a GPU dst")
    if src.is_cuda and not (dst.is_cuda or dst.is_pinned()):
        raise ValueError("dst must be pinned host memory (tensor.pin_memory()) or on the GPU for a GPU src")
    device = launch_device(src, dst)
    if rows.device != device or slots.device != device:
        raise ValueError(f"rows and slots must be on the launch device {device}, got {rows.device} and {slots.device}")


def launch_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    """Where the copy runs: the GPU side of it (dst's device when both sides share one)."""
    return src.device if src.is_cuda and not dst.is_cuda else dst.device


def gather_blocks(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, *, check: bool = False,
                  chunk_bytes: int = CHUNK_BYTES, rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """dst[slots[i]] = src[rows[i]] for every i, in one launch; returns dst.

    src [Ns, *block] and dst [Nd, *block]: GPU to GPU, pinned host to GPU (gather) or GPU to pinned host
    (scatter); host to host on a CPU-only machine, where the same copy runs through torch or, under
    TRITON_INTERPRET=1, the kernel. rows/slots int [n] on the launch device (the GPU side). check: refuse out-of-range ids (syncs); otherwise they are skipped. Slots must be distinct
    (two blocks written to one slot leave either). chunk_bytes, rows_per_program, num_warps: each
    program's share of a block, how many blocks it reads at once, and its warps (benchmarks/uva_gather.py
    measures them).
    """
    check_gather(src, dst, rows, slots)
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    n = rows.numel()
    if check and n:
        for name, ids, size in (("rows", rows, src.shape[0]), ("slots", slots, dst.shape[0])):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= size:
                raise ValueError(f"{name} must be in [0, {size}), got values in [{low}, {high}]")
    if n == 0 or dst.shape[0] == 0 or src.shape[0] == 0:
        return dst  # nothing in range: every id would be skipped
    if not (dst.is_cuda or src.is_cuda) and not interpreting():
        ok = (rows >= 0) & (rows < src.shape[0]) & (slots >= 0) & (slots < dst.shape[0])
        dst[slots[ok]] = src[rows[ok]]
        return dst
    src_w, dst_w = _words(src), _words(dst)
    row_words = src_w.shape[1]
    chunk = min(triton.next_power_of_2(row_words), max(1, chunk_bytes // src_w.element_size()))
    grid = (triton.cdiv(n, rows_per_program), triton.cdiv(row_words, chunk))
    _gather_kernel[grid](src_w, dst_w, rows, slots, n, src.shape[0], dst.shape[0], row_words, ROWS=rows_per_program, CHUNK=chunk, num_warps=num_warps)
    return dst
