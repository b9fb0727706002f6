"""Calibration rows from local files: ``.jsonl``, ``.parquet``, or a ``datasets`` directory (save_to_disk).

A row gives its prompt through a ``text`` column (a string) or, when there is none, a ``messages`` column
(a chat list of {"role", "content"}), rendered with the tokenizer's chat template when it has one and
joined by blank lines otherwise. Nothing is downloaded: hub names are not accepted here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

from ._text import as_long, encode, has_chat_template, render_chat
from .sample import TEXT, Sample
from .visual import is_visual, visual_sample

MIN_TOKENS = 64  # rows shorter than this are skipped: too short to show long-range attention
FIELDS = ("text", "messages")  # looked for in this order


class Rows:
    """A file's rows as random access to one field: ``len(rows)`` and ``rows.get(i)``."""

    def __init__(self, path: Path, field: str, count: int, get: Callable[[int], object]):
        self.path, self.field, self.count, self.get = path, field, count, get

    def __len__(self) -> int:
        return self.count


def _pick_field(path: Path, columns: list[str]) -> str:
    for name in FIELDS:
        if name in columns:
            return name
    found = ", ".join(columns) if columns else "none"
    raise ValueError(f"{path}: no 'text' or 'messages' column to take prompts from; columns found: {found}")


def open_rows(path: Path) -> Rows:
    """Rows of ``path`` (an existing file or directory), with the prompt field chosen. A file that cannot
    be decoded (not UTF-8, a damaged Parquet or Arrow file) is a ValueError that names it."""
    reader = _reader(path)
    try:
        return reader(path)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except Exception as exc:  # noqa: BLE001 - pyarrow and datasets raise their own types for damaged files
        if isinstance(exc, ValueError) and str(path) in str(exc):
            raise  # ours: it names the file and the problem already
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"{path}: cannot be read ({reason})") from None


def _reader(path: Path) -> Callable[[Path], Rows]:
    if path.is_dir():
        return _dataset_rows
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows
    if suffix == ".parquet":
        return _parquet_rows
    raise ValueError(
        f"unsupported calibration file '{path}': use .jsonl, .parquet, or a directory saved with "
        "datasets.Dataset.save_to_disk"
    )


def _jsonl_rows(path: Path) -> Rows:
    records: list[dict] = []
    columns: dict[str, None] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object per line, got {type(record).__name__}")
            records.append(record)
            columns.update(dict.fromkeys(record))
    field = _pick_field(path, list(columns))
    return Rows(path, field, len(records), lambda i: records[i].get(field))


def _parquet_rows(path: Path) -> Rows:
    import pyarrow.parquet as pq

    field = _pick_field(path, pq.read_schema(path).names)
    values = pq.read_table(path, columns=[field]).column(field).to_pylist()
    return Rows(path, field, len(values), values.__getitem__)


def _dataset_rows(path: Path) -> Rows:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise ValueError(f"{path} is a directory but not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if not ds:
            raise ValueError(f"{path}: the DatasetDict has no splits")
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    field = _pick_field(path, list(ds.column_names))
    ds = ds.select_columns([field])
    return Rows(path, field, len(ds), lambda i: ds[i][field])


def row_ids(tok, value: object, field: str) -> tuple[list[int], str] | None:
    """(ids, text) of one row's prompt, or None when the row has no usable value."""
    if field == "text":
        if not isinstance(value, str) or not value:
            return None
        return encode(tok, value, special=True), value
    if not isinstance(value, (list, tuple)) or not value:
        return None
    messages = [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")} for m in value]
    if has_chat_template(tok):
        text = render_chat(tok, messages, generation_prompt=False)
        return encode(tok, text, special=False), text
    text = "\n\n".join(m["content"] for m in messages)
    return encode(tok, text, special=True), text


def usable_samples(tok, rows: Rows, order: list[int], *, max_tokens: int, source: str, processor=None) -> Iterator[Sample]:
    """Samples from rows visited in ``order``, skipping rows under MIN_TOKENS; each keeps its first
    ``max_tokens`` tokens (the start of a document carries its context; the end would need it). Chat rows
    with images or videos go through ``processor`` (data/visual.py) and are skipped when too long."""
    for i in order:
        value = rows.get(i)
        if rows.field == "messages" and is_visual(value):
            sample = visual_sample(processor, value, rows.path.parent, max_tokens=max_tokens, source=source, row=i)
            if sample is not None and len(sample) >= MIN_TOKENS:
                yield sample
            continue
        got = row_ids(tok, value, rows.field)
        if got is None or len(got[0]) < MIN_TOKENS:
            continue
        ids, text = got
        truncated = len(ids) > max_tokens
        if truncated:
            ids = ids[:max_tokens]
            text = tok.decode(ids)
        yield Sample(
            input_ids=as_long(ids),
            modality=as_long([TEXT] * len(ids)),
            text=text,
            source=source,
            meta={"row": i, "field": rows.field, "truncated": truncated, "row_tokens": len(got[0])},
        )


def seeded_order(count: int, seed: int) -> list[int]:
    """The order rows are visited in: a ``random.Random(seed)`` shuffle of range(count)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order
