"""load_calibration / held_out: one entry point for file and synthetic calibration data."""

from __future__ import annotations

from pathlib import Path

from ._text import as_tokenizer
from .files import MIN_TOKENS, open_rows, seeded_order, usable_samples
from .natural import check_text, is_text_spec, text_samples
from .sample import Sample
from .synthetic import GENERATORS
from .visual import is_processor

HELD_OUT_OFFSET = 10_000  # held_out(seed) generates synthetic sets with seed + HELD_OUT_OFFSET
_CHAT_SETS = ("synthetic:kv-retrieval", "synthetic:passkey")


def _check(max_tokens: int, samples: int = 1) -> None:
    if max_tokens < MIN_TOKENS:
        raise ValueError(f"max_tokens must be >= {MIN_TOKENS}, got {max_tokens}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")


def _generate(spec: str, tok, *, max_tokens: int, seed: int, chat: bool, frame_tokens, edit_rate, depth=None) -> Sample:
    check_spec(spec)
    generator = GENERATORS[spec]
    if spec in _CHAT_SETS:
        return generator(tok, max_tokens=max_tokens, seed=seed, chat=chat, depth=depth)
    if depth is not None:
        raise ValueError(f"depth applies to retrieval sets ({', '.join(_CHAT_SETS)}), not {spec}")
    return generator(tok, max_tokens=max_tokens, seed=seed, frame_tokens=frame_tokens, edit_rate=edit_rate)


def is_retrieval_spec(spec: str) -> bool:
    """Whether ``spec`` is a retrieval set (its samples carry an answer and take a needle depth)."""
    return spec in _CHAT_SETS


def _resolve_path(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"calibration file not found: {path}")
    return path.resolve()


def check_spec(spec: str, *, tokens: int | None = None, held_out: bool = False) -> None:
    """Refuse a data spec before any model is loaded: an unknown synthetic or text set, a missing path, or
    a file that cannot be decoded or has no prompt column (ValueError naming it). Files are opened and their
    rows read, which is what loading does first anyway; tokenizing waits for the tokenizer. Natural text
    (``text:shakespeare``, .txt/.md) whose calibration (or ``held_out``) part cannot hold ``tokens``
    tokens is refused here too (data/natural.py)."""
    if is_text_spec(spec):
        check_text(spec, tokens=tokens, held_out=held_out)
        return
    if spec.startswith("synthetic:"):
        if spec not in GENERATORS:
            raise ValueError(f"unknown synthetic set '{spec}'; choose from {', '.join(GENERATORS)}")
        return
    open_rows(_resolve_path(spec))


def load_calibration(
    spec: str,
    tokenizer,
    *,
    max_tokens: int,
    samples: int = 1,
    seed: int = 0,
    chat: bool = True,
    frame_tokens: int | None = None,
    edit_rate: float = 0.03,
) -> list[Sample]:
    """Calibration samples from a file, a ``datasets`` directory or a synthetic set.

    spec:         ``synthetic:kv-retrieval`` | ``synthetic:passkey`` | ``synthetic:frames`` |
                  ``synthetic:mixed`` | a ``.jsonl`` / ``.parquet`` file | a save_to_disk directory.
    tokenizer:    a transformers tokenizer, or a VLM's processor: its ``.tokenizer`` for text, the processor
                  itself for chat rows with images or videos (data/visual.py).
    max_tokens:   length cap per sample, >= 64. Files keep each row's first ``max_tokens`` tokens and skip
                  rows under 64 tokens; synthetic samples fill it (<= max_tokens, >= 90% of it).
    samples:      how many samples, >= 1. Synthetic sample i uses seed ``seed + i``; files take the first
                  ``samples`` usable rows in a ``random.Random(seed)`` shuffle of the rows.
    chat:         kv-retrieval and passkey only: wrap the prompt in the tokenizer's chat template when it
                  has one (``Sample.meta["chat"]`` says whether it was). Rows with ``messages`` always use
                  the template when there is one.
    frame_tokens: frames and mixed only: tokens per frame (the frame stride); default chosen from
                  max_tokens. edit_rate: share of a frame's tokens replaced per frame.
    Returns a list of ``samples`` Samples; the same arguments always give the same ids.
    Raises ValueError naming the bad value: unknown synthetic set, missing file, unknown columns, bad
    max_tokens / samples, a file with too few usable rows.
    """
    _check(max_tokens, samples)
    tok = as_tokenizer(tokenizer)
    if is_text_spec(spec):
        return text_samples(spec, tok, max_tokens=max_tokens, seeds=[seed + i for i in range(samples)], held_out=False)
    if spec.startswith("synthetic:"):
        options = dict(chat=chat, frame_tokens=frame_tokens, edit_rate=edit_rate)
        return [_generate(spec, tok, max_tokens=max_tokens, seed=seed + i, **options) for i in range(samples)]
    path = _resolve_path(spec)
    rows = open_rows(path)
    found = usable_samples(tok, rows, seeded_order(len(rows), seed), max_tokens=max_tokens, source=str(path),
                           processor=tokenizer if is_processor(tokenizer) else None)
    out = [sample for _, sample in zip(range(samples), found)]
    if not out:
        raise ValueError(f"no sample in {path} has >= {MIN_TOKENS} tokens (rows with images or videos must also fit in max_tokens={max_tokens})")
    if len(out) < samples:
        raise ValueError(
            f"only {len(out)} rows of {path} have >= {MIN_TOKENS} tokens; asked for samples={samples}"
        )
    for sample in out:
        sample.meta["seed"] = seed
    return out


def held_out(
    spec: str,
    tokenizer,
    *,
    max_tokens: int,
    seed: int = 0,
    chat: bool = True,
    frame_tokens: int | None = None,
    edit_rate: float = 0.03,
    depth: float | None = None,
) -> Sample:
    """One evaluation sample that ``load_calibration(spec, ..., seed=seed)`` does not return.

    Synthetic sets: generated with seed ``seed + HELD_OUT_OFFSET`` (10_000), disjoint from calibration
    samples seed .. seed + samples - 1 while samples <= 10_000; ``depth`` in [0, 1] (retrieval sets only)
    places the needle / queried pair instead of the seed. Natural text: a window of the held-out part
    (data/natural.py: the tragedies of text:shakespeare, the second half of a .txt/.md file), never the
    calibration part. Files: the *last* usable row of the same seeded shuffle that calibration reads from
    the front, so it differs from every calibration row as long as the file has more usable rows than
    calibration took.
    """
    _check(max_tokens)
    tok = as_tokenizer(tokenizer)
    if is_text_spec(spec):
        sample = text_samples(spec, tok, max_tokens=max_tokens, seeds=[seed], held_out=True)[0]
        sample.meta["held_out"] = True
        return sample
    if spec.startswith("synthetic:"):
        sample = _generate(
            spec, tok, max_tokens=max_tokens, seed=seed + HELD_OUT_OFFSET, chat=chat,
            frame_tokens=frame_tokens, edit_rate=edit_rate, depth=depth,
        )
        sample.meta["held_out"] = True
        return sample
    path = _resolve_path(spec)
    rows = open_rows(path)
    order = seeded_order(len(rows), seed)[::-1]
    sample = next(usable_samples(tok, rows, order, max_tokens=max_tokens, source=str(path),
                                 processor=tokenizer if is_processor(tokenizer) else None), None)
    if sample is None:
        raise ValueError(f"no sample in {path} has >= {MIN_TOKENS} tokens")
    sample.meta.update(seed=seed, held_out=True)
    return sample


_STRIP = " \t\r\n\"'`"


def retrieval_correct(generated_text: str, sample: Sample) -> bool:
    """Whether a generation starts with the sample's answer (case-insensitive), after stripping leading
    whitespace and quotes; the answer must end there or be followed by a non-alphanumeric character, so
    "71432." is right and "714329" is wrong."""
    if sample.answer is None:
        raise ValueError(
            f"sample from {sample.source or 'unknown source'} has no answer; retrieval_correct needs a "
            "retrieval sample (synthetic:kv-retrieval or synthetic:passkey)"
        )
    got = generated_text.lstrip(_STRIP).casefold()
    want = sample.answer.strip(_STRIP).casefold()
    if not want or not got.startswith(want):
        return False
    rest = got[len(want) :]
    return not rest or not rest[0].isalnum()
