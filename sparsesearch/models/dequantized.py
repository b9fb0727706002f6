"""A GGUF's weights dequantised once, kept in the user cache as a plain transformers directory.

transformers reads a GGUF by dequantising every tensor on the host, in every process that loads it: 30 s for
SmolLM2-135M on a 2-core CPU, 50-60 s for Gemma 3 270M on a GPU host (RESULTS Run 35), paid again by each
`calibrate`, `evaluate` and `pareto` call and by every test that loads the model. The first load writes the
dequantised float32 tensors (exactly the values the GGUF reader makes, before any cast to the asked dtype) as
safetensors with the config and tokenizer files, under the file's sha256; later loads read that directory in
seconds and cast as a GGUF load would. The model's identity (``ModelInfo.id``, ``revision``) stays the GGUF's,
so artifacts and reports cannot tell the two loads apart. ``SPARSESEARCH_GGUF_CACHE=0`` turns it off.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..files import fsync_dir, locked
from ..user_cache import user_cache_dir

ENV = "SPARSESEARCH_GGUF_CACHE"
DONE = "dequantized.ok"  # written last: a directory without it is a build that did not finish


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def cache_dir(revision: str) -> Path:
    """Where the GGUF whose ModelInfo.revision is ``revision`` ("sha256:<hex>") is kept."""
    return user_cache_dir() / "dequantized" / revision.removeprefix("sha256:")


def ready(path: Path) -> bool:
    return (path / DONE).is_file()


def build(path: Path, load_gguf) -> Path:
    """Write the directory at ``path`` once (``load_gguf()``: the model in float32 on the CPU and its tokenizer,
    from the GGUF), whole or not at all: built in a temporary sibling, renamed into place under a lock, so two
    processes never both build it and a reader never sees half of it."""
    with locked(path):
        if ready(path):
            return path
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            model, tokenizer = load_gguf()
            # The weights are plain tensors now; the GGUF marker only stops save_pretrained.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / DONE).write_text("float32 tensors as the GGUF reader dequantised them\n")
            if path.exists():  # an unfinished directory (no DONE) left by a killed build
                shutil.rmtree(path)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path
