"""Synthetic calibration sets, generated from ``random.Random(seed)`` so the same seed gives the same ids.

Each generator fills ``max_tokens`` as closely as it can: never above it, at least 90% of it
(kv-retrieval and passkey land within a few tokens; frames and mixed hit it exactly).

- ``synthetic:kv-retrieval`` -- the key-value retrieval prompt of TriangleMix (paper 002, App. A.1): a JSON
  object of UUID v4 key -> value pairs, one key asked for; the answer is its value. The paper's gradient
  probing target y_gt is ``answer_ids[0]``.
- ``synthetic:passkey`` -- a 5-digit pass key hidden at a seeded depth in repeated filler sentences; the
  prompt ends "The pass key is" and the answer is the digits.
- ``synthetic:frames`` -- a short text instruction, then F "frames" of T random token ids (one frame
  repeated with a few percent of its tokens replaced per frame, marked VIDEO), then a text question.
  ``meta["frame_stride"] = T`` tells a grid search the period of the video part.
- ``synthetic:mixed`` -- video clips of such frames interleaved with natural text segments, about 25% text
  tokens, like MM-NIAH's interleaved documents.

Chat: kv-retrieval and passkey take ``chat=True`` (default): when the tokenizer has a chat template the
prompt is the user turn, rendered with the generation prompt, and (passkey) "The pass key is" is put at
the start of the assistant turn, so the answer's tokens follow the prompt directly. Without a template,
or with ``chat=False``, the prompt is plain text with the tokenizer's own special tokens (BOS).
``meta["chat"]`` records which one was used.
"""

from __future__ import annotations

import json
import random
import uuid

import torch

from ._text import (
    answer_ids,
    as_long,
    first_content_index,
    encode,
    has_chat_template,
    largest_fitting,
    plain_token_ids,
    render_chat,
)
from .sample import TEXT, VIDEO, Sample

# --------------------------------------------------------------------------------------------- kv-retrieval


def _depth(drawn: float, given: float | None) -> float:
    """The needle's depth: ``given`` when set (checked to lie in [0, 1]), else the seeded draw. The draw
    happens either way, so the rest of the sample (key, pairs) is the same for a seed at any depth."""
    if given is None:
        return drawn
    if not 0.0 <= given <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {given}")
    return float(given)


# Wording of paper 002, App. A.1 ("Prompt for Attention Importance Probing").
KV_HEAD = "Extract the value corresponding to the specified key in the data below.\n\nData:\n"
KV_TAIL = (
    "\nExtract the value corresponding to this key:\nkey: {key}\n"
    "Please directly output the corresponding value without outputting anything else.\nvalue:"
)


def uuid4_from(rng: random.Random) -> str:
    """A version-4 UUID string drawn from ``rng`` (uuid.uuid4 reads os.urandom and cannot be seeded)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_retrieval(tok, *, max_tokens: int, seed: int, chat: bool = True, depth: float | None = None) -> Sample:
    """Paper 002 App. A.1 prompt with as many UUID pairs as fit in ``max_tokens``.

    The data is a JSON object, one ``"key": "value"`` pair per line. The queried pair sits at a seeded
    fraction of the list, or at ``depth`` in [0, 1] when given (evaluation spreads depths over samples). The gap left after the last whole pair (less than one pair, ~70 tokens on
    SmolLM2) is padded with blank lines (" \\n", one token each on SmolLM2) after the JSON, so the length
    ends within a token or two of ``max_tokens``; at small max_tokens (a few pairs) that padding is a
    large share of the prompt. ``meta``: pairs, query_index, query_key, pad_lines, chat,
    answer_continuation, answer_content_index (first answer token that is not whitespace).
    """
    rng = random.Random(seed)
    where = rng.random()  # drawn first: the queried position does not depend on how many pairs fit
    where = _depth(where, depth)
    pairs: list[tuple[str, str]] = []
    use_chat = chat and has_chat_template(tok)

    def pair(i: int) -> tuple[str, str]:
        while len(pairs) <= i:
            pairs.append((uuid4_from(rng), uuid4_from(rng)))
        return pairs[i]

    def build(n: int, pad: int) -> tuple[str, str, list[int], str]:
        data = json.dumps(dict(pair(i) for i in range(n)), indent=0)
        key = pair(min(int(where * n), n - 1))[0]
        prompt = KV_HEAD + data + "\n" + " \n" * pad + KV_TAIL.format(key=key)
        if use_chat:
            text = render_chat(tok, [{"role": "user", "content": prompt}], generation_prompt=True)
            return text, key, encode(tok, text, special=False), ""
        return prompt, key, encode(tok, prompt, special=True), " "

    n = largest_fitting(lambda k: len(build(k, 0)[2]), max_tokens, start=1, most=max_tokens)
    if n is None:
        need = len(build(1, 0)[2])
        raise ValueError(
            f"synthetic:kv-retrieval needs max_tokens >= {need} with this tokenizer (template and one "
            f"key-value pair), got {max_tokens}"
        )
    pad = largest_fitting(lambda k: len(build(n, k)[2]), max_tokens, start=0, most=max_tokens)
    text, key, ids, space = build(n, pad)
    query_index = min(int(where * n), n - 1)
    value = pairs[query_index][1]
    ans = answer_ids(tok, text, ids, space + value, special=not use_chat)
    return Sample(
        input_ids=as_long(ids),
        modality=torch.full((len(ids),), TEXT, dtype=torch.long),
        text=text,
        answer=value,
        answer_ids=as_long(ans),
        source="synthetic:kv-retrieval",
        meta={
            "set": "kv-retrieval",
            "seed": seed,
            "chat": use_chat,
            "pairs": n,
            "depth": where,
            "query_index": query_index,
            "query_key": key,
            "pad_lines": pad,
            "answer_continuation": space + value,
            "answer_content_index": first_content_index(tok, ans),
        },
    )


# --------------------------------------------------------------------------------------------- passkey

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_LEAD = "The pass key is"


def passkey(tok, *, max_tokens: int, seed: int, chat: bool = True, depth: float | None = None) -> Sample:
    """Pass-key retrieval: intro, filler sentences (cycled) with the needle at a seeded depth (or at
    ``depth`` in [0, 1] when given: 0 right after the intro, 1 right before the question), question.

    Plain: ``intro filler… needle …filler\\nWhat is the pass key? The pass key is``; chat: the same up to
    the question as the user turn, then "The pass key is" opening the assistant turn. The 5-digit key and
    the depth come from the seed. ``meta``: key, depth, sentences, needle_token_index, chat,
    answer_continuation (" 71432"), answer_content_index (1 on SmolLM2: answer_ids[0] is the space).
    """
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = _depth(rng.random(), depth)
    needle = PASSKEY_NEEDLE.format(key=key)
    use_chat = chat and has_chat_template(tok)

    def build(n: int) -> tuple[str, list[int], str]:
        at = min(int(depth * (n + 1)), n)
        sentences = [PASSKEY_FILLER[i % len(PASSKEY_FILLER)] for i in range(n)]
        haystack = " ".join([PASSKEY_INTRO, *sentences[:at], needle, *sentences[at:]])
        if use_chat:
            text = render_chat(
                tok, [{"role": "user", "content": f"{haystack}\n{PASSKEY_QUESTION}"}], generation_prompt=True
            )
            text += PASSKEY_LEAD
            return text, encode(tok, text, special=False), haystack
        text = f"{haystack}\n{PASSKEY_QUESTION} {PASSKEY_LEAD}"
        return text, encode(tok, text, special=True), haystack

    n = largest_fitting(lambda k: len(build(k)[1]), max_tokens, start=0, most=max_tokens)
    if n is None:
        raise ValueError(
            f"synthetic:passkey needs max_tokens >= {len(build(0)[1])} with this tokenizer (intro, needle and "
            f"question alone), got {max_tokens}"
        )
    text, ids, haystack = build(n)
    ans = answer_ids(tok, text, ids, " " + key, special=not use_chat)
    # Token index where the needle starts: the ids of the text before it (a boundary at a space).
    before = text[: text.index(needle)].rstrip(" ")
    needle_at = len(encode(tok, before, special=not use_chat))
    return Sample(
        input_ids=as_long(ids),
        modality=torch.full((len(ids),), TEXT, dtype=torch.long),
        text=text,
        answer=key,
        answer_ids=as_long(ans),
        source="synthetic:passkey",
        meta={
            "set": "passkey",
            "seed": seed,
            "chat": use_chat,
            "key": key,
            "depth": depth,
            "sentences": n,
            "needle_token_index": needle_at,
            "answer_continuation": " " + key,
            "answer_content_index": first_content_index(tok, ans),
        },
    )


# --------------------------------------------------------------------------------------------- frames, mixed

# Natural sentences for the text parts of frames/mixed (varied, unlike the passkey filler).
PROSE = (
    "The river runs past the old mill and turns toward the hills.",
    "In the morning the market fills with people buying bread and fruit.",
    "She wrote the results in a notebook and checked them twice.",
    "A light rain began to fall as the train left the station.",
    "The committee met on Tuesday to discuss the new budget.",
    "Children played in the park while their parents talked on the benches.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "He repaired the bicycle with a borrowed wrench and some patience.",
    "The museum opens at ten and closes early on Sundays.",
    "Clouds gathered over the harbour and the boats came in.",
    "The report describes how the bridge was built over three years.",
    "They planted tomatoes, beans and a row of sunflowers along the fence.",
    "The teacher asked the class to read the first chapter aloud.",
    "At night the city lights reflect on the surface of the lake.",
    "The engineer measured the signal and adjusted the antenna.",
    "A small dog followed the postman from house to house.",
)
FRAMES_INTRO = "The video below shows one scene over many frames."
FRAMES_QUESTION = "\nWhat changes from one frame to the next?"
MIXED_INTRO = "The following document interleaves video clips with text."
MIXED_QUESTION = "\nSummarize the document."
MIXED_TEXT_SHARE = 0.25


def _prose_ids(tok, n: int, rng: random.Random, cache: dict[str, list[int]]) -> list[int]:
    """Exactly ``n`` ids of natural text: seeded prose sentences, the last one cut."""
    out: list[int] = []
    while len(out) < n:
        sentence = rng.choice(PROSE)
        if sentence not in cache:
            cache[sentence] = encode(tok, " " + sentence, special=False)
        out.extend(cache[sentence])
    return out[:n]


class _Frames:
    """One base frame of T random plain-vocabulary ids; each frame replaces ``edit_rate`` of its positions
    (chosen afresh per frame) with other random ids, so any two frames agree on ~(1 - 2*edit_rate)."""

    def __init__(self, rng: random.Random, vocab: list[int], stride: int, edit_rate: float):
        self.rng, self.vocab, self.stride = rng, vocab, stride
        self.base = [rng.choice(vocab) for _ in range(stride)]
        self.edits = round(edit_rate * stride)

    def next(self) -> list[int]:
        frame = list(self.base)
        for p in self.rng.sample(range(self.stride), self.edits):
            frame[p] = self.rng.choice(self.vocab)
        return frame


def _check_edit_rate(edit_rate: float) -> None:
    if not 0.0 <= edit_rate < 0.5:
        raise ValueError(f"edit_rate must be in [0, 0.5), got {edit_rate}")


def _check_frame_tokens(frame_tokens: int | None) -> None:
    if frame_tokens is not None and frame_tokens < 1:
        raise ValueError(f"frame_tokens must be >= 1, got {frame_tokens}")


def frames(
    tok, *, max_tokens: int, seed: int, frame_tokens: int | None = None, edit_rate: float = 0.03
) -> Sample:
    """Video-like prompt: [intro + prose filler] TEXT, [F frames x T ids] VIDEO, [question] TEXT.

    T is ``frame_tokens`` when given (F = as many frames as fit, the rest is prose before the video);
    otherwise F and T are chosen so that F*T fills the room left by the text with T near
    clamp(room/8, 16, 256). Length is exactly ``max_tokens``. ``meta``: frame_stride (T), frames (F),
    video_start, edit_rate, segments [[start, end, modality], ...].
    """
    _check_edit_rate(edit_rate)
    _check_frame_tokens(frame_tokens)
    rng = random.Random(seed)
    intro = encode(tok, FRAMES_INTRO, special=True)
    question = encode(tok, FRAMES_QUESTION, special=False)
    room = max_tokens - len(intro) - len(question)
    stride_goal = frame_tokens or min(256, max(16, room // 8))
    if room < (frame_tokens or 16):
        need = len(intro) + len(question) + (frame_tokens or 16)
        raise ValueError(f"synthetic:frames needs max_tokens >= {need} with this tokenizer, got {max_tokens}")
    if frame_tokens:
        stride, count = frame_tokens, room // frame_tokens
    else:
        count = max(1, round(room / stride_goal))
        stride = room // count
    filler = _prose_ids(tok, room - count * stride, rng, {})
    video = _Frames(rng, plain_token_ids(tok), stride, edit_rate)
    ids = intro + filler
    start = len(ids)
    for _ in range(count):
        ids += video.next()
    end = len(ids)
    ids += question
    modality = torch.full((len(ids),), TEXT, dtype=torch.long)
    modality[start:end] = VIDEO
    return Sample(
        input_ids=as_long(ids),
        modality=modality,
        text=None,
        source="synthetic:frames",
        meta={
            "set": "frames",
            "seed": seed,
            "frame_stride": stride,
            "frames": count,
            "video_start": start,
            "edit_rate": edit_rate,
            "segments": [[0, start, TEXT], [start, end, VIDEO], [end, len(ids), TEXT]],
        },
    )


def mixed(tok, *, max_tokens: int, seed: int, frame_tokens: int | None = None, edit_rate: float = 0.03) -> Sample:
    """Interleaved prompt: text, clip, text, clip, ..., text; about 25% of tokens are text.

    Frames of T ids (T = ``frame_tokens`` or clamp(max_tokens/16, 16, 256)) fill ~75% of ``max_tokens``,
    split into K >= 2 clips of ~4 frames (all cut from one base frame, so the period T holds inside every
    clip); prose segments fill the rest, the first opening with an instruction, the last closing with a
    question. Length is exactly ``max_tokens``. ``meta``: frame_stride, frames, clips, text_fraction,
    segments [[start, end, modality], ...].
    """
    _check_edit_rate(edit_rate)
    _check_frame_tokens(frame_tokens)
    rng = random.Random(seed)
    intro = encode(tok, MIXED_INTRO, special=True)
    question = encode(tok, MIXED_QUESTION, special=False)
    stride = frame_tokens or min(256, max(16, max_tokens // 16))
    count = round((1 - MIXED_TEXT_SHARE) * max_tokens / stride)
    if not frame_tokens:
        count = max(count, 2)
        stride = max(1, int((1 - MIXED_TEXT_SHARE) * max_tokens) // count)
    text_room = max_tokens - count * stride - len(intro) - len(question)
    if count < 1 or text_room < 0:
        need = 4 * (len(intro) + len(question))  # the ~25% text share must hold intro and question
        raise ValueError(f"synthetic:mixed needs max_tokens >= about {need} with this tokenizer, got {max_tokens}")
    clips = min(count, max(2, round(count / 4)))
    per_clip = [count // clips + (1 if c < count % clips else 0) for c in range(clips)]
    segments_text = [text_room // (clips + 1) + (1 if s < text_room % (clips + 1) else 0) for s in range(clips + 1)]
    cache: dict[str, list[int]] = {}
    video = _Frames(rng, plain_token_ids(tok), stride, edit_rate)
    ids: list[int] = []
    segments: list[list[int]] = []
    for s in range(clips + 1):
        start = len(ids)
        ids += (intro if s == 0 else []) + _prose_ids(tok, segments_text[s], rng, cache)
        ids += question if s == clips else []
        segments.append([start, len(ids), TEXT])
        if s < clips:
            start = len(ids)
            for _ in range(per_clip[s]):
                ids += video.next()
            segments.append([start, len(ids), VIDEO])
    modality = torch.full((len(ids),), TEXT, dtype=torch.long)
    for start, end, kind in segments:
        modality[start:end] = kind
    segments = [seg for seg in segments if seg[1] > seg[0]]
    return Sample(
        input_ids=as_long(ids),
        modality=modality,
        text=None,
        source="synthetic:mixed",
        meta={
            "set": "mixed",
            "seed": seed,
            "frame_stride": stride,
            "frames": count,
            "clips": clips,
            "edit_rate": edit_rate,
            "text_fraction": float((modality == TEXT).float().mean()),
            "segments": segments,
        },
    )


GENERATORS = {
    "synthetic:kv-retrieval": kv_retrieval,
    "synthetic:passkey": passkey,
    "synthetic:frames": frames,
    "synthetic:mixed": mixed,
}
