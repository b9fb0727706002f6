"""Attention sections of TriangleMix gradient probing (paper 002, section 2.3) and their sums in torch.

The probe multiplies the causal softmax probabilities of one layer by θ (all ones, no renormalisation):
O_i = Σ_j θ_ij P_ij V_j. With dO = ∂y/∂O (per query head, before o_proj) the probe gradient is

    ∂y/∂θ_ij = P_ij · (dO_i · V_j)

and the paper's per-section statistics are Grad(M) = mean of ∂y/∂θ over M and Att(M) = mean of P over M.
We also keep Σ|∂y/∂θ| (docs/peers.md: the signed Middle mean flips sign between layers on small models).

Sections (prefill, N queries = N keys, 0-based i = query row, j = key; only the causal region j <= i):

    LAST    rows i >= N - last, every causal key j <= i
    STREAM  rows i <  N - last, keys with j < sink (attention sink) or i - j < window (local window,
            the diagonal included: window=1 is the diagonal alone)
    MIDDLE  rows i <  N - last, keys with j >= sink and i - j >= window

The three partition the causal triangle, so Σ_sections Σ P = N (every row sums to 1). Differences from
the paper's masks (Eq. in section 2.2, 1-based, strict inequalities): here the Last section also holds
the sink/window entries of the last rows (the paper leaves them to Streaming) so that sections are a
partition and match what TriangleMix computes densely; with sink=si, window=sl+1 the MIDDLE section is
the paper's M^middle up to its 1-based indexing. last >= N makes every entry LAST.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.section_grad import check_section_inputs, section_grad_sums

STREAM, MIDDLE, LAST = 0, 1, 2
SECTIONS = ("stream", "middle", "last")


@dataclass(frozen=True)
class SectionSpec:
    """sink >= 0 first keys, window >= 1 keys ending at the diagonal, last >= 1 final query rows."""

    sink: int
    window: int
    last: int

    def __post_init__(self) -> None:
        for name, low in (("sink", 0), ("window", 1), ("last", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"SectionSpec.{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"SectionSpec.{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class SectionMeans:
    """Per-section means [B, Hq, 3] float64 (order STREAM, MIDDLE, LAST); 0 for an empty section."""

    grad: torch.Tensor
    abs_grad: torch.Tensor
    prob: torch.Tensor


@dataclass(frozen=True)
class SectionSums:
    """Per (batch, query head) section sums of one layer; last axis ordered STREAM, MIDDLE, LAST.

    grad_sum, abs_grad_sum, prob_sum: float64 [B, Hq, 3] of Σ P·(dO·V), Σ |P·(dO·V)|, Σ P.
    count: int64 [3], entries per section (the same for every batch row and head).
    """

    grad_sum: torch.Tensor
    abs_grad_sum: torch.Tensor
    prob_sum: torch.Tensor
    count: torch.Tensor

    def means(self) -> SectionMeans:
        """Sums / count (Grad(M), mean |∂y/∂θ|, Att(M)); an empty section gives 0, not NaN."""
        count = self.count.to(device=self.grad_sum.device, dtype=torch.float64)
        safe = count.clamp_min(1.0)
        fix = lambda s: torch.where(count > 0, s / safe, torch.zeros_like(s))
        return SectionMeans(fix(self.grad_sum), fix(self.abs_grad_sum), fix(self.prob_sum))


def section_of(i: torch.Tensor | int, j: torch.Tensor | int, n: int, spec: SectionSpec) -> torch.Tensor:
    """Section id (STREAM 0, MIDDLE 1, LAST 2) of entry (query row i, key j), -1 outside causal (j > i).

    i and j broadcast against each other; the result is int64 of the broadcast shape.
    """
    i, j = torch.as_tensor(i), torch.as_tensor(j)
    stream = (j < spec.sink) | (i - j < spec.window)
    sec = torch.where(i >= n - spec.last, LAST, torch.where(stream, STREAM, MIDDLE))
    return torch.where(j > i, -1, sec).to(torch.int64)


def section_counts(n: int, spec: SectionSpec) -> torch.Tensor:
    """Entries per section, int64 [3] (STREAM, MIDDLE, LAST), in O(n) without an n x n mask."""
    i = torch.arange(n, dtype=torch.int64)
    causal = i + 1
    sink = causal.clamp(max=spec.sink)
    win = causal.clamp(max=spec.window)
    # Keys in both: j < sink and j > i - window.
    both = (sink - (i - spec.window + 1).clamp(min=0)).clamp(min=0)
    stream = sink + win - both
    is_last = i >= n - spec.last
    return torch.stack([
        stream[~is_last].sum(),
        (causal - stream)[~is_last].sum(),
        causal[is_last].sum(),
    ]).to(torch.int64)


def section_sums_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    spec: SectionSpec,
    *,
    scale: float | None = None,
    chunk: int | None = None,
) -> SectionSums:
    """Section sums of P·(dO·V), |P·(dO·V)| and P in torch (the CPU path and the kernel's oracle).

    q, do [B, Hq, N, D]; k, v [B, Hkv, N, D] (GQA: query head h reads KV head h // (Hq // Hkv), never
    repeated); lse [B, Hq, N] natural log of a dense causal pass. P = exp(q·kᵀ·scale − lse), causal.
    Computed in float32 (float64 for float64 inputs), summed in float64. Queries go `chunk` rows at a
    time: each intermediate holds B·Hq·chunk·N values (None: chunk so that is about 16M).
    """
    check_section_inputs(q, k, v, do, lse)
    batch, q_heads, n, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if chunk is None:
        chunk = max(1, min(n, (1 << 24) // max(1, batch * q_heads * n)))
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    kc = k.to(compute)[:, :, None]  # [B, Hkv, 1, N, D]
    vc = v.to(compute)[:, :, None]
    sums = torch.zeros(3, batch, kv_heads, group, 3, dtype=torch.float64, device=q.device)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        rows = torch.arange(r0, r1, device=q.device)
        cols = torch.arange(r1, device=q.device)  # causal: no key past the chunk's last row
        sec = section_of(rows[:, None], cols[None, :], n, spec)
        split = lambda t: t[:, :, r0:r1].to(compute).reshape(batch, kv_heads, group, r1 - r0, -1)
        scores = split(q) @ kc[..., :r1, :].transpose(-1, -2) * scale
        scores = scores.masked_fill(sec < 0, float("-inf"))
        p = torch.exp(scores - split(lse[..., None]))
        d = p * (split(do) @ vc[..., :r1, :].transpose(-1, -2))
        for s in (STREAM, MIDDLE, LAST):
            mask = sec == s
            for slot, t in enumerate((d, d.abs(), p)):
                # Row sums in the compute precision, the rest in float64.
                sums[slot, ..., s] += (t * mask).sum(-1).double().sum(-1)
    grad, absg, prob = (s.reshape(batch, q_heads, 3) for s in sums)
    return SectionSums(grad, absg, prob, section_counts(n, spec).to(q.device))


def section_sums(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    spec: SectionSpec,
    *,
    scale: float | None = None,
    config: dict | None = None,
) -> SectionSums:
    """``section_sums_torch`` by the Triton kernel (kernels/section_grad.py), same arguments and result;
    config: the kernel's BLOCK_M, BLOCK_N, num_warps, num_stages overrides."""
    if not isinstance(spec, SectionSpec):
        raise ValueError(f"spec must be a SectionSpec, got {type(spec).__name__}")
    sums = section_grad_sums(q, k, v, do, lse, spec.sink, spec.window, spec.last, scale=scale, config=config)
    return SectionSums(*sums, section_counts(q.shape[2], spec).to(q.device))


def section_sums_auto(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    spec: SectionSpec,
    *,
    scale: float | None = None,
) -> SectionSums:
    """Triton (``section_sums``) on CUDA tensors, torch (``section_sums_torch``) elsewhere; same arguments and result."""
    if q.is_cuda:
        return section_sums(q, k, v, do, lse, spec, scale=scale)
    return section_sums_torch(q, k, v, do, lse, spec, scale=scale)
