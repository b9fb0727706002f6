"""Tokenizer helpers shared by the file loaders and the synthetic generators."""

from __future__ import annotations

from collections.abc import Callable

import torch


def as_tokenizer(tokenizer):
    """The text tokenizer of a tokenizer or a processor (processors keep it in ``.tokenizer``)."""
    inner = getattr(tokenizer, "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "encode") else tokenizer


def encode(tok, text: str, *, special: bool) -> list[int]:
    """Token ids of ``text``; ``special`` adds what the tokenizer adds to a whole prompt (BOS on Llama)."""
    return list(tok(text, add_special_tokens=special)["input_ids"])


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None)) and hasattr(tok, "apply_chat_template")


def render_chat(tok, messages: list[dict], *, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def answer_ids(tok, prompt_text: str, prompt_ids: list[int], continuation: str, *, special: bool) -> list[int]:
    """Ids of ``continuation`` as the tokenizer splits it right after ``prompt_text``.

    Tokenizes prompt + continuation as one text and keeps what follows the prompt's ids; where the two
    merge across the boundary (the prompt's ids are not a prefix), falls back to the continuation alone.
    """
    whole = encode(tok, prompt_text + continuation, special=special)
    if whole[: len(prompt_ids)] == prompt_ids and len(whole) > len(prompt_ids):
        return whole[len(prompt_ids) :]
    return encode(tok, continuation, special=False)


def first_content_index(tok, ids: list[int]) -> int:
    """Index of the first id that decodes to more than whitespace (0 when none does). SmolLM2, Llama-3
    and Qwen never merge a space into digits, so " 71432" starts with a lone space token."""
    for i, token in enumerate(ids):
        if tok.decode([token]).strip():
            return i
    return 0


def plain_token_ids(tok) -> list[int]:
    """Every id of the vocabulary except special and added tokens: what random "visual" tokens draw from."""
    excluded = set(getattr(tok, "all_special_ids", []) or [])
    excluded.update((tok.get_added_vocab() if hasattr(tok, "get_added_vocab") else {}).values())
    return [i for i in range(len(tok)) if i not in excluded]


def largest_fitting(length_of: Callable[[int], int], limit: int, *, start: int = 0, most: int) -> int | None:
    """Largest n in [start, most] with ``length_of(n) <= limit``, or None when even ``start`` is too long.

    ``length_of`` is the token count of a prompt built with n units (pairs, sentences, padding lines); it
    grows with n, almost linearly, so an interpolation guess from the measured slope lands within a step
    or two and bisection finishes. Every n returned was measured, so the bound holds exactly.
    """
    cache: dict[int, int] = {}

    def length(n: int) -> int:
        if n not in cache:
            cache[n] = length_of(n)
        return cache[n]

    if length(start) > limit:
        return None
    lo, hi = start, most + 1  # length(lo) <= limit; hi is the first n known (or assumed) too long
    guess = start + 1
    while hi - lo > 1:
        guess = min(max(guess, lo + 1), hi - 1)
        if length(guess) <= limit:
            lo = guess
        else:
            hi = guess
        base = lo if lo > start else guess
        slope = (length(base) - length(start)) / (base - start) if base > start else 0.0
        if slope > 0:
            guess = lo + max(1, int((limit - length(lo)) / slope))
            if guess >= hi:
                guess = (lo + hi) // 2 if hi - lo > 2 else lo + 1
        else:
            guess = (lo + hi) // 2 if hi <= most else lo * 2 + 1
    return lo


def as_long(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)
