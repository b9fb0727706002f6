"""Sparse attention patterns, one module each.

Every module has a frozen params dataclass (validated in ``__post_init__``), ``predicate`` (mask_mod-style,
the definition, over absolute positions), ``build_index`` (-> BlockIndex, vectorised torch on the inputs'
device), ``density`` (the fraction of the causal matrix the kernel computes), the registry facts
(``patterns/registry.py``) and a ``main()`` ASCII demo (``python -m sparsesearch.patterns.ashape``).

Static patterns (dense, ashape, triangle, grid): ``build_index(params, q_len, kv_len=None, *, batch, heads,
block_m, block_n, head_space, device)``. Dynamic patterns (vertical_slash, block_topk): ``build_index(params,
q, k, *, head_space, block_m, block_n)``; their predicates take the estimated selection, which the index
keeps in ``meta``.

``REGISTRY`` (name -> module) and ``PARAMS`` (name -> params class) come from ``patterns/registry.py`` on
first use: importing the package imports no pattern module, so ``python -m sparsesearch.patterns.<name>``
does not import its own module twice.
"""

from __future__ import annotations

from ._common import index_density, index_entries


def __getattr__(name: str):
    if name in ("REGISTRY", "PARAMS"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["REGISTRY", "PARAMS", "index_density", "index_entries"]
