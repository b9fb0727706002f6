"""Planted multi-span inputs for the boundary search (paper 000 Alg. 4): one-hot keys, so a query's
targets are set exactly (logit BETA on its targets, 0 elsewhere), on text/video spans of unequal lengths.

Each builder returns the target sets of one head; ``plant`` turns heads of targets into q/k/v.
"""

from __future__ import annotations

import torch

TEXT, VIDEO = 0, 2
# Text and video spans of unequal lengths (text spans longer than the local window), ending with text.
SPANS = [(TEXT, 24), (VIDEO, 48), (TEXT, 40), (VIDEO, 40), (TEXT, 56), (VIDEO, 32), (TEXT, 16)]
N = sum(length for _, length in SPANS)  # 256 = head_dim: keys are one-hot
BETA = 12.0
SINK, LOCAL = 4, 8
S_TEXT = (10, 13, 18, 21)  # vertical keys in the first text span
S_VIDEO = (40, 45, 50, 55)  # vertical keys in the first video span


def modality() -> torch.Tensor:
    return torch.cat([torch.full((length,), m, dtype=torch.long) for m, length in SPANS])


def _sink(i: int) -> set[int]:
    return set(range(min(SINK, i + 1)))


def targets_none() -> list[set[int]]:
    """Sink + the last LOCAL original positions: one pattern fits every row (no boundary)."""
    return [_sink(i) | set(range(max(0, i - LOCAL + 1), i + 1)) for i in range(N)]


def _recent_video(i: int, mod: torch.Tensor) -> set[int]:
    video = [j for j in range(i + 1) if mod[j] == VIDEO]
    return set(video[-LOCAL:])


def targets_k() -> list[set[int]]:
    """Every row: sink + the last LOCAL video tokens in video order (across text spans) — the pattern lives
    in the key-permuted frame and is the same for all rows (K-boundary)."""
    mod = modality()
    return [_sink(i) | _recent_video(i, mod) for i in range(N)]


def targets_q() -> list[set[int]]:
    """Text rows: sink + S_TEXT; video rows: sink + S_VIDEO — each query modality has its own dynamic
    pattern over all keys, estimated from its own last rows (Q-boundary)."""
    mod = modality()
    return [_sink(i) | {j for j in (S_TEXT if mod[i] == TEXT else S_VIDEO) if j <= i} for i in range(N)]


def targets_2d() -> list[set[int]]:
    """Video rows: sink + last LOCAL video tokens (video frame); text rows: sink + S_VIDEO — pair-specific
    patterns in the permuted frame of both axes (2D-boundary)."""
    mod = modality()
    return [_sink(i) | (_recent_video(i, mod) if mod[i] == VIDEO else {j for j in S_VIDEO if j <= i}) for i in range(N)]


def plant(heads: list[list[set[int]]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, H, N, N], k = identity per head [1, H, N, N], v random [1, H, N, N] (float32, scale 1)."""
    gen = torch.Generator().manual_seed(seed)
    h = len(heads)
    q = torch.zeros(1, h, N, N)
    for hh, rows in enumerate(heads):
        for i, keys in enumerate(rows):
            q[0, hh, i, sorted(keys)] = BETA
    k = torch.eye(N).expand(1, h, N, N).contiguous()
    v = torch.randn(1, h, N, N, generator=gen)
    return q, k, v


def space_json() -> dict:
    """A small search space sized for these inputs (blocks of 16, no scaling, a generous budget)."""
    return {
        "name": "planted-boundary", "format": 1, "reference_tokens": N, "block_m": 16, "block_n": 16,
        "target": {"pattern": "ashape", "params": {"sink": 16, "local": 64}}, "budget_slack": 3.0,
        "candidates": [
            {"pattern": "ashape", "params": {"sink": SINK, "local": LOCAL}},
            {"pattern": "ashape", "params": {"sink": SINK, "local": 2 * LOCAL}},
            {"pattern": "vertical_slash", "params": {"vertical_size": 8, "slash_size": 1, "last_q": 16, "force_vertical": 0, "force_slash": 1}},
        ],
        "boundaries": ["none", "k", "q", "2d"],
    }
