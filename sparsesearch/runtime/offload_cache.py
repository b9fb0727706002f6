"""The transformers side of NOSA's offloaded decode (sparsesearch/nosa/engine.py): a Cache whose global
layers are offloaded NOSA layers, so ``model.generate(past_key_values=...)`` needs no patching, as with
transformers' own offloaded caches. Sliding-window layers of hybrid models keep a DynamicLayer."""

from __future__ import annotations

import weakref

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..nosa.engine import NosaEngine, OffloadedLayer


class NosaLayer(OffloadedLayer, CacheLayerMixin):
    """OffloadedLayer speaking transformers' cache-layer protocol (update, sequence length, mask sizes)."""

    is_sliding = False
    is_compileable = False


class NosaCache(Cache):
    """transformers Cache for NOSA decode: a NosaLayer per global layer, a DynamicLayer per sliding one.
    Creating it makes it the engine's cache in use (one generation at a time per model)."""

    def __init__(self, engine: NosaEngine):
        layers = [NosaLayer(engine.cfg, engine.seed) if i in engine.layers else DynamicLayer() for i in range(engine.num_layers)]
        super().__init__(layers=layers)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, NosaLayer):
                layer.eviction = engine.eviction.get(i)
        engine.active = weakref.ref(self)

    def memory_report(self) -> str:
        """Device bytes (slots, tail, selection state) vs host bytes (the full KV), and the traffic so far."""
        offloaded = [layer for layer in self.layers if isinstance(layer, NosaLayer) and hasattr(layer, "keys_host")]
        totals: dict[str, int] = {}
        for layer in offloaded:
            for key, value in layer.memory().items():
                totals[key] = totals.get(key, 0) + value
        mib = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
        steps = max((layer.steps for layer in offloaded), default=0)
        return (f"NOSA cache: device {mib(totals.get('device_bytes', 0))} (slots + tail + selection state) vs host "
                f"{mib(totals.get('host_bytes_used', 0))} used of {mib(totals.get('host_bytes', 0))} allocated; "
                f"H2D {mib(totals.get('h2d_bytes', 0))}, D2H {mib(totals.get('d2h_bytes', 0))} over {steps} steps")
