"""Per-token modality ids: which tokens of a prompt are text, image or video placeholders.

The mapping is fixed and recorded in artifacts: ``MODALITIES[i]`` is the name of id ``i``.
A token is "image" (1) or "video" (2) when its id is one of ``info.modality_token_ids[...]`` (the
placeholder ids the processor expands to one token per visual patch group, e.g. Qwen2.5-VL's
``<|image_pad|>`` / ``<|video_pad|>``); every other token, including vision start/end markers, is "text" (0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..patterns.boundary import MODALITIES  # the fixed id -> name tuple, kept below the executor that reads it too
from .info import ModelInfo

TEXT, IMAGE, VIDEO = 0, 1, 2


def modality_ids(input_ids: torch.Tensor, info: ModelInfo) -> torch.Tensor:
    """Modality id per token: LongTensor [B, N] (same shape and device as ``input_ids``), values in
    ``range(len(MODALITIES))``: 0 text, 1 image, 2 video, from ``info.modality_token_ids``."""
    return token_modality_ids(input_ids, info.modality_token_ids)


def token_modality_ids(input_ids: torch.Tensor, token_ids: Mapping[str, list[int]]) -> torch.Tensor:
    """``modality_ids`` from a {"image": [...], "video": [...]} mapping instead of a ModelInfo."""
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    out = torch.zeros(input_ids.shape, dtype=torch.long, device=input_ids.device)
    for modality, ids in token_ids.items():
        if modality not in MODALITIES:
            raise ValueError(f"unknown modality '{modality}' in modality_token_ids; known: {', '.join(MODALITIES)}")
        if ids:
            hit = torch.isin(input_ids, torch.tensor(list(ids), dtype=input_ids.dtype, device=input_ids.device))
            out[hit] = MODALITIES.index(modality)
    return out
