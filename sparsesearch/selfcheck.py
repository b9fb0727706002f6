"""End-to-end check of the pattern library and kernels on this machine.

For every pattern: build its index from random Q/K (dynamic patterns estimate online), run the Triton
kernel (the CPU interpreter when there is no GPU), compare with the torch oracle over the same admitted
set, and report density, error and times. ``region_vertical_slash`` does the same on a permuted modality
region (video rows x text keys, the row_pos frame). This is what ``sparsesearch check`` runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .execute import HeadGroup, build_group_index
from .index import BlockIndex, validate
from .kernels import block_sparse_attention, triangle_attention
from .patterns import index_density, triangle
from .patterns.registry import REGISTRY
from .reference import error_floor, index_mask_fn, masked_attention, predicate_mask_fn, relative_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class CheckRow:
    pattern: str
    params: str
    density: float
    rel_error: float
    budget: float
    ok: bool
    index_ms: float
    kernel_ms: float


def default_cases(tokens: int) -> dict[str, object]:
    """Every registered pattern with its demo parameters at this length (sparse but not empty), plus a
    permuted modality region: video rows x text keys of a text/video interleave (patterns/boundary.py)."""
    cases = {name: module.demo_params(tokens) for name, module in REGISTRY.items()}
    cases["region_vertical_slash"] = REGISTRY["vertical_slash"].demo_params(tokens)
    return cases


def _interleave(tokens: int) -> torch.Tensor:
    """Modality ids [tokens]: text, video, text, video spans of unequal lengths (0 text, 2 video)."""
    ids = torch.zeros(tokens, dtype=torch.long)
    for start, stop in ((tokens // 8, tokens // 3), (tokens // 2, 7 * tokens // 8)):
        ids[start:stop] = 2
    return ids


def _build(name: str, params, q, k, block: int) -> tuple[BlockIndex, Callable]:
    """The index through the executor (every KV head, kv space) and the Triton launch that runs it."""
    index = build_group_index(HeadGroup(name, params, tuple(range(k.shape[1])), block, block), q, k, "kv")
    if name == "triangle":
        return index, lambda q_, k_, v_, i_: triangle_attention(q_, k_, v_, i_, params.last)
    return index, block_sparse_attention


def check_patterns(
    tokens: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "bf16",
    block: int = 64,
    device: str = "cpu",
    patterns: list[str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[CheckRow]:
    """Run every (or the named) pattern end to end; each row says whether the kernel met its error budget."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    cases = default_cases(tokens)
    unknown = sorted(set(patterns or []) - set(cases))
    if unknown:
        raise ValueError(f"unknown pattern(s) {unknown}; choose from {sorted(cases)}")
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(1, h, tokens, head_dim, generator=gen).to(DTYPES[dtype]).to(device)
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    rows = []
    for name, params in cases.items():
        if patterns and name not in patterns:
            continue
        if progress:
            progress(name)
        if name.startswith("region_"):
            qs, ks, vs, out, index, mask, density, index_ms, kernel_ms = _region_case(params, q, k, v, block, device)
        else:
            qs, ks, vs = q, k, v
            start = time.perf_counter()
            index, run = _build(name, params, q, k, block)
            index_ms = 1e3 * (time.perf_counter() - start)
            validate(index, tokens)
            start = time.perf_counter()
            out, _ = run(q, k, v, index)
            if device != "cpu":
                torch.cuda.synchronize()
            kernel_ms = 1e3 * (time.perf_counter() - start)
            if name == "triangle":
                mask = predicate_mask_fn(triangle.predicate(params, tokens), 1, heads, tokens, tokens)
                density = triangle.density(params, tokens, block_m=block, block_n=block)
            else:
                mask = index_mask_fn(index, tokens, tokens, heads // kv_heads)
                density = index_density(index, tokens)
        ref, _ = masked_attention(qs, ks, vs, mask)
        low, _ = masked_attention(qs, ks, vs, mask, upcast=False)
        err = relative_error(out, ref)
        budget = 2 * relative_error(low, ref) + error_floor(DTYPES[dtype], device)
        rows.append(CheckRow(name, repr(params), round(density, 4), err, budget, err <= budget, round(index_ms, 2), round(kernel_ms, 2)))
    return rows


def _region_case(params, q, k, v, block: int, device: str):
    """Vertical-slash on the video-rows x text-keys region of an interleave, estimated and run in the
    region frame (row_pos) by the Triton kernel. Returns the region's q/k/v, output, index, mask, density
    and times."""
    from .patterns import boundary
    from .patterns._common import index_entries

    region = boundary.make_region("video", "text", boundary.positions(_interleave(q.shape[2]), ("text", "image", "video")))
    qs, ks, vs = region.gather(q, k, v)
    row_pos = region.row_pos.to(q.device)
    start = time.perf_counter()
    index = build_group_index(HeadGroup("vertical_slash", params, tuple(range(k.shape[1])), block, block), qs, ks, "kv", row_pos)
    index_ms = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    out, _ = block_sparse_attention(qs, ks, vs, index, row_pos=row_pos)
    if device != "cpu":
        torch.cuda.synchronize()
    kernel_ms = 1e3 * (time.perf_counter() - start)
    mask = index_mask_fn(index, qs.shape[2], ks.shape[2], q.shape[1] // k.shape[1], row_pos=row_pos)
    density = index_entries(index, qs.shape[2], ks.shape[2], row_pos=row_pos) / (index.batch * index.heads * region.causal_entries)
    return qs, ks, vs, out, index, mask, density, index_ms, kernel_ms


def rows_as_dicts(rows: list[CheckRow]) -> list[dict]:
    return [asdict(r) for r in rows]
