"""The pattern registry: every pattern module, imported explicitly, and the facts each declares.

A pattern module declares, besides its params dataclass, predicate, ``build_index``, ``density`` and
``main``:

* ``NAME``: the name artifacts, search spaces and exports use;
* ``Params``: its params dataclass (its fields are the pattern's heads.parquet columns, artifacts/columns.py);
* ``DYNAMIC``: True when the index is estimated from q/k at run time (``build_index(params, q, k, ...)``),
  False when it follows from the shape (``build_index(params, q_len, kv_len, ...)``; a dynamic pattern's
  ``build_index`` is its torch build, and kernels/dynamic_index.py chooses between it and the fused Triton
  build, which every dynamic pattern has there);
* ``REGION``: True when ``build_index`` takes a permuted modality region's frame (``row_pos``);
* ``STREAMING``: True when it keeps only attention sinks and a recent window (DuoAttention streaming heads);
* ``COLOR``: its colour in the heads map;
* ``LABEL``: its short column header in tables (at most 7 characters, so a table per pattern fits 80 columns);
* ``demo_params(tokens)``: parameters that make it sparse but not empty at that length (``sparsesearch check``).

Consumers (execute, runtime, search, export, selfcheck, report, artifacts) read these facts here and keep
no pattern lists of their own. Order matters once: heads.parquet's parameter columns appear in registry
order (first appearance), so a new pattern goes last and existing artifacts keep their schema.

This module, not ``patterns/__init__``, imports the modules, so ``python -m sparsesearch.patterns.<name>``
runs its demo without importing its own module twice.
"""

from __future__ import annotations

from . import ashape, block_topk, dense, grid, triangle, vertical_slash

FACTS = ("NAME", "Params", "DYNAMIC", "REGION", "STREAMING", "COLOR", "LABEL", "demo_params")
REGISTRY = {m.NAME: m for m in (dense, ashape, triangle, vertical_slash, block_topk, grid)}
PARAMS = {name: m.Params for name, m in REGISTRY.items()}


def pattern(name: str):
    """The module of pattern ``name``; a ValueError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown pattern {name!r} (known: {sorted(REGISTRY)})")
    return REGISTRY[name]
