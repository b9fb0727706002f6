"""Modality regions: the permutations behind MMInference's boundary heads (paper 000 §3.2, Alg. 2-4).

A *region* is the attention of one set of query rows to one set of keys, each gathered in original order
(the modality-wise permutation of the paper). Causality stays the original one: row i admits key j iff
k_pos[j] <= q_pos[i]. Because both sides keep their order, that is ``j <= row_pos[i]`` with

    row_pos[i] = #{j : k_pos[j] <= q_pos[i]} - 1        (nondecreasing; -1: the row sees no key yet)

— the row's *frontier* in the region's key frame. Every pattern builder, the estimate of the last queries
and the torch reference path take ``row_pos`` and work in that frame, so a pattern means the same thing
in every region: A-shape keeps the first ``sink`` keys of the region and the ``local`` keys just behind
each row's frontier; a slash at offset d is the key d behind the frontier; block top-k forces the
frontier's blocks. Intra-modality regions have the identity frame (row_pos None, the square causal case).
Every region runs on our kernels (Triton on a GPU, the torch backend on a CPU), which read its rows and
keys in place through int32 maps (``Region.maps``: Q loads and O/lse stores through q_idx, K/V loads
through k_idx, a modality's runs of consecutive keys as plain tiles; no permuted copies, no un-permute
pass). ``Region.gather`` (contiguous copies) remains for
the search's scoring and for the estimates of dynamic patterns, which need the region's keys in order.

Which regions a boundary type composes (rows of one modality always merge their regions' partial
outputs by log-sum-exp into the exact attention over the union of the regions' keys):

    none  one region: every row x every key (the global pattern; continuous in both dimensions)
    k     per key modality b: (all rows, keys of b)          — a boundary along keys only
    q     per query modality a: (rows of a, all keys)        — a boundary along queries only
    2d    per pair (a, b): (rows of a, keys of b)            — intra when a == b, cross otherwise
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..index import RegionMaps
from ..merge import merge_two
from ._common import causal_entries, region_causal_entries

BOUNDARIES = ("none", "k", "q", "2d")
ALL = "all"
# Modality names by id, fixed and recorded in artifacts (id i is MODALITIES[i]). The executor's boundary launches
# and the model side's token ids (models/modality.py) read this one tuple; it sits here, below both.
MODALITIES: tuple[str, ...] = ("text", "image", "video")


@dataclass(frozen=True)
class Region:
    """Rows of ``q_mod`` x keys of ``k_mod`` (either may be ``all``), as original positions, int64 on the
    device of the modality ids: q_idx [Nq], k_idx [Nk]; row_pos [Nq] or None for the identity frame."""

    q_mod: str
    k_mod: str
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    row_pos: torch.Tensor | None

    @property
    def name(self) -> str:
        return scope_name(self.q_mod, self.k_mod)

    @property
    def causal_entries(self) -> int:
        """Causal (row, key) pairs of the region."""
        return causal_entries(self.q_idx.numel()) if self.row_pos is None else region_causal_entries(self.row_pos)

    def to(self, device) -> "Region":
        """The region with its index tensors on ``device`` (itself when they are there already)."""
        if self.q_idx.device == torch.device(device):
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Region(self.q_mod, self.k_mod, move(self.q_idx), move(self.k_idx), move(self.row_pos))

    def maps(self, device, n: int) -> RegionMaps | None:
        """The region read in place from a sequence of n tokens (the kernels' ``maps``): int32 q_idx and
        k_idx on ``device``, None for a side that is every token in order (``all``), and the frame. Valid by
        construction (distinct, increasing positions; row_pos from searchsorted), so nothing is re-checked.
        None for the whole sequence (all x all): nothing to map."""
        if self.q_mod == self.k_mod == ALL:
            return None
        row_map = None if self.q_mod == ALL else self.q_idx.to(device=device, dtype=torch.int32)
        col_map = None if self.k_mod == ALL else self.k_idx.to(device=device, dtype=torch.int32)
        row_pos = None if self.row_pos is None else self.row_pos.to(device)
        return RegionMaps(row_map, col_map, row_pos, n, n, increasing=col_map is not None)

    def gather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, N, D], k/v [B, Hkv, N, D] -> the region's rows and keys (copies along the token axis;
        the whole sequence, all x all, is returned as is)."""
        if self.q_mod == self.k_mod == ALL:
            return q, k, v
        qi, ki = self.q_idx.to(q.device), self.k_idx.to(q.device)
        return q.index_select(2, qi), k.index_select(2, ki), v.index_select(2, ki)


def scope_name(q_mod: str, k_mod: str) -> str:
    return f"{q_mod}>{k_mod}"


def split_scope(scope: str) -> tuple[str, str]:
    """'video>text' -> ('video', 'text'); a bare modality name means its intra region."""
    q_mod, _, k_mod = scope.partition(">")
    return q_mod, k_mod or q_mod


def positions(modality: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Original positions of each present modality (and ``all``): int64 [N_m] per name.

    modality: int [N], ids indexing ``names`` (models.modality_ids: 0 text, 1 image, 2 video)."""
    modality = modality.flatten().long()
    if modality.numel() == 0:
        raise ValueError("modality ids are empty: one id per token is needed")
    lo, hi = int(modality.min()), int(modality.max())
    if lo < 0 or hi >= len(names):
        bad = lo if lo < 0 else hi
        raise ValueError(f"modality id {bad} names no modality: ids index {names} (0..{len(names) - 1})")
    out = {ALL: torch.arange(modality.numel(), device=modality.device)}
    for i, name in enumerate(names):
        idx = (modality == i).nonzero().flatten()
        if idx.numel():
            out[name] = idx
    return out


def make_region(q_mod: str, k_mod: str, pos: dict[str, torch.Tensor]) -> Region | None:
    """The region of rows q_mod x keys k_mod, or None when it holds no causal pair. ValueError names a
    modality that is unknown or has no token in this sequence."""
    for name in (q_mod, k_mod):
        if name not in pos:
            raise ValueError(f"modality {name!r} is unknown or absent here (present: {sorted(pos)})")
    q_idx, k_idx = pos[q_mod], pos[k_mod]
    if q_mod == k_mod:
        return Region(q_mod, k_mod, q_idx, k_idx, None)
    row_pos = torch.searchsorted(k_idx, q_idx, right=True) - 1
    if int(row_pos.max()) < 0:  # every row precedes every key: nothing to compute
        return None
    return Region(q_mod, k_mod, q_idx, k_idx, row_pos)


def region_scopes(boundary: str, present: list[str]) -> list[tuple[str, str]]:
    """(q_mod, k_mod) of the regions a boundary type composes, for the modalities present."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be one of {BOUNDARIES}, got {boundary!r}")
    if boundary == "none" or len(present) < 2:
        return [(ALL, ALL)]
    if boundary == "k":
        return [(ALL, b) for b in present]
    if boundary == "q":
        return [(a, ALL) for a in present]
    return [(a, b) for a in present for b in present]


def regions(boundary: str, modality: torch.Tensor, names: tuple[str, ...]) -> list[Region]:
    """The non-empty regions of one boundary type for a sequence's modality ids."""
    pos = positions(modality, names)
    present = [n for n in names if n in pos]
    found = (make_region(a, b, pos) for a, b in region_scopes(boundary, present))
    return [r for r in found if r is not None]


def compose(parts: list[tuple[Region, torch.Tensor, torch.Tensor]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge region partials into the full attention of n rows.

    parts: (region, out [B, H, Nq_r, D], lse fp32 [B, H, Nq_r]) of one boundary type — every row is covered
    by the regions that share its query set. Returns fp32 (out [B, H, n, D], lse [B, H, n]); a row no region
    admits anything for gets (0, -inf).
    """
    first = parts[0][1]
    batch, heads, _, dim = first.shape
    out = torch.zeros(batch, heads, n, dim, dtype=torch.float32, device=first.device)
    lse = torch.full((batch, heads, n), float("-inf"), dtype=torch.float32, device=first.device)
    for region, o_r, lse_r in parts:
        rows = region.q_idx.to(first.device)
        merged_o, merged_lse = merge_two(out[:, :, rows], lse[:, :, rows], o_r, lse_r)
        out[:, :, rows] = merged_o
        lse[:, :, rows] = merged_lse
    return out, lse
