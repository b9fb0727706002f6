"""Exact sequence-parallel attention: the reference and speed baseline SPAVA runs against.

Preferred: torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``,
ring attention over its load-balanced sharding), used where the installed torch has a sharding rule for
the device's SDPA kernel — probed once per run (``torch_cp_support``). torch 2.13 on CPU has none
(``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so on gloo/CPU the
fallback runs: a zigzag ring on the same process group (ring-flash-attention's layout: the sequence cut
into 2W chunks, rank r holds chunks r and 2W-1-r; K/V travel round the ring in W-1 steps while each
rank attends to the block it holds, partials merged by lse). Which one ran is reported.

The fallback also serves sliding-window layers (window=), exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..merge import merge_two
from ..reference import masked_attention


def zigzag_positions(n: int, world: int, rank: int) -> list[int]:
    """Global positions rank r holds in the zigzag ring layout: chunks r and 2W-1-r of 2W balanced chunks."""
    base, extra = divmod(n, 2 * world)
    bounds = [j * base + min(j, extra) for j in range(2 * world + 1)]
    return [*range(bounds[rank], bounds[rank + 1]), *range(bounds[2 * world - 1 - rank], bounds[2 * world - rank])]


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None):
    """mask_fn for masked_attention from global positions: causal, and within `window` when given."""

    def mask(rows: torch.Tensor) -> torch.Tensor:
        qp, kp = q_pos[rows][:, None], k_pos[None, :]
        ok = kp <= qp
        if window is not None:
            ok &= qp - kp < window
        return ok[None, None]

    return mask


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n: int, scale: float,
                   group=None, window: int | None = None, stats: dict | None = None) -> torch.Tensor:
    """Exact causal attention of this rank's tokens over the whole sequence, K/V passed round the ring.

    q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] at global positions pos long [N_r] (zigzag_positions of n).
    Returns out [B, Hq, N_r, D] in q's dtype.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = torch.cat([k, v], dim=-1).contiguous()
    d = k.shape[-1]
    out = lse = None
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:  # start the next hop before attending to this one
            nxt = (rank - step - 1) % world
            recv = kv.new_empty((*kv.shape[:2], len(zigzag_positions(n, world, nxt)), kv.shape[-1]))
            ops = [dist.P2POp(dist.isend, kv, (rank + 1) % world, group), dist.P2POp(dist.irecv, recv, (rank - 1) % world, group)]
            works = dist.batch_isend_irecv(ops)
            if stats is not None:
                stats["bytes_sent"] = stats.get("bytes_sent", 0) + kv.numel() * kv.element_size()
        k_pos = torch.tensor(zigzag_positions(n, world, src), device=pos.device)  # the block held came from rank - step
        o, l = masked_attention(q, kv[..., :d], kv[..., d:], position_mask(pos, k_pos, window), scale=scale)
        out, lse = (o, l) if out is None else merge_two(out, lse, o, l)
        if step < world - 1:
            for w in works:
                w.wait()
            kv = recv
    return out.to(q.dtype)


def torch_cp_support(device: torch.device, group=None) -> str | None:
    """None when torch's context_parallel runs causal SDPA on this device and group, else the reason it does not."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size(group)
    try:
        mesh = init_device_mesh(device.type, (world,))
        t = [torch.randn(1, 1, 8 * world, 16, device=device) for _ in range(3)]
        with context_parallel(mesh, buffers=t, buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(*t, is_causal=True)
        return None
    except (NotImplementedError, RuntimeError, AssertionError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
