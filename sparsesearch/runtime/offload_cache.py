"""The transformers side of NOSA's offloaded decode (runtime/nosa_engine.py): a Cache whose global
layers are offloaded NOSA layers, so ``model.generate(past_key_values=...)`` needs no patching, as with
transformers' own offloaded caches. Sliding-window layers of hybrid models keep a DynamicLayer."""

from __future__ import annotations

import weakref

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .nosa_engine import DecodeLayer, NosaEngine, OffloadedLayer, SlotLayer


class NosaLayer(OffloadedLayer, CacheLayerMixin):
    """OffloadedLayer (the torch decoder) speaking transformers' cache-layer protocol."""

    is_sliding = False
    is_compileable = False


class SlotNosaLayer(SlotLayer, CacheLayerMixin):
    """SlotLayer (the batched SlotDecoder) speaking transformers' cache-layer protocol."""

    is_sliding = False
    is_compileable = False


class NosaCache(Cache):
    """transformers Cache for NOSA decode: per global layer a NosaLayer (engine decoder ``torch``) or a
    SlotNosaLayer (``slot``; the layers share the fused kernels' scratch), a DynamicLayer per sliding one.
    Creating it makes it the engine's cache in use (one generation at a time per model). max_new_tokens:
    the slot layers' capacity hint (``SlotLayer``)."""

    def __init__(self, engine: NosaEngine, max_new_tokens: int | None = None):
        shared: dict = {}

        def offloaded():
            if engine.decoder == "slot":
                return SlotNosaLayer(engine.cfg, engine.seed, fused=engine.fused, max_new_tokens=max_new_tokens, shared=shared)
            return NosaLayer(engine.cfg, engine.seed)

        layers = [offloaded() if i in engine.layers else DynamicLayer() for i in range(engine.num_layers)]
        super().__init__(layers=layers)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DecodeLayer):
                layer.eviction = engine.eviction.get(i)
        self.decoder = engine.decoder
        engine.active = weakref.ref(self)

    def memory_report(self) -> str:
        """Device bytes (slots, tail, selection state) vs host bytes (the full KV), and the traffic so far."""
        offloaded = [layer for layer in self.layers if isinstance(layer, DecodeLayer) and layer.filled]
        totals: dict[str, int] = {}
        for layer in offloaded:
            for key, value in layer.memory().items():
                totals[key] = totals.get(key, 0) + value
        mib = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
        steps = max((layer.steps for layer in offloaded), default=0)
        dropped = f", {totals['dropped_blocks']} blocks dropped" if "dropped_blocks" in totals else ""
        return (f"NOSA cache ({self.decoder} decoder): device {mib(totals.get('device_bytes', 0))} (slots + tail + selection state) vs host "
                f"{mib(totals.get('host_bytes_used', 0))} used of {mib(totals.get('host_bytes', 0))} allocated; "
                f"H2D {mib(totals.get('h2d_bytes', 0))}, D2H {mib(totals.get('d2h_bytes', 0))} over {steps} steps{dropped}")
