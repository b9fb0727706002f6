"""Checks a command runs before it loads a model: everything that the arguments, the paths and the
model's config can tell, so a bad value costs milliseconds, not a de-quantisation, and leaves nothing on
disk. Each check raises ValueError with one line naming the option and the value (the CLI: exit 2).

What needs the weights or the tokenizer (a data file too short once tokenized, a tokenizer-less model)
is checked by the commands right after loading, before any search.
"""

from __future__ import annotations

from pathlib import Path

from .models.info import ModelInfo


def model_info(spec: str, *, trust_remote_code: bool = False, dtype: str = "auto", device: str = "auto") -> ModelInfo:
    """The model's facts from its config alone (no weights), after the load options are checked; and, since
    every command that loads a model tokenizes prompts, that it has a tokenizer (models.load would find none
    only after the weights load)."""
    from .models.load import TOKENIZER_FILES, check_load_options
    from .models.resolve import local_files, resolve_model_info

    check_load_options(dtype, device)
    info = resolve_model_info(spec, trust_remote_code=trust_remote_code)
    for path in local_files(spec):
        if path.is_dir() and (path / "config.json").is_file() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"model '{spec}' has no tokenizer files ({', '.join(TOKENIZER_FILES)}); its prompts need one")
    return info


def tokens_fit(option: str, tokens: int | None, info: ModelInfo) -> None:
    """A prompt length (None: not given) is at least the data's MIN_TOKENS and fits the model's context
    (``max_position_embeddings``, when the config has one)."""
    from .data import MIN_TOKENS

    if tokens is None:
        return
    if tokens < MIN_TOKENS:
        raise ValueError(f"{option} must be >= {MIN_TOKENS}, got {tokens}")
    context_fits(option, tokens, info)


def context_fits(what: str, tokens: int, info: ModelInfo) -> None:
    """``tokens`` positions fit the model's context (``max_position_embeddings``, when the config has one);
    ``what`` names them in the error (an option, or the sum that makes them)."""
    limit = info.max_position_embeddings
    if limit is not None and tokens > limit:
        raise ValueError(f"{what} {tokens} exceeds the context of model '{info.id}' ({limit} tokens)")


def data(option: str, spec: str | None, *, tokens: int | None = None, held_out: bool = False) -> None:
    """A data spec: a known synthetic or text set, or a file/dataset directory that exists and decodes.
    Natural text (text:shakespeare, .txt/.md) must also be able to hold ``tokens`` tokens in its
    calibration part (``held_out``: its held-out part); the exact count waits for the tokenizer."""
    if not spec:
        return
    from .data import check_spec

    try:
        check_spec(spec, tokens=tokens, held_out=held_out)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def out_dir(option: str, out: Path, *, overwrite: bool) -> None:
    """An artifact directory to write: not a file, and not an artifact already unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {out} exists and is not a directory")
    if (out / "manifest.json").is_file() and not overwrite:
        raise FileExistsError(f"{option} {out} already holds an artifact; pass --overwrite to replace it or choose another {option}")


# ------------------------------------------------------------------------------------------- outputs


def output_path(option: str, out: Path, *, reads: dict | None = None, model: str | None = None, beside=()) -> None:
    """An output (file or directory) that leaves everything the command reads intact, in a place that can be
    written; ValueError (one line) otherwise. The one guard every writing command calls before any work.

    ``reads`` maps an option to what it names (a path, a spec string, a list of either, or None); specs that
    name no existing path (``synthetic:passkey``, ``text:shakespeare``) are skipped. ``model`` adds the files of
    a --model spec (``models.resolve.local_files``). ``beside`` are the paths the command writes next to
    ``out`` (``OUT.partial/``, ``OUT.png``): a partial directory is deleted on a fresh start, so it must not be
    an input either.

    Refused, whatever ``--overwrite`` says: ``out`` (or a path beside it) equal to an input, inside an input
    directory (an artifact's or a model's files: writing there corrupts them), or containing an input
    (replacing ``out`` whole would delete it). An artifact that a command reads *and* replaces (``--into``,
    probe-layers' ``--out``) is its target, not an input: callers do not list it, and ``write_artifact``
    replaces it whole, under ``--overwrite`` where the command has one.
    """
    inputs = [(name, path) for name, value in (reads or {}).items() for path in _named_paths(value)]
    if model is not None:
        from .models.resolve import local_files

        inputs += [("--model", path) for path in local_files(model)]
    for written in (Path(out), *map(Path, beside)):
        for name, path in inputs:
            _apart(option, written, name, path)
    writable(option, Path(out))


def _named_paths(value) -> list[Path]:
    """The existing paths a --option value names (spec strings that are not paths are skipped)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [p for item in value for p in _named_paths(item)]
    path = Path(str(value)).expanduser()
    return [path] if str(value) and path.exists() else []


def _apart(option: str, out: Path, name: str, source: Path) -> None:
    """``out`` neither is, nor lies inside, nor contains ``source`` (symlinks and hard links resolved)."""
    o, s = out.expanduser().resolve(), source.resolve()
    same = o == s or (o.exists() and _same_file(o, s))
    if same:
        raise ValueError(f"{option} {out} is {name} {source}, which this command reads; choose another {option}")
    if s in o.parents:
        raise ValueError(f"{option} {out} is inside {name} {source}, which this command reads; writing there would "
                         f"change its files; choose a path outside it")
    if o in s.parents:
        raise ValueError(f"{option} {out} contains {name} {source}, which this command reads; replacing {out} "
                         f"would delete it; choose another {option}")


def _same_file(a: Path, b: Path) -> bool:
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def writable(option: str, out: Path) -> None:
    """``out`` can be created or replaced: its nearest existing ancestor (``out`` itself is replaced by a rename
    in its parent, so the search starts there) is a directory in which this process can create a file. Tried
    for real (a file created and removed at once): permission bits say nothing for root, a read-only mount or
    /proc refuse root too, and only the attempt tells."""
    import os
    import tempfile

    parent = out.expanduser().absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {out}: {parent} is a file, not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=".sparsesearch-write-check-", dir=parent)
    except OSError as exc:
        raise ValueError(f"{option} {out}: cannot write in {parent} ({exc.strerror or exc})") from None
    os.close(handle)
    os.unlink(probe)


# ---------------------------------------------------------------------------------------------- inputs


def json_file(option: str, value) -> None:
    """A JSON or JSON-lines file given to ``option`` (a value naming an existing ``.json`` / ``.jsonl`` file;
    anything else is left to the command) parses strictly: one line for bad UTF-8, NaN, repeated keys, deep
    nesting or a huge file (sparsesearch.json_input), before the command's own reader, which may be less
    strict or recurse, sees it."""
    from .json_input import read_json, read_json_lines

    path = Path(str(value)) if value is not None else None
    if path is None or not path.is_file():
        return
    if path.suffix.lower() == ".json":
        read_json(path, f"{option} {value}")
    elif path.suffix.lower() == ".jsonl":
        read_json_lines(path, f"{option} {value}")


# ---------------------------------------------------------------------------------------------- sizes


def sizes_fit(model: str, lengths: dict, *, memory: dict | None = None, trust_remote_code: bool = False,
              dtype: str = "auto", device: str = "auto") -> ModelInfo:
    """Each positive length in ``lengths`` ({option: tokens or None}) fits the context of ``model``, and each
    estimate in ``memory`` ({what: bytes}) fits the memory available now; the model's info is returned.
    Commands call this before checks that read data, so a length no model position can hold is refused as
    that, not through a side effect (a text too short for it)."""
    from .memory import fits_memory

    info = model_info(model, trust_remote_code=trust_remote_code, dtype=dtype, device=device)
    for option, tokens in lengths.items():
        if tokens is not None and tokens > 0:
            context_fits(option, tokens, info)
    for what, nbytes in (memory or {}).items():
        fits_memory(what, nbytes)
    return info


# --------------------------------------------------------------------------------------- eviction head


def eviction_head_possible(option: str, spec: str, *, trust_remote_code: bool = False) -> None:
    """Refuse (before the weights load) a model that cannot carry NOSA's trained eviction head.

    The head is ``eviction_w`` / ``eviction_a`` on the attention modules of a NOSA checkpoint's own modelling
    code. A GGUF file, or a directory whose config.json maps to no code of its own (``auto_map``), loads
    through a stock transformers class, which has no such parameters and drops such tensors from the
    checkpoint; remote code runs only with --trust-remote-code. Only the config is read."""
    from .json_input import read_json
    from .models.resolve import local_files

    for path in local_files(spec):
        config = path / "config.json" if path.is_dir() else None
        if config is None or not config.is_file():
            continue
        parsed = read_json(config, f"--model {spec}: config.json")
        auto_map = parsed.get("auto_map") if isinstance(parsed, dict) else None
        if auto_map and trust_remote_code:
            return
        if auto_map:
            raise ValueError(f"{option} trained: model '{spec}' has its own code (auto_map), which may hold an eviction "
                             "head, but it runs only with --trust-remote-code")
    raise ValueError(f"{option} trained needs a NOSA checkpoint with an eviction head; model '{spec}' loads through a "
                     "stock transformers class, which has none (choose a training-free proxy such as snapkv)")
