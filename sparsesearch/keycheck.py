"""Passkey keys read teacher-forced: the one rule calibrate's retrieval guard, ``sparsesearch pareto`` and
``sparsesearch evaluate`` call a key held by dense and lost by a sparse artifact.

Greedy answers judge the format as much as the key: SmolLM2 starts its answer with " " at p 0.30 against " a" at
0.32, Gemma 3 with " " at 0.31-0.38 against " the" at 0.24-0.27, and any sparse point could flip that token
(RESULTS Run 38). So each answer token that carries a character of the key (``key_steps``: whitespace is format)
is read after the prompt and the answer's earlier tokens (``fidelity.answer_probs``, one forward per prompt):
- dense *holds* a key when every such token is its most likely token there;
- an artifact *loses* a key dense holds when one of them falls below KEEPS of its dense probability.
Prompts dense does not hold are never run sparse: a key dense cannot give is no key to lose.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from .search.targets import KeyCheck

KEEPS = 0.5  # a sparse point loses a key when a digit's probability halves: rounding moves it by a few percent
DRAWS = 4  # reading until dense holds N keys stops after N x DRAWS prompts (calibrate's guard, pareto --keys)


class DenseKeys(NamedTuple):
    """The dense side of a key check on P passkey prompts (``dense_keys``): samples, the prompts; steps, per prompt
    the indices of its answer tokens that carry the key (``key_steps``); dense, per prompt dense's teacher-forced
    probability of each of those tokens, fp32 [len(steps[i])]; held, the indices of the prompts whose key dense
    retrieves (every key token dense's most likely token there)."""

    samples: list
    steps: list[list[int]]
    dense: list
    held: list[int]


def dense_keys(model, tokenizer, samples: list) -> DenseKeys:
    """The model's own attention on ``samples`` (passkey prompts with answers): one teacher-forced forward each
    (``fidelity.answer_probs``), read as ``DenseKeys``."""
    from .fidelity import answer_probs

    steps = [key_steps(tokenizer, s.answer_ids) for s in samples]
    scored = [answer_probs(model, s) for s in samples]
    dense = [p[k] for (p, _), k in zip(scored, steps)]
    held = [i for i, ((_, top), k) in enumerate(zip(scored, steps)) if k and bool(top[k].all())]
    return DenseKeys(list(samples), steps, dense, held)


def dense_keys_until(model, tokenizer, draw: Callable[[int], object], want: int, limit: int | None = None) -> DenseKeys:
    """``dense_keys`` over draw(0), draw(1), ... (a prompt each) until dense holds ``want`` keys or ``limit``
    prompts were read (default want x DRAWS). A fixed count says little where dense holds few: Gemma 3 at 16K held 1 of 4 held-out
    keys, the one nearest the end, which every A-shape keeps (RESULTS Run 40)."""
    samples, steps, dense, held = [], [], [], []
    for j in range(want * DRAWS if limit is None else limit):
        one = dense_keys(model, tokenizer, [draw(j)])
        samples += one.samples
        steps += one.steps
        dense += one.dense
        held += [j] * len(one.held)
        if len(held) >= want:
            break
    return DenseKeys(samples, steps, dense, held)


def read_keys(model, keys: DenseKeys, artifact, *, min_tokens: int = 1) -> KeyCheck:
    """KeyCheck of ``artifact`` (``manifest`` + ``heads``, ``fidelity.as_artifact``; ``min_tokens``: the runtime's
    dense cut-off, 1 for the patterns at every length) on the prompts whose key dense holds (``keys.held``, at
    least one): misses, those where a key token falls below KEEPS x its dense probability; worst, the lowest
    sparse / dense ratio of any such token. One sparse forward per held prompt."""
    from .fidelity import answer_probs

    ratio = [answer_probs(model, keys.samples[i], artifact, min_tokens=min_tokens)[0][keys.steps[i]] / keys.dense[i] for i in keys.held]
    return KeyCheck(sum(bool((r < KEEPS).any()) for r in ratio), min(float(r.min()) for r in ratio))


def key_steps(tokenizer, answer_ids) -> list[int]:
    """Indices of the answer tokens that carry its characters: a whitespace token (" " before the digits) is
    the answer's format, not the key."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor holds its tokenizer
    return [i for i, t in enumerate(answer_ids.tolist()) if tok.decode([t]).strip()]


def keys_report(model, keys: DenseKeys, artifact, *, min_tokens: int = 1) -> dict:
    """The key check as a report's block: prompts read, keys dense holds, those the artifact keeps and loses,
    the lowest sparse / dense ratio of a held key token (None when dense holds none: no claim either way)."""
    report = {"n": len(keys.samples), "dense_holds": len(keys.held), "rule": f"held by dense: every key token its most "
              f"likely token; lost: one below {KEEPS} x its dense p (teacher-forced)"}
    if not keys.held:
        return {**report, "kept": None, "lost": None, "worst_ratio": None}
    check = read_keys(model, keys, artifact, min_tokens=min_tokens)
    return {**report, "kept": len(keys.held) - check.misses, "lost": check.misses, "worst_ratio": round(check.worst, 6)}
