"""Calibration data: local files (jsonl, parquet, datasets directories) and synthetic sets.

Public API::

    TEXT, IMAGE, VIDEO = 0, 1, 2                         # modality ids, as in sparsesearch.models
    Sample(input_ids [N], modality [N], text, answer, answer_ids [A], source, meta, inputs)
    load_calibration(spec, tokenizer, *, max_tokens, samples=1, seed=0, chat=True,
                     frame_tokens=None, edit_rate=0.03) -> list[Sample]
    held_out(spec, tokenizer, *, max_tokens, seed=0, chat=True, frame_tokens=None,
             edit_rate=0.03) -> Sample                   # synthetic: seed + 10_000; files: last row
    retrieval_correct(generated_text, sample) -> bool
    check_spec(spec)                                     # refuses a bad spec without a tokenizer
    sha256_of(samples) -> str                            # provenance hash over input_ids

Specs: ``synthetic:kv-retrieval`` (paper 002 App. A.1, UUID v4 pairs), ``synthetic:passkey``,
``synthetic:frames`` (F frames x T ids, meta["frame_stride"] = T), ``synthetic:mixed`` (clips and text,
~25% text), or a path to a ``.jsonl`` / ``.parquet`` file or a ``save_to_disk`` directory with a
``text`` or ``messages`` column; chat rows with images or videos go through a VLM's processor.
Details: sparsesearch/data/synthetic.py, files.py and visual.py.
"""

from .calibration import HELD_OUT_OFFSET, check_spec, held_out, load_calibration, retrieval_correct
from .files import MIN_TOKENS
from .sample import IMAGE, TEXT, VIDEO, Sample, sha256_of
from .synthetic import GENERATORS

SYNTHETIC_SETS: tuple[str, ...] = tuple(GENERATORS)

__all__ = [
    "HELD_OUT_OFFSET",
    "IMAGE",
    "MIN_TOKENS",
    "SYNTHETIC_SETS",
    "TEXT",
    "VIDEO",
    "Sample",
    "check_spec",
    "held_out",
    "load_calibration",
    "retrieval_correct",
    "sha256_of",
]
