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
    """The model's facts from its config alone (no weights), after the load options are checked."""
    from .models.load import check_load_options
    from .models.resolve import resolve_model_info

    check_load_options(dtype, device)
    return resolve_model_info(spec, trust_remote_code=trust_remote_code)


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
