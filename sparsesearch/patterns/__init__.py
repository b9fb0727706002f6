"""Sparse attention patterns, one module each.

Every module has a frozen params dataclass (validated in ``__post_init__``), ``predicate`` (mask_mod-style,
the definition, over absolute positions), ``build_index`` (-> BlockIndex, vectorised torch on the inputs'
device), ``density`` (the fraction of the causal matrix the kernel computes) and a ``main()`` ASCII demo
(``python -m sparsesearch.patterns.ashape``).

Static patterns (dense, ashape, triangle, grid): ``build_index(params, q_len, kv_len=None, *, batch, heads,
block_m, block_n, head_space, device)``. Dynamic patterns (vertical_slash, block_topk): ``build_index(params,
q, k, *, head_space, block_m, block_n)``; their predicates take the estimated selection, which the index
keeps in ``meta``.

``REGISTRY`` (name -> module) and ``PARAMS`` (name -> params class) import the pattern modules on first
use, so ``python -m sparsesearch.patterns.<name>`` does not import its own module twice.
"""

from __future__ import annotations

import importlib

from ._common import index_density, index_entries

NAMES = ("dense", "ashape", "block_topk", "vertical_slash", "triangle", "grid")
_PARAM_CLASSES = {
    "dense": "DenseParams",
    "ashape": "AShapeParams",
    "block_topk": "BlockTopKParams",
    "vertical_slash": "VerticalSlashParams",
    "triangle": "TriangleParams",
    "grid": "GridParams",
}


def __getattr__(name: str):
    if name in NAMES:
        return importlib.import_module(f".{name}", __name__)
    if name == "REGISTRY":
        return {n: importlib.import_module(f".{n}", __name__) for n in NAMES}
    if name == "PARAMS":
        return {n: getattr(importlib.import_module(f".{n}", __name__), _PARAM_CLASSES[n]) for n in NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAMES", "REGISTRY", "PARAMS", "index_density", "index_entries", *NAMES]
