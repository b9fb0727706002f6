"""Chat rows with images or videos: through the model's processor, as a VLM is fed.

A ``messages`` row whose content lists items like ``{"type": "image", "image": "cat.png"}`` (or
``"video"``) is rendered by ``processor.apply_chat_template(..., tokenize=True, return_dict=True)``, the
transformers way: the processor loads the media, expands each placeholder into the model's visual tokens
and returns the pixel tensors the model needs. Relative media paths are resolved against the data file's
folder. The sample's modality ids mark the processor's image / video tokens; its ``inputs`` keep the
pixel tensors (pixel_values, image_sizes, image_grid_thw, ...) for the forward pass.

Visual tokens cannot be cut without breaking the image, so a row longer than ``max_tokens`` is skipped
rather than truncated.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .sample import IMAGE, TEXT, VIDEO, Sample

MEDIA = {"image": IMAGE, "video": VIDEO}


def is_visual(value: object) -> bool:
    """Whether a ``messages`` value carries an image or video item."""
    if not isinstance(value, (list, tuple)):
        return False
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, (list, tuple)) and any(isinstance(c, dict) and c.get("type") in MEDIA for c in content):
            return True
    return False


def is_processor(obj) -> bool:
    """A multi-modal processor (it has an image or video processor next to its tokenizer)."""
    return hasattr(obj, "tokenizer") and (hasattr(obj, "image_processor") or hasattr(obj, "video_processor"))


def _token_id(processor, name: str) -> int | None:
    """The id of the processor's image / video placeholder token, when it has one."""
    value = getattr(processor, f"{name}_token_id", None)
    if isinstance(value, int):
        return value
    token = getattr(processor, f"{name}_token", None)
    if not isinstance(token, str):
        return None
    value = processor.tokenizer.convert_tokens_to_ids(token)
    return value if isinstance(value, int) and value != processor.tokenizer.unk_token_id else None


def _resolve_media(messages, base: Path) -> list[dict]:
    """A copy of messages with relative media paths made absolute against ``base``."""
    out = copy.deepcopy(list(messages))
    for message in out:
        for item in message.get("content") or []:
            if not isinstance(item, dict) or item.get("type") not in MEDIA:
                continue
            key = item["type"] if item["type"] in item else next((k for k in ("path", "url") if k in item), None)
            value = item.get(key) if key else None
            if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
                item[key] = str(base / value)
    return out


def visual_sample(processor, messages, base: Path, *, max_tokens: int, source: str, row: int) -> Sample | None:
    """The sample of one visual chat row, or None when it is longer than max_tokens (see module doc)."""
    if not is_processor(processor):
        raise ValueError(
            f"{source} row {row} has images or videos: calibration needs the model's processor (a VLM directory "
            "with processor files); this model loaded a text tokenizer only"
        )
    out = processor.apply_chat_template(_resolve_media(messages, base), tokenize=True, return_dict=True,
                                        return_tensors="pt", add_generation_prompt=False)
    ids = out["input_ids"][0].long()
    if ids.numel() > max_tokens:
        return None
    modality = torch.full_like(ids, TEXT)
    for name, value in MEDIA.items():
        token = _token_id(processor, name)
        if token is not None:
            modality[ids == token] = value
    inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)}
    return Sample(input_ids=ids, modality=modality, text=None, source=source, inputs=inputs,
                  meta={"row": row, "field": "messages", "truncated": False, "row_tokens": int(ids.numel()),
                        "media": {n: int((modality == v).sum()) for n, v in MEDIA.items()}})
