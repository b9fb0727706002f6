"""Frame-parallel vision encoding (paper 001 §3.1, §4.1) for LLaVA-class VLMs.

Rank h encodes frames [Σ_{i<h} F_i, Σ_{i≤h} F_i) with F_h = ⌊F/W⌋ + 1[h < F mod W] (Eq. 6); the
projected features, padded to ⌈F/W⌉ frames, are all-gathered and un-padded, and every rank scatters them
into the text embeddings at the image-token positions — the same merge the model does itself, so each
rank ends with the whole prompt's input embeddings and cuts its SPAVA-local tokens from them.
Models whose ``get_image_features`` takes a batch of frames as ``pixel_values`` (LLaVA, LLaVA-OneVision
without image_sizes) fit; Qwen2.5-VL's patch grids do not yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import gather_async


def frame_counts(frames: int, world: int) -> list[int]:
    """Frames per rank (Eq. 6): ⌊F/W⌋ + 1[h < F mod W]."""
    return [frames // world + (h < frames % world) for h in range(world)]


def frame_parallel_features(model, pixel_values: torch.Tensor, group=None) -> torch.Tensor:
    """pixel_values [F, C, H, W] (every rank holds all, encodes its share) -> features [F, T, hidden], identical on every rank."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    frames = pixel_values.shape[0]
    if frames < world:
        raise ValueError(f"{frames} frames cannot be split over {world} processes (each encodes at least one)")
    counts = frame_counts(frames, world)
    start = sum(counts[:rank])
    cfg = model.config
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixel_values[start : start + counts[rank]],
                                             vision_feature_layer=cfg.vision_feature_layer,
                                             vision_feature_select_strategy=cfg.vision_feature_select_strategy)
    mine = torch.stack(list(out.pooler_output))  # [F_r, T, hidden]
    padded = mine.new_zeros((counts[0], *mine.shape[1:]))  # counts[0] = ⌈F/W⌉, the largest share
    padded[: counts[rank]] = mine
    got, work = gather_async(padded, group)
    work.wait()
    return torch.cat([got[h, : counts[h]] for h in range(world)])


def frame_parallel_embeds(model, input_ids: torch.Tensor, pixel_values: torch.Tensor, group=None) -> torch.Tensor:
    """input_ids long [B, n] with image tokens, pixel_values [F, C, H, W] -> inputs_embeds [B, n, hidden]."""
    embeds = model.get_input_embeddings()(input_ids)
    feats = frame_parallel_features(model, pixel_values, group).reshape(-1, embeds.shape[-1])
    slots = input_ids == model.config.image_token_id
    if int(slots.sum()) != feats.shape[0]:
        raise ValueError(f"the prompt has {int(slots.sum())} image tokens, the frames give {feats.shape[0]} features")
    return embeds.masked_scatter(slots[..., None].expand_as(embeds), feats.to(embeds.dtype))
