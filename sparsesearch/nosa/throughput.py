"""Decode throughput model of an offloaded NOSA step, usable everywhere (docs/peers.md 2(a) step 7).

t_step = sum over layers of [launch floor + H2D bytes / BW(H2D bytes) + resident bytes / HBM bandwidth],
tokens/s = batch / t_step. Every transfer of a layer is one batched gather (NOSI's UVA kernel), so the
bandwidth is read off the curve at the layer's total bytes (per token times batch).

Default curve: measured on an H200 host (ENVIRONMENT.md): a Triton kernel reading 16 KiB blocks straight
from pinned memory moves 26 GB/s for 1 MiB batches and 48-50 GB/s from 16 MiB; a contiguous pinned copy
55 GB/s. Between points the bandwidth is interpolated in log(bytes); below/above, the end values hold.
HBM: 2.9 TB/s of KV read by dense decode on an H100 (ENVIRONMENT.md). The launch floor (8 us per layer)
is an assumption, not a measurement. The model ignores the attention's FLOPs and the MLPs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

H200_UVA_CURVE = ((1 << 20, 26e9), (16 << 20, 49e9), (64 << 20, 55e9))


@dataclass(frozen=True)
class DeviceModel:
    curve: tuple[tuple[int, float], ...] = H200_UVA_CURVE
    launch_floor_s: float = 8e-6
    hbm_bytes_per_s: float = 2.9e12
    batch: int = 16  # paper 004 E.5.3 measures throughput at batch 16
    source: str = "ENVIRONMENT.md: H200 host UVA gather 26 GB/s @1 MiB, 49 GB/s @16 MiB, 55 GB/s contiguous; HBM 2.9 TB/s (H100); launch floor 8 us assumed"
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self) | {"curve": [list(p) for p in self.curve]}


def bandwidth(nbytes: float, curve=H200_UVA_CURVE) -> float:
    """Bytes/s of one batched host-to-device gather of ``nbytes`` (log-linear between measured points)."""
    if nbytes <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if nbytes <= x1:
            w = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return curve[-1][1]


def step_seconds(h2d_per_layer: list[float], resident_per_layer: list[float], model: DeviceModel = DeviceModel()) -> float:
    """Modelled time of one decode step for ``model.batch`` sequences.

    h2d_per_layer: H2D bytes per token per layer; resident_per_layer: bytes attention reads from HBM per
    token per layer (the k slots + tail of every KV head)."""
    total = 0.0
    for h2d, resident in zip(h2d_per_layer, resident_per_layer):
        nbytes = h2d * model.batch
        total += model.launch_floor_s + (nbytes / bandwidth(nbytes, model.curve) if nbytes else 0.0)
        total += resident * model.batch / model.hbm_bytes_per_s
    return total


def tokens_per_second(h2d_per_layer: list[float], resident_per_layer: list[float], model: DeviceModel = DeviceModel()) -> float:
    return model.batch / step_seconds(h2d_per_layer, resident_per_layer, model)
