"""Sample: one calibration prompt as token ids with a modality id per token, plus its provenance hash."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

# Same ids as sparsesearch.models.modality (MODALITIES = text, image, video); kept here so that loading
# data never imports the model-loading stack.
TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclass
class Sample:
    """One calibration or evaluation prompt.

    input_ids:  LongTensor [N], the prompt exactly as the model is fed (chat template and BOS included).
    modality:   LongTensor [N], 0 text, 1 image, 2 video per token.
    text:       the text the ids encode (decoded when a file row was truncated), or None where the ids are
                not text (synthetic:frames, synthetic:mixed: random "visual" ids).
    answer:     the expected continuation of a retrieval prompt ("71432", a UUID), else None.
    answer_ids: LongTensor [A], the answer's tokens as the tokenizer splits them right after the prompt
                (so " 71432" after "The pass key is", "71432" after a chat assistant header); the first
                one is the next token the model must produce. It can be a lone space token (SmolLM2,
                Llama-3 and Qwen never merge a space into digits); ``meta["answer_content_index"]``
                points at the first token with content, the paper-002 y_gt. None without an answer.
    source:     the spec ("synthetic:passkey") or the resolved file path.
    meta:       plain-data details: seed, row, set parameters (frame_stride, frames, segments, ...).
    inputs:     the other model inputs of a VLM prompt as its processor returned them (pixel_values,
                image_sizes, image_grid_thw, ...); empty for text.
    """

    input_ids: torch.Tensor
    modality: torch.Tensor
    text: str | None = None
    answer: str | None = None
    answer_ids: torch.Tensor | None = None
    source: str = ""
    meta: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 1 or self.input_ids.dtype != torch.long:
            raise ValueError(
                f"input_ids must be a 1-D LongTensor, got {self.input_ids.dtype} {tuple(self.input_ids.shape)}"
            )
        if self.modality.shape != self.input_ids.shape or self.modality.dtype != torch.long:
            raise ValueError(
                f"modality must be a LongTensor shaped like input_ids {tuple(self.input_ids.shape)}, "
                f"got {self.modality.dtype} {tuple(self.modality.shape)}"
            )

    def __len__(self) -> int:
        return int(self.input_ids.numel())


def sha256_of(samples: Iterable[Sample]) -> str:
    """Provenance hash of a calibration set: sha256 over, per sample in order, its length as 8 little-endian
    bytes followed by its input_ids as int64 little-endian, then (VLM prompts only) each extra input by
    name: its shape and its values as float32 little-endian. Independent of device, dtype width and torch
    version; the length prefix keeps [a, b] + [c] distinct from [a] + [b, c]."""
    h = hashlib.sha256()
    for sample in samples:
        ids = sample.input_ids.detach().to("cpu", torch.long).numpy().astype("<i8", copy=False)
        h.update(np.int64(ids.size).astype("<i8").tobytes())
        h.update(ids.tobytes())
        for name in sorted(sample.inputs):
            value = sample.inputs[name].detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False)
            h.update(name.encode() + np.asarray(value.shape, dtype="<i8").tobytes() + value.tobytes())
    return h.hexdigest()
