"""Fidelity: a model's own attention against a sparse artifact on held-out prompts, one path for all.

calibrate (the artifact's recorded fidelity), ``sparsesearch evaluate`` and ``probe-layers --validate``
(several TriangleMix start layers against one reference) all measure through ``attend`` + ``compare``:

1. ``attend`` runs each held-out sequence once with the model's own attention (artifact None) or with an
   artifact applied through the runtime (``runtime.apply``; boundary heads see the prompt's modality ids;
   with ``audit`` each layer's prefill attention-output error against dense SDPA is recorded). The
   sequence is the prompt plus, for retrieval prompts, the answer (teacher forcing); the forward keeps the
   final hidden states [N, H], never the [N, vocab] logits. Retrieval prompts are also generated greedily
   (``generate``) so that ``accuracy`` counts answers the way a user would see them.
2. ``compare`` turns a reference run and a candidate run into the report: KL(reference || candidate) of
   the next-token distributions and the perplexity of each at *every* position (``teacher_forced``; the
   lm head runs over chunks of positions, so a 16K x 262K-vocab sequence never sits in memory at once),
   the same over the positions >= min_tokens, the KL at the position after the prompt
   (``next_token_kl``), greedy agreement, and retrieval counts with a verdict that says "uninformative"
   where the reference itself does not retrieve.

The reference runs once however many candidates are compared with it. Model-agnostic: the runtime (the
package that imports transformers) is imported when a run applies an artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .quality import log_probs, token_kl, token_nll


@dataclass
class Generation:
    """One greedy generation after a prompt of ``tokens`` tokens.

    new_ids: int64 [T], the generated tokens; correct: the retrieval answer came out (None: the sample
    has none)."""

    tokens: int
    new_ids: torch.Tensor
    correct: bool | None


def generate(model, tokenizer, sample, artifact=None, *, min_tokens: int = 1024) -> Generation:
    """Greedy generation of one prompt: the answer's tokens + 2 new tokens (4 without an answer).

    artifact: an object with ``manifest`` and ``heads`` (runtime.apply), or None for the model's own
    attention. The artifact is applied for this generation only and removed after it."""
    from .data import retrieval_correct

    device = next(model.parameters()).device
    ids = sample.input_ids[None].to(device)
    new = int(sample.answer_ids.numel()) + 2 if sample.answer_ids is not None else 4
    pad = getattr(tokenizer, "tokenizer", tokenizer).eos_token_id  # a VLM's processor holds its tokenizer
    kwargs = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True, pad_token_id=pad,
                  attention_mask=torch.ones_like(ids), **{k: v.to(device) for k, v in sample.inputs.items()})
    with torch.no_grad():
        out = model.generate(ids, **kwargs) if artifact is None else _sparse_generate(model, artifact, sample.modality.to(device), ids, kwargs, min_tokens)
    new_ids = out.sequences[0, ids.shape[1]:]
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    correct = retrieval_correct(text, sample) if sample.answer is not None else None
    return Generation(int(ids.shape[1]), new_ids, correct)


def _sparse_generate(model, artifact, modality, ids, kwargs: dict, min_tokens: int):
    """model.generate with the artifact applied (the prefill runs sparse; decode steps run dense)."""
    from .runtime import apply, remove, set_modality

    apply(model, artifact, min_tokens=min_tokens)
    try:
        set_modality(model, modality)  # boundary heads run their region patterns on this prompt's modality ids
        return model.generate(ids, **kwargs)
    finally:
        remove(model)


def greedy_agreement(reference: Generation, candidate: Generation) -> float:
    """Share of the reference's generated positions before the candidate first departs from it."""
    ref, cand = reference.new_ids, candidate.new_ids
    same = (ref[: cand.numel()] == cand[: ref.numel()]).int()
    return float(same.cumprod(0).sum()) / max(1, ref.numel())


def accuracy(gens: list[Generation]) -> float:
    """Share of generations whose retrieval answer came out (samples without an answer count as wrong)."""
    return sum(g.correct is True for g in gens) / len(gens)


RETRIEVAL_MIN_SHARE = 0.5  # the reference must retrieve at least half of the prompts ...
RETRIEVAL_MIN_CORRECT = 3  # ... and at least this many, before sparse-vs-dense accuracy means anything
LOGIT_CHUNK_ELEMENTS = 1 << 25  # positions x vocab per lm-head chunk: 128 MiB of fp32 per tensor


@dataclass
class Run:
    """One attention setting (dense, or an artifact) over held-out samples.

    hidden: per sample, the final hidden states [N, H] (model dtype) of prompt (+ answer) ids;
    generations: per retrieval sample, the greedy Generation (empty for natural text);
    audit: per layer, the sparse prefill's attention-output errors against dense (audit runs)."""

    hidden: list[torch.Tensor]
    generations: list[Generation]
    audit: dict[int, list[float]] = field(default_factory=dict)


class _Captured(Exception):
    """Raised by the lm-head pre-hook to stop a forward once the hidden states are in hand."""


def sequence_ids(sample) -> torch.Tensor:
    """The teacher-forced sequence of a sample: prompt ids, then the answer ids when it has an answer. [N]"""
    if sample.answer_ids is None:
        return sample.input_ids
    return torch.cat([sample.input_ids, sample.answer_ids])


def sequence_modality(sample) -> torch.Tensor:
    """Modality ids [N] of ``sequence_ids(sample)``: the prompt's, then text for the answer's tokens."""
    from .data.sample import TEXT

    if sample.answer_ids is None:
        return sample.modality
    return torch.cat([sample.modality, torch.full_like(sample.answer_ids, TEXT)])


def final_hidden(model, sample, artifact=None, *, min_tokens: int = 1024, audit: bool = False) -> tuple[torch.Tensor, dict]:
    """One forward of ``sequence_ids(sample)``; returns (hidden [N, H] as the lm head receives it, {layer:
    prefill audit error}). The forward stops at the lm head (a pre-hook takes its input and raises), so
    no [N, vocab] logits are made; any model with ``get_output_embeddings`` works, VLM inputs included."""
    device = next(model.parameters()).device
    ids = sequence_ids(sample)[None].to(device)
    kept: list[torch.Tensor] = []

    def take(_module, args):
        kept.append(args[0][0])
        raise _Captured

    handle = model.get_output_embeddings().register_forward_pre_hook(take)
    kwargs = dict(attention_mask=torch.ones_like(ids), use_cache=False, **{k: v.to(device) for k, v in sample.inputs.items()})
    errors: dict[int, float] = {}
    try:
        with torch.no_grad():
            if artifact is None:
                _forward_until_head(model, ids, kwargs)
            else:
                errors = _sparse_forward(model, artifact, sequence_modality(sample).to(device), ids, kwargs, min_tokens, audit)
    finally:
        handle.remove()
    return kept[0], errors


def answer_probs(model, sample, artifact=None, *, min_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced scores of each answer token after the prompt and the answer's earlier tokens: (probability
    fp32 [A], whether it is the most likely token there, bool [A]). One ``final_hidden`` forward of prompt +
    answer, the lm head over the A positions that predict the answer (t predicts t + 1), never the whole
    sequence's logits."""
    hidden, _ = final_hidden(model, sample, artifact, min_tokens=min_tokens)
    answer = sample.answer_ids.to(hidden.device)
    n, a = hidden.shape[0], answer.numel()
    with torch.no_grad():
        logprobs = _head(model)(hidden[n - a - 1 : n - 1])
    return logprobs.gather(-1, answer[:, None])[:, 0].exp().cpu(), (logprobs.argmax(-1) == answer).cpu()


def _forward_until_head(model, ids, kwargs) -> None:
    try:
        model(ids, **kwargs)
    except _Captured:
        return
    raise RuntimeError(f"{type(model).__name__} returned without calling its output embeddings; cannot score positions")


def _sparse_forward(model, artifact, modality, ids, kwargs: dict, min_tokens: int, audit: bool) -> dict[int, float]:
    """``_forward_until_head`` with the artifact applied; returns {layer: prefill audit error}."""
    from .runtime import apply, remove, runner_of, set_modality

    apply(model, artifact, min_tokens=min_tokens)
    try:
        runner = runner_of(model)
        runner.audit = {} if audit else None
        set_modality(model, modality)  # boundary heads run their region patterns on this prompt's modality ids
        _forward_until_head(model, ids, kwargs)
        return {layer: errs[0] for layer, errs in (runner.audit or {}).items()}
    finally:
        remove(model)


def attend(model, tokenizer, samples: list, artifact=None, *, min_tokens: int = 1024, audit: bool = False,
           on_prompt: Callable[[int, int], None] | None = None) -> Run:
    """``final_hidden`` for every sample, and ``generate`` for those with an answer (retrieval);
    ``on_prompt(done, total)`` after each sample, for a front end's progress display."""
    run = Run([], [])
    for done, sample in enumerate(samples, 1):
        hidden, errors = final_hidden(model, sample, artifact, min_tokens=min_tokens, audit=audit)
        run.hidden.append(hidden)
        for layer, err in errors.items():
            run.audit.setdefault(layer, []).append(err)
        if sample.answer is not None:
            run.generations.append(generate(model, tokenizer, sample, artifact, min_tokens=min_tokens))
        if on_prompt is not None:
            on_prompt(done, len(samples))
    return run


def _head(model):
    """hidden [n, H] -> fp32 log-probabilities [n, V]: the model's lm head, its final logit soft-cap (Gemma 2
    style configs) when it has one, log-softmax."""
    head = model.get_output_embeddings()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(config, "final_logit_softcapping", None)

    def logprobs(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return log_probs(logits)

    return logprobs


def position_scores(model, ids: torch.Tensor, reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of one sequence: KL(reference || candidate) of the next-token distributions [N], and the
    negative log-likelihood of the actual next token under each [N - 1] (position t predicts ids[t + 1]).

    ids [N]; reference, candidate: hidden [N, H]. The lm head runs over chunks of positions
    (LOGIT_CHUNK_ELEMENTS // vocab at a time), so only chunk x vocab fp32 values exist at once."""
    logprobs = _head(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    n = ids.numel()
    targets = ids.to(reference.device)
    kl, nll_ref, nll_cand = [], [], []
    with torch.no_grad():
        for start in range(0, n, step):
            stop = min(n, start + step)
            p, q = logprobs(reference[start:stop]), logprobs(candidate[start:stop])
            kl.append(token_kl(p, q).cpu())
            nxt = targets[start + 1 : stop + 1]
            nll_ref.append(token_nll(p[: nxt.numel()], nxt).cpu())
            nll_cand.append(token_nll(q[: nxt.numel()], nxt).cpu())
    return torch.cat(kl), torch.cat(nll_ref), torch.cat(nll_cand)


def teacher_forced(model, samples: list, reference: Run, candidate: Run, *, min_tokens: int) -> dict:
    """Teacher-forced comparison over every position of every sample (``position_scores``), pooled over
    positions: mean KL and each side's perplexity, over all positions and over the tail (0-based positions
    >= min_tokens: the runtime runs sparse only on sequences of at least min_tokens, and early queries lie
    inside every pattern's sink/local band, so the tail is where sparse attention differs from dense).
    Also the KL at the position after each prompt (what the next-token check measured before)."""
    kls, refs, cands, after_prompt = [], [], [], []
    for sample, h_ref, h_cand in zip(samples, reference.hidden, candidate.hidden):
        kl, nll_ref, nll_cand = position_scores(model, sequence_ids(sample), h_ref, h_cand)
        kls.append(kl)
        refs.append(nll_ref)
        cands.append(nll_cand)
        after_prompt.append(float(kl[len(sample) - 1]))
    tail = [slice(min_tokens, None)] * len(kls)
    lengths = [int(k.numel()) for k in kls]
    return {
        "positions": "every position of prompt + answer (natural text: the whole window); KL over all N per sequence, perplexity over the N - 1 with a next token",
        "tokens": sum(lengths),
        "kl_mean": _pooled_mean(kls),
        "ppl_dense": _pooled_ppl(refs),
        "ppl_sparse": _pooled_ppl(cands),
        "tail_from": min_tokens,
        "tail_tokens": sum(max(0, n - min_tokens) for n in lengths),
        "kl_tail_mean": _pooled_mean([k[t] for k, t in zip(kls, tail)]),
        "ppl_dense_tail": _pooled_ppl([r[t] for r, t in zip(refs, tail)]),
        "ppl_sparse_tail": _pooled_ppl([c[t] for c, t in zip(cands, tail)]),
        "sparse_ran": all(n >= min_tokens for n in lengths),
        "next_token_kl": round(sum(after_prompt) / len(after_prompt), 6),
    }


def _pooled_mean(values: list[torch.Tensor]) -> float | None:
    joined = torch.cat([v.double() for v in values]) if values else torch.zeros(0)
    return None if joined.numel() == 0 else round(float(joined.mean()), 6)


def _pooled_ppl(nlls: list[torch.Tensor]) -> float | None:
    mean = _pooled_mean(nlls)
    return None if mean is None else round(float(torch.tensor(mean).exp()), 4)


def retrieval(reference: list[Generation], candidate: list[Generation], depths: list[float] | None = None) -> dict | None:
    """Retrieval counts (k/n) of reference and candidate, and a verdict: "informative" when the reference
    retrieves at least RETRIEVAL_MIN_CORRECT prompts and RETRIEVAL_MIN_SHARE of them, else "uninformative:
    dense retrieves k/n" (a sparse 0/n beside a dense 0/n says nothing about the sparse pattern).
    None when no sample has an answer (natural text)."""
    if not reference:
        return None
    n = len(reference)
    dense, sparse = sum(g.correct is True for g in reference), sum(g.correct is True for g in candidate)
    informative = dense >= RETRIEVAL_MIN_CORRECT and dense >= RETRIEVAL_MIN_SHARE * n
    return {
        "n": n, "dense_correct": dense, "sparse_correct": sparse, "depths": depths,
        "verdict": "informative" if informative else f"uninformative: dense retrieves {dense}/{n}",
        "rule": f"informative when dense retrieves >= {RETRIEVAL_MIN_CORRECT} prompts and >= {RETRIEVAL_MIN_SHARE:.0%} of them",
    }


def compare(model, samples: list, reference: Run, candidate: Run, *, min_tokens: int, depths: list[float] | None = None) -> dict:
    """The fidelity report of ``candidate`` against ``reference`` on ``samples`` (the module docstring)."""
    tf = teacher_forced(model, samples, reference, candidate, min_tokens=min_tokens)
    gens = list(zip(reference.generations, candidate.generations))
    ret = retrieval(reference.generations, candidate.generations, depths)
    return {
        "next_token_kl": tf["next_token_kl"],
        "greedy_agreement": round(sum(greedy_agreement(r, c) for r, c in gens) / len(gens), 4) if gens else None,
        "dense_accuracy": accuracy(reference.generations) if gens else None,
        "sparse_accuracy": accuracy(candidate.generations) if gens else None,
        "teacher_forced": tf,
        "retrieval": ret,
    }


def check_options(*, samples: int, tokens: int, min_tokens: int) -> None:
    """The options of a fidelity run, before any model loads (ValueError, one line naming the option):
    at least one sample, and a runtime threshold the prompts reach — with ``min_tokens`` above ``tokens``
    every prompt runs dense and the comparison could not fail."""
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if min_tokens < 1:
        raise ValueError(f"--min-tokens must be >= 1, got {min_tokens}")
    if min_tokens > tokens:
        raise ValueError(f"--min-tokens {min_tokens} > --tokens {tokens}: every prompt would run dense and the check could not fail")


def held_out_samples(data: str, tokenizer, *, samples: int, tokens: int, seed: int = 0) -> tuple[list, list[float] | None]:
    """(samples, depths): ``samples`` held-out prompts of ``data`` (seeds seed .. seed + samples - 1); for a
    retrieval set the needle depths are spread evenly, (i + 0.5) / samples, instead of drawn."""
    from .data import held_out, is_retrieval_spec

    depths = [(i + 0.5) / samples for i in range(samples)] if is_retrieval_spec(data) else None
    found = [held_out(data, tokenizer, max_tokens=tokens, seed=seed + i, **({"depth": depths[i]} if depths else {}))
             for i in range(samples)]
    return found, None if depths is None else [round(d, 4) for d in depths]


@dataclass
class Reference:
    """The model's own outputs on a fixed set of prompts, computed once and compared with any number of
    artifacts (a target search compares a dozen allocations with the same dense run).

    data: the prompts' spec; samples: the prompts; depths: needle depths of retrieval prompts (None
    otherwise); run: the dense Run (final hidden states [N, H] per prompt, greedy generations)."""

    data: str
    samples: list
    depths: list[float] | None
    run: Run


def dense_reference(model, tokenizer, samples: list, *, data: str, depths: list[float] | None = None,
                    on_prompt: Callable[[int, int], None] | None = None) -> Reference:
    """``attend`` with the model's own attention over ``samples``, kept as a Reference."""
    if not samples:
        raise ValueError("a fidelity reference needs at least one prompt")
    return Reference(data, list(samples), depths, attend(model, tokenizer, samples, on_prompt=on_prompt))


def as_artifact(manifest: dict, rows: list[dict]):
    """An in-memory artifact (``manifest`` + ``heads``, what runtime.apply reads) from a manifest and heads rows
    that were never written: the candidate allocations a target search measures."""
    from types import SimpleNamespace

    import pandas as pd

    return SimpleNamespace(manifest=manifest, heads=pd.DataFrame(rows))


def evaluate_against(model, tokenizer, manifest: dict, rows: list[dict], reference: Reference, *, min_tokens: int = 1024,
                     on_prompt: Callable[[int, int], None] | None = None) -> dict:
    """The artifact (manifest + heads rows) through the sparse runtime on the reference's prompts, compared
    with the reference's dense run (no dense forward here). Returns ``evaluate_fidelity``'s report."""
    from .artifacts.summary import effective_densities

    prompts = reference.samples
    artifact = as_artifact(manifest, rows)
    sparse = attend(model, tokenizer, prompts, artifact, min_tokens=min_tokens, audit=True, on_prompt=on_prompt)
    densities = [d for d in effective_densities(manifest, rows).values() if d is not None]  # imported rows have none
    return {
        "eval_data": reference.data, "samples": len(prompts), "tokens": max(len(p) for p in prompts),
        **compare(model, prompts, reference.run, sparse, min_tokens=min_tokens, depths=reference.depths),
        "mean_density": None if not densities else round(sum(densities) / len(densities), 4),
        "layer_output_error": {str(k): round(sum(v) / len(v), 6) for k, v in sorted(sparse.audit.items())},
    }


def held_out_reference(model, tokenizer, *, data: str, samples: int, tokens: int, seed: int = 0,
                       on_prompt: Callable[[int, int], None] | None = None) -> Reference:
    """``dense_reference`` over ``held_out_samples``."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    prompts, depths = held_out_samples(data, tokenizer, samples=samples, tokens=tokens, seed=seed)
    return dense_reference(model, tokenizer, prompts, data=data, depths=depths, on_prompt=on_prompt)


def evaluate_fidelity(model, tokenizer, manifest: dict, rows: list[dict], *, data: str, samples: int, tokens: int,
                      seed: int = 0, min_tokens: int = 1024, progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Held-out samples of ``data`` (``held_out_samples``): dense vs the artifact (manifest + heads rows)
    through the sparse runtime. Returns ``compare``'s report (teacher-forced KL and perplexity over every
    position, next-token KL, greedy agreement and retrieval counts with a verdict for retrieval data) plus
    eval_data, samples, tokens (the longest prompt), mean effective density and each layer's
    attention-output error measured inside the sparse prefill (runtime audit). To compare several
    artifacts with one dense run: ``held_out_reference`` once, then ``evaluate_against`` per artifact.
    ``progress(pass, done, total)`` after each prompt of the dense pass and of the sparse pass."""
    reference = held_out_reference(model, tokenizer, data=data, samples=samples, tokens=tokens, seed=seed,
                                   on_prompt=_one_pass(progress, "dense"))
    return evaluate_against(model, tokenizer, manifest, rows, reference, min_tokens=min_tokens, on_prompt=_one_pass(progress, "sparse"))


def _one_pass(progress: Callable[[str, int, int], None] | None, name: str) -> Callable[[int, int], None] | None:
    """``progress`` with the pass's name bound: the per-prompt callback of ``attend``."""
    return None if progress is None else (lambda done, total: progress(name, done, total))


def describe(result: dict) -> list[str]:
    """Lines for people (the CLIs' tables): teacher-forced KL and perplexity, then retrieval with counts
    or the reason it says nothing."""
    tf = result.get("teacher_forced")
    lines = [f"{result['eval_data']}, {result['samples']} prompt(s) of up to {result['tokens']} tokens"]
    if tf:
        lines.append(
            f"teacher-forced over {tf['tokens']} positions: KL(dense||sparse) {tf['kl_mean']:.4f}, perplexity dense "
            f"{tf['ppl_dense']:.3f} vs sparse {tf['ppl_sparse']:.3f}"
            + ("" if not tf["tail_tokens"] else
               f"; positions >= {tf['tail_from']}: KL {tf['kl_tail_mean']:.4f}, perplexity {tf['ppl_dense_tail']:.3f} vs {tf['ppl_sparse_tail']:.3f}")
            + ("" if tf["sparse_ran"] else f" (some prompts are shorter than min_tokens {tf['tail_from']} and ran dense)")
        )
    lines.append(f"next-token KL after the prompt {result['next_token_kl']:.4f}"
                 + ("" if result.get("greedy_agreement") is None else f", greedy agreement {result['greedy_agreement']:.0%}")
                 + ("" if result.get("mean_density") is None else f", mean density {result['mean_density']:.1%}"))
    ret = result.get("retrieval")
    if ret:
        counts = f"dense {ret['dense_correct']}/{ret['n']} vs sparse {ret['sparse_correct']}/{ret['n']}"
        lines.append(f"retrieval: {counts}" if ret["verdict"] == "informative" else f"retrieval: {ret['verdict']} (sparse {ret['sparse_correct']}/{ret['n']})")
    elif result.get("dense_accuracy") is not None:  # an artifact written before the counts existed
        lines.append(f"retrieval dense {result['dense_accuracy']:.0%} vs sparse {result['sparse_accuracy']:.0%} (old report: no counts)")
    keys = result.get("keys")  # sparsesearch/keycheck.py's block, where the caller read the answers teacher-forced
    if keys:
        held = f"dense holds {keys['dense_holds']}/{keys['n']} keys"
        lines.append(f"keys (teacher-forced): {held}, sparse keeps {keys['kept']}, loses {keys['lost']} (worst digit at {keys['worst_ratio']:.2f} of dense)"
                     if keys["lost"] is not None else f"keys (teacher-forced): {held}: nothing to lose")
    return lines
