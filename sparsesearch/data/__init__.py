"""Calibration data: local files (jsonl, parquet, datasets directories) and synthetic sets.

Public API::

    TEXT, IMAGE, VIDEO = 0, 1, 2                         # modality ids, as in sparsesearch.models
    Sample(input_ids [N], modality [N], text, answer, answer_ids [A], source, meta, inputs)
    load_calibration(spec, tokenizer, *, max_tokens, samples=1, seed=0, chat=True,
                     frame_tokens=None, edit_rate=0.03) -> list[Sample]
    held_out(spec, tokenizer, *, max_tokens, seed=0, chat=True, frame_tokens=None,
             edit_rate=0.03) -> Sample                   # synthetic: seed + 10_000; files: last row
    retrieval_correct(generated_text, sample) -> bool
    check_spec(spec, *, tokens=None, held_out=False)     # refuses a bad spec without a tokenizer
    is_retrieval_spec(spec) -> bool                      # synthetic:kv-retrieval / passkey (answers, depths)
    sha256_of(samples) -> str                            # provenance hash over input_ids

Specs: ``synthetic:kv-retrieval`` (paper 002 App. A.1, UUID v4 pairs), ``synthetic:passkey``,
``synthetic:frames`` (F frames x T ids, meta["frame_stride"] = T), ``synthetic:mixed`` (clips and text,
~25% text), natural text ``text:shakespeare`` or a ``.txt`` / ``.md`` file (windows of exactly max_tokens
tokens; calibration and held-out parts disjoint, data/natural.py), or a path to a ``.jsonl`` / ``.parquet`` file or a ``save_to_disk`` directory with a
``text`` or ``messages`` column; chat rows with images or videos go through a VLM's processor.
Details: sparsesearch/data/synthetic.py, files.py and visual.py.
"""

from .calibration import HELD_OUT_OFFSET, check_spec, held_out, is_retrieval_spec, load_calibration, retrieval_correct
from .files import MIN_TOKENS
from .natural import TEXT_SPECS, is_text_spec
from .sample import IMAGE, TEXT, VIDEO, Sample, sha256_of
from .synthetic import GENERATORS

SYNTHETIC_SETS: tuple[str, ...] = tuple(GENERATORS)

__all__ = [
    "HELD_OUT_OFFSET",
    "IMAGE",
    "MIN_TOKENS",
    "SYNTHETIC_SETS",
    "TEXT",
    "TEXT_SPECS",
    "VIDEO",
    "Sample",
    "check_spec",
    "held_out",
    "is_retrieval_spec",
    "is_text_spec",
    "load_calibration",
    "retrieval_correct",
    "sha256_of",
]
