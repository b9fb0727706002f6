"""The dynamic patterns' index builds: the fused Triton build (kernels/index_build.py) where it takes the
inputs, else the pattern's own torch build (patterns/block_topk.py, patterns/vertical_slash.py), the
reference it is checked against.

The choice lives here, a floor above the patterns, so a pattern module stays params, predicate, torch
``build_index`` and density, and never imports a kernel (tests/test_layers.py). Every consumer that wants
the fast path (execute.build_group_index, graphed.py, the benchmarks) calls ``build`` with the pattern's
name; a caller that wants the reference calls the pattern's ``build_index`` itself.
"""

from __future__ import annotations

import dataclasses

import torch

from ..index import BlockIndex
from ..patterns import block_topk, vertical_slash
from ..patterns._common import check_head_space, check_qk
from ._common import interpreting
from .index_build import block_topk_index, topk_fusable, vertical_slash_index, vs_fusable


def wants_fused(fused: bool | None, refusal, q: torch.Tensor) -> bool:
    """Whether a build takes its fused path: ``fused`` None on CUDA tensors where ``refusal()`` (the
    pattern's ``*_refusal`` here: a reason, or None) has none; True always (ValueError naming why it cannot);
    False never. The fused index always has static widths (block top-k: lists as wide as the key blocks;
    vertical-slash: ``vertical_slash.list_widths``), which every consumer reads as well as the narrow ones
    (entries past a count are never read). Measured on an H200 (32/8 heads, 32K-1M keys): static or not,
    the fused build is faster than the torch one (vertical-slash 7-19x; block top-k 3.3x at 32K, 1.08x at
    128K) and peaks at 1/12-1/40 of its memory (the torch build's [B, H, QB, KB] sorts), so an unasked build
    never prefers torch for narrower lists (benchmarks/RESULTS.md, sessions 9-11)."""
    if fused is False or (fused is None and not q.is_cuda):
        return False
    why = refusal()
    if why is None and not q.is_cuda and not interpreting():
        why = f"q is on {q.device}: compiled Triton takes CUDA tensors (TRITON_INTERPRET=1 runs it on CPU)"
    if why is not None and fused:
        raise ValueError(f"fused index build refused: {why}")
    return why is None


def block_topk_refusal(params: block_topk.BlockTopKParams, q: torch.Tensor, k: torch.Tensor, *, block_n: int = 64,
                       row_pos: torch.Tensor | None = None) -> str | None:
    """Why the fused block top-k build cannot take these inputs (None: it can)."""
    return topk_fusable(q, k, block_n, row_pos)


def vertical_slash_refusal(params: vertical_slash.VerticalSlashParams, q: torch.Tensor, k: torch.Tensor, *,
                           block_n: int = 64, row_pos: torch.Tensor | None = None) -> str | None:
    """Why the fused vertical-slash build cannot take these inputs (None: it can)."""
    return vs_fusable(q, k, block_n, params.last_q, row_pos, params.vertical_size, params.slash_size)


def block_topk_build(
    params: block_topk.BlockTopKParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    row_pos: torch.Tensor | None = None,
    static_widths: bool = False,
    fused: bool | None = None,
) -> BlockIndex:
    """``block_topk.build_index`` from q [B, Hq, Nq, D], k [B, Hkv, Nk, D], or the same index from the Triton
    build (two launches, no [QB, KB] sort; lists of static width KB; ``meta["fused"]`` True). fused: None
    takes Triton where ``wants_fused`` says so, True insists (ValueError when it cannot), False never."""
    check_head_space(head_space)
    _, _, q_len, kv_len = check_qk(q, k, row_pos)
    if wants_fused(fused, lambda: block_topk_refusal(params, q, k, block_n=block_n, row_pos=row_pos), q):
        index, blocks = block_topk_index(q, k, params.k_blocks, params.sink_blocks, head_space=head_space,
                                         block_m=block_m, block_n=block_n)
        selection = block_topk.BlockSelection(blocks, q_len, kv_len, block_m, block_n, head_space)
        return dataclasses.replace(index, meta={"pattern": block_topk.NAME, "selection": selection, "fused": True})
    return block_topk.build_index(params, q, k, head_space=head_space, block_m=block_m, block_n=block_n,
                                  row_pos=row_pos, static_widths=static_widths)


def vertical_slash_build(
    params: vertical_slash.VerticalSlashParams,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    head_space: str = "query",
    block_m: int = 64,
    block_n: int = 64,
    scale: float | None = None,
    row_pos: torch.Tensor | None = None,
    static_widths: bool = False,
    fused: bool | None = None,
) -> BlockIndex:
    """``vertical_slash.build_index`` from q [B, Hq, Nq, D], k [B, Hkv, Nk, D], or the same index from the
    Triton build (four launches, no [last_q, Nk] matrix in HBM, no sort; lists of static widths;
    ``meta["fused"]`` True). fused: as ``block_topk_build``."""
    check_head_space(head_space)
    _, _, q_len, kv_len = check_qk(q, k, row_pos)
    if wants_fused(fused, lambda: vertical_slash_refusal(params, q, k, block_n=block_n, row_pos=row_pos), q):
        p, forced = params, vertical_slash.forced
        index, vertical, slash = vertical_slash_index(
            q, k, vertical_size=p.vertical_size, slash_size=p.slash_size, last_q=p.last_q,
            force_vertical=forced(p.force_vertical, p.vertical_size), force_slash=forced(p.force_slash, p.slash_size),
            slash_floor=vertical_slash.slash_floor(p.last_q, q, k, head_space),
            head_space=head_space, block_m=block_m, block_n=block_n, scale=scale,
        )
        lines = vertical_slash.VSLines(vertical, slash, q_len, kv_len, head_space)
        return dataclasses.replace(index, meta={"pattern": vertical_slash.NAME, "lines": lines, "fused": True})
    return vertical_slash.build_index(params, q, k, head_space=head_space, block_m=block_m, block_n=block_n, scale=scale,
                                      row_pos=row_pos, static_widths=static_widths)


# Pattern name -> its build and its refusal. Every DYNAMIC pattern of patterns/registry.py has an entry
# (tests/test_registry.py), so a consumer never falls back to a torch build by omission.
BUILDS = {block_topk.NAME: block_topk_build, vertical_slash.NAME: vertical_slash_build}
REFUSALS = {block_topk.NAME: block_topk_refusal, vertical_slash.NAME: vertical_slash_refusal}


def build(name: str, params, q: torch.Tensor, k: torch.Tensor, **kwargs) -> BlockIndex:
    """The index of dynamic pattern ``name`` (``BUILDS``; kwargs as its build: head_space, block_m, block_n,
    row_pos, static_widths, fused)."""
    return BUILDS[name](params, q, k, **kwargs)


def fused_refusal(name: str, params, q: torch.Tensor, k: torch.Tensor, *, block_n: int = 64,
                  row_pos: torch.Tensor | None = None) -> str | None:
    """Why the fused build of dynamic pattern ``name`` cannot take these inputs (None: it can)."""
    return REFUSALS[name](params, q, k, block_n=block_n, row_pos=row_pos)
