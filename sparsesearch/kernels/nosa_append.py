"""NOSA decode: append the step's token in one launch (runtime/nosa_device.py SlotDecoder.append).

Appending one token per (sequence, KV head) touches six buffers: the host store (keys and values, pinned,
written through UVA), the tail slot, the per-token query-agnostic score, the ring of the last ``kernel``
keys and, every ``stride`` tokens, the compressed key the ring completes. In torch that is some 25 small
launches per layer (index arithmetic, two UVA copies, index_put's, the score's einsum and softplus, the
ring mean); here one program per pair does all of it, reading the new key and value once.

Scores: ``trained`` A·softplus(W·v) (torch's softplus: x above 20), ``vnorm`` ||v||, ``random`` the hash
of runtime/nosa_device.py ``token_scores``, all in float32. The sequence lengths are not advanced here: every KV
head's program of a sequence reads the same length, so the caller adds one after the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PROXY_IDS = {"trained": 0, "vnorm": 1, "random": 2}


@triton.jit
def _append_kernel(k_new, v_new, lengths, keys_host, values_host, slots_k, slots_v, scores, ring, units, w, a,
                   kv_heads, capacity, slot_tokens, n_units_cap, seed,
                   D: tl.constexpr, BS: tl.constexpr, KERNEL: tl.constexpr, STRIDE: tl.constexpr, PROXY: tl.constexpr):
    pid = tl.program_id(0)  # b * kv_heads + h
    h = pid % kv_heads
    pos = tl.load(lengths + pid // kv_heads)  # the new token's position
    d = tl.arange(0, D)
    kv = tl.load(k_new + pid.to(tl.int64) * D + d)
    vv = tl.load(v_new + pid.to(tl.int64) * D + d)
    host = (pid.to(tl.int64) * capacity + pos) * D + d
    tl.store(keys_host + host, kv)
    tl.store(values_host + host, vv)
    tail = (pid.to(tl.int64) * slot_tokens + slot_tokens - BS + pos % BS) * D + d  # the tail block is the last slot
    tl.store(slots_k + tail, kv)
    tl.store(slots_v + tail, vv)

    vf = vv.to(tl.float32)
    if PROXY == 0:
        x = tl.sum(vf * tl.load(w + h * D + d).to(tl.float32), axis=0)
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        score = tl.load(a + h).to(tl.float32) * soft
    elif PROXY == 1:
        score = tl.sqrt(tl.sum(vf * vf, axis=0))
    else:
        mixed = (pos.to(tl.int64) * 1_000_003 + h.to(tl.int64) * 7919 + seed * 104_729) % 2_147_483_647
        score = ((mixed * 48271) % 2_147_483_647).to(tl.float32) / 2_147_483_647.0
    tl.store(scores + pid.to(tl.int64) * capacity + pos, score)

    # the ring with the new key in its place, and the unit it completes (when it completes one)
    r = tl.arange(0, KERNEL)
    at = pos % KERNEL
    ring_row = pid.to(tl.int64) * KERNEL
    old = tl.load(ring + (ring_row + r[:, None]) * D + d[None, :])
    window = tl.where((r == at)[:, None], kv[None, :], old)
    tl.store(ring + (ring_row + at) * D + d, kv)
    first = pos + 1 - KERNEL
    if (first >= 0) & (first % STRIDE == 0):
        mean = tl.sum(window.to(tl.float32), axis=0) / KERNEL
        tl.store(units + (pid.to(tl.int64) * n_units_cap + first // STRIDE) * D + d, mean.to(units.dtype.element_ty))



def shape_refusal(dim: int, kernel: int) -> str | None:
    """Why the fused append cannot serve this shape (None: it can)."""
    if dim & (dim - 1) or kernel & (kernel - 1):
        return f"head_dim {dim} and the pooling kernel {kernel} must be powers of two for the fused append"
    return None


def append_token(k_new: torch.Tensor, v_new: torch.Tensor, lengths: torch.Tensor, keys_host: torch.Tensor, values_host: torch.Tensor,
                 slots_k: torch.Tensor, slots_v: torch.Tensor, scores: torch.Tensor, ring: torch.Tensor, units: torch.Tensor, *,
                 proxy: str, eviction: tuple[torch.Tensor, torch.Tensor] | None, seed: int, block: int, kernel: int, stride: int) -> None:
    """Write the step's token of every (sequence, KV head) everywhere the decoder keeps it.

    k_new/v_new [B, Hkv, D] (contiguous); lengths long [B] (the new token's position; not advanced);
    keys_host/values_host [B, Hkv, capacity, D] (pinned on a GPU host); slots_k/v [B, Hkv, (k+1)·block, D]
    with the tail block last; scores float32 [B, Hkv, capacity]; ring [B, Hkv, kernel, D]; units
    [B, Hkv, M, D]; eviction (W [Hkv, D], A [Hkv]) for ``trained``.
    """
    batch, kv_heads, dim = k_new.shape
    if proxy not in PROXY_IDS:
        raise ValueError(f"the fused append scores {', '.join(PROXY_IDS)}, got proxy {proxy!r}")
    why = shape_refusal(dim, kernel)
    if why is not None:
        raise ValueError(why)
    w, a = eviction if proxy == "trained" else (scores, scores)  # unread placeholders for the other proxies
    _append_kernel[(batch * kv_heads,)](
        k_new.contiguous(), v_new.contiguous(), lengths, keys_host, values_host, slots_k, slots_v, scores, ring, units, w, a,
        kv_heads, keys_host.shape[2], slots_k.shape[2], units.shape[2], seed,
        D=dim, BS=block, KERNEL=kernel, STRIDE=stride, PROXY=PROXY_IDS[proxy],
    )
