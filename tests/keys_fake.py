"""A stand-in dense side for key checks on a random tiny model, which retrieves no passkey: dense's real
teacher-forced digit probabilities with every digit marked its most likely token, so every key counts as held
and the sparse side is read for real (sparsesearch/keycheck.py)."""

from __future__ import annotations

import torch


def dense_holds_every_key(monkeypatch) -> list[int]:
    """Patch ``fidelity.answer_probs`` so; returns the list each sparse read appends its min_tokens to."""
    import sparsesearch.fidelity as fidelity

    real, sparse_reads = fidelity.answer_probs, []

    def answer_probs(model, sample, artifact=None, *, min_tokens=1024):
        probs, top = real(model, sample, artifact, min_tokens=min_tokens)
        if artifact is not None:
            sparse_reads.append(min_tokens)
            return probs, top
        return probs, torch.ones_like(top)

    monkeypatch.setattr(fidelity, "answer_probs", answer_probs)
    return sparse_reads
