"""Next-token quality of candidate log-probabilities against a reference: the one KL / NLL computation that
fidelity (calibrate, evaluate, probe-layers --validate, pareto), the NOSA sweep and SPAVA all report.

KL(reference || candidate) per position is clamped at 0: mathematically it is >= 0, and fp32 rounding of two
nearly equal distributions can dip a hair below it, which would make a mean over positions understate a
small divergence.
"""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the last (vocabulary) axis: [..., V] -> [..., V]."""
    return torch.log_softmax(logits.float(), -1)


def token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per position, >= 0: log-probabilities [..., V] -> [...]."""
    return (reference.exp() * (reference - candidate)).sum(-1).clamp_min(0.0)


def token_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` (long [...]) under log-probabilities [..., V] -> [...]."""
    return -logp.gather(-1, targets[..., None])[..., 0]
