"""How to hand a KV cache to a transformers forward across the releases pyproject allows.

transformers 5.2x takes the cache as ``cache=`` and returns it as ``out.cache``; ``past_key_values`` still
works there but warns (a FutureWarning per call: one per configuration of a sweep, one per decoded token).
Older releases (>= 4.56) only know ``past_key_values``. Every method that runs a model with a cache (the NOSA
sweep, SPAVA's decode) goes through these two functions. No transformers import: the forward's signature says.
"""

from __future__ import annotations

import inspect


def cache_kwarg(model, cache) -> dict:
    """The forward's keyword for a KV cache: {"cache": cache} where the model's forward takes it, else
    {"past_key_values": cache}."""
    return {"cache": cache} if "cache" in inspect.signature(model.forward).parameters else {"past_key_values": cache}


def returned_cache(out):
    """The cache a forward returned, under its current name (``cache``) or the older one."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
