"""Fidelity: a model's own attention against a sparse artifact on held-out prompts, one path for all.

calibrate (the artifact's recorded fidelity), ``sparsesearch evaluate`` and ``probe-layers --validate``
(several TriangleMix start layers against one reference) all measure through these functions:

1. ``generations`` runs each prompt through ``model.generate`` (greedy, logits kept) with the model's own
   attention (artifact None) or with an artifact applied through the runtime (``runtime.apply``; boundary
   heads see the prompt's modality ids; with ``audit`` each layer's prefill attention-output error
   against dense SDPA is recorded);
2. ``next_token_kl`` / ``greedy_agreement`` compare a candidate's generation with the reference's, and
   ``accuracy`` counts retrieval answers.

The reference runs once however many candidates are compared with it. Model-agnostic: the runtime (the
package that imports transformers) is imported when a generation applies an artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Generation:
    """One greedy generation after a prompt of ``tokens`` tokens.

    logprobs: fp32 [V], log-softmax at the first generated position (the answer's first token);
    new_ids: int64 [T], the generated tokens; correct: the retrieval answer came out (None: the sample
    has none); audit: per layer, the prefill's relative attention-output error against dense (audit runs).
    """

    tokens: int
    logprobs: torch.Tensor
    new_ids: torch.Tensor
    correct: bool | None
    audit: dict[int, float] = field(default_factory=dict)


def generate(model, tokenizer, sample, artifact=None, *, min_tokens: int = 1024, audit: bool = False) -> Generation:
    """Greedy generation of one prompt: the answer's tokens + 2 new tokens (4 without an answer).

    artifact: an object with ``manifest`` and ``heads`` (runtime.apply), or None for the model's own
    attention. The artifact is applied for this generation only and removed after it."""
    from .data import retrieval_correct

    device = next(model.parameters()).device
    ids = sample.input_ids[None].to(device)
    new = int(sample.answer_ids.numel()) + 2 if sample.answer_ids is not None else 4
    pad = getattr(tokenizer, "tokenizer", tokenizer).eos_token_id  # a VLM's processor holds its tokenizer
    kwargs = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=pad, attention_mask=torch.ones_like(ids), **{k: v.to(device) for k, v in sample.inputs.items()})
    with torch.no_grad():
        if artifact is None:
            out, errors = model.generate(ids, **kwargs), {}
        else:
            out, errors = _sparse_generate(model, artifact, sample.modality.to(device), ids, kwargs, min_tokens, audit)
    new_ids = out.sequences[0, ids.shape[1]:]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    correct = retrieval_correct(text, sample) if sample.answer is not None else None
    return Generation(int(ids.shape[1]), torch.log_softmax(out.logits[0][0].float(), -1), new_ids, correct, errors)


def _sparse_generate(model, artifact, modality, ids, kwargs: dict, min_tokens: int, audit: bool):
    """model.generate with the artifact applied; returns (output, {layer: prefill audit error})."""
    from .runtime import apply, remove, runner_of, set_modality

    apply(model, artifact, min_tokens=min_tokens)
    try:
        runner = runner_of(model)
        runner.audit = {} if audit else None
        # Boundary heads run their region patterns on this prompt's own modality ids.
        set_modality(model, modality)
        out = model.generate(ids, **kwargs)
        # The first call of each layer is the prefill; decode steps run dense.
        return out, {layer: errs[0] for layer, errs in (runner.audit or {}).items()}
    finally:
        remove(model)


def generations(model, tokenizer, samples: list, artifact=None, *, min_tokens: int = 1024, audit: bool = False) -> list[Generation]:
    """``generate`` for every sample, in order."""
    return [generate(model, tokenizer, s, artifact, min_tokens=min_tokens, audit=audit) for s in samples]


def next_token_kl(reference: Generation, candidate: Generation) -> float:
    """KL(reference || candidate) of the next-token distributions at the answer position."""
    p, q = reference.logprobs, candidate.logprobs
    return float((p.exp() * (p - q)).sum())


def greedy_agreement(reference: Generation, candidate: Generation) -> float:
    """Share of the reference's generated positions before the candidate first departs from it."""
    ref, cand = reference.new_ids, candidate.new_ids
    same = (ref[: cand.numel()] == cand[: ref.numel()]).int()
    return float(same.cumprod(0).sum()) / max(1, ref.numel())


def accuracy(gens: list[Generation]) -> float:
    """Share of generations whose retrieval answer came out (samples without an answer count as wrong)."""
    return sum(g.correct is True for g in gens) / len(gens)


def mean_kl(reference: list[Generation], candidate: list[Generation]) -> float:
    return sum(next_token_kl(r, c) for r, c in zip(reference, candidate)) / len(reference)


def evaluate_fidelity(model, tokenizer, manifest: dict, rows: list[dict], *, data: str, samples: int, tokens: int,
                      seed: int = 0, min_tokens: int = 1024) -> dict:
    """Held-out sample(s) ``data`` (seeds seed .. seed + samples - 1): dense vs the artifact (manifest +
    heads rows) through the sparse runtime — next-token KL at the answer position, greedy agreement,
    retrieval accuracy, mean effective density and each layer's attention-output error measured inside
    the sparse prefill (runtime audit)."""
    from types import SimpleNamespace

    import pandas as pd

    from .artifacts.summary import effective_densities
    from .data import held_out

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    prompts = [held_out(data, tokenizer, max_tokens=tokens, seed=seed + i) for i in range(samples)]
    artifact = SimpleNamespace(manifest=manifest, heads=pd.DataFrame(rows))
    dense = generations(model, tokenizer, prompts)
    sparse = generations(model, tokenizer, prompts, artifact, min_tokens=min_tokens, audit=True)
    audits: dict[int, list[float]] = {}
    for g in sparse:
        for layer, err in g.audit.items():
            audits.setdefault(layer, []).append(err)
    densities = [d for d in effective_densities(manifest, rows).values() if d is not None]  # imported rows have none
    return {
        "eval_data": data, "samples": samples, "tokens": sparse[-1].tokens,
        "next_token_kl": round(mean_kl(dense, sparse), 6),
        "greedy_agreement": round(sum(greedy_agreement(d, s) for d, s in zip(dense, sparse)) / samples, 4),
        "dense_accuracy": accuracy(dense), "sparse_accuracy": accuracy(sparse),
        "mean_density": None if not densities else round(sum(densities) / len(densities), 4),
        "layer_output_error": {str(k): round(sum(v) / len(v), 6) for k, v in sorted(audits.items())},
    }
