"""Exact sequence-parallel attention: the reference and speed baseline SPAVA runs against.

Preferred: torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``,
ring attention over its load-balanced sharding), used where the installed torch has a sharding rule for
the device's SDPA kernel — probed once per run (``torch_cp_support``). torch 2.13 on CPU has none
(``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so on gloo/CPU the
fallback runs: a zigzag ring on the same process group (ring-flash-attention's layout: the sequence cut
into 2W chunks, rank r holds chunks r and 2W-1-r; K/V travel round the ring in W-1 steps while each
rank attends to the block it holds, partials merged by lse). Which one ran is reported.

The ring also serves sliding-window layers (window=), exactly: under torch CP a hybrid model's (Gemma 3)
global layers go through torch's ring and its sliding layers through ours on the same shards, which are
the zigzag layout (torch's head-tail load balancer cuts the sequence into 2W chunks and gives rank r
chunks r and 2W-1-r; ``check_zigzag_shard`` holds it to that). Engine names: ``TORCH_CP``,
``TORCH_CP_SLIDING_RING`` (that hybrid) and ``ZIGZAG_RING``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..merge import merge_two
from ..reference import masked_attention
from .comm import Collectives, Exchange
from .fused import Engine, as_engine

TORCH_CP = "torch-cp"
TORCH_CP_SLIDING_RING = "torch-cp+sliding-ring"  # global layers torch CP, sliding layers our ring on torch's shards
ZIGZAG_RING = "zigzag-ring"


def zigzag_chunks(n: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global [start, stop) of the two chunks rank r holds: r and 2W-1-r of 2W balanced chunks."""
    base, extra = divmod(n, 2 * world)
    bound = lambda j: j * base + min(j, extra)
    return (bound(rank), bound(rank + 1)), (bound(2 * world - 1 - rank), bound(2 * world - rank))


def zigzag_positions(n: int, world: int, rank: int) -> list[int]:
    """Global positions rank r holds in the zigzag ring layout: chunks r and 2W-1-r of 2W balanced chunks."""
    (a0, a1), (b0, b1) = zigzag_chunks(n, world, rank)
    return [*range(a0, a1), *range(b0, b1)]


def zigzag_step(n: int, world: int, rank: int, src: int) -> tuple[int, int, bool]:
    """Which of rank r's rows attend which of src's keys in one ring step: (row_start, key_stop, causal).

    Rows [row_start:] attend keys [:key_stop] — causally (bottom-right, square) when src == rank, else every
    one of them; rows before row_start attend nothing. From the chunk order alone: for src < r, chunk src
    precedes both of r's chunks and chunk 2W-1-src follows both; for src > r, both of src's chunks lie
    between r's two (ring-flash-attention's zigzag split).
    """
    (a0, a1), (b0, b1) = zigzag_chunks(n, world, rank)
    (c0, c1), (d0, d1) = zigzag_chunks(n, world, src)
    if src == rank:
        return 0, (a1 - a0) + (b1 - b0), True
    if src < rank:
        return 0, c1 - c0, False
    return a1 - a0, (c1 - c0) + (d1 - d0), False


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None):
    """mask_fn for masked_attention from global positions: causal, and within `window` when given."""

    def mask(rows: torch.Tensor) -> torch.Tensor:
        qp, kp = q_pos[rows][:, None], k_pos[None, :]
        ok = kp <= qp
        if window is not None:
            ok &= qp - kp < window
        return ok[None, None]

    return mask


def _ring_step(q, kv, pos, n, world, rank, src, scale, window, engine: Engine):
    """One step's partial: (rows, out, lse) — out [B, Hq, len(rows), D], lse fp32 over q's rows[rows]."""
    d = kv.shape[-1] // 2
    if window is not None:  # sliding layers: the plain path under the position mask (both sides' positions)
        k_pos = torch.tensor(zigzag_positions(n, world, src), device=pos.device)
        o, l = masked_attention(q, kv[..., :d], kv[..., d:], position_mask(pos, k_pos, window), scale=scale)
        return slice(0, None), o, l
    row0, stop, causal = zigzag_step(n, world, rank, src)
    o, l = engine.attend(q[:, :, row0:], kv[:, :, :stop, :d], kv[:, :, :stop, d:], scale, causal)
    return slice(row0, None), o, l


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, n: int, scale: float,
                   group=None, window: int | None = None, stats: dict | None = None,
                   engine: Engine | str | None = None, exchange: Exchange | None = None) -> torch.Tensor:
    """Exact causal attention of this rank's tokens over the whole sequence, K/V passed round the ring.

    q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] at global positions pos long [N_r] (zigzag_positions of n).
    Returns out [B, Hq, N_r, D] in q's dtype. engine: how each step's piece runs (fused.Engine; None =
    auto); sliding-window layers (window=) run on the plain path. exchange: comm.Collectives on `group`
    by default, comm.Replay without a process group.
    """
    exchange = Collectives(group) if exchange is None else exchange
    engine = as_engine(engine)
    world, rank = exchange.world, exchange.rank
    sent_before = exchange.bytes_sent
    kv = torch.cat([k, v], dim=-1).contiguous()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(world):
        src = (rank - step) % world  # the block held came from rank - step
        if step < world - 1:  # start the next hop before attending to this one
            nxt = len(zigzag_positions(n, world, (rank - step - 1) % world))
            recv, wait = exchange.ring_pass(step, kv, nxt)
        rows, o, l = _ring_step(q, kv, pos, n, world, rank, src, scale, window, engine)
        out[:, :, rows], lse[:, :, rows] = merge_two(out[:, :, rows], lse[:, :, rows], o, l)
        if step < world - 1:
            wait()
            kv = recv
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + exchange.bytes_sent - sent_before
    return out.to(q.dtype)


def _cp_mesh(device: torch.device, group=None):
    """A one-dimensional DeviceMesh over `group` (the world by default): torch CP on our own process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)


@contextmanager
def torch_context_parallel(n: int, device: torch.device, group=None):
    """Run the body under torch's ``context_parallel`` for one prompt of n tokens (n divisible by 2W).

    Yields this rank's global positions long [N_r]: torch's own load-balanced (head-tail) shard of 0..n-1,
    which the model's input ids and position ids are indexed by. Inside, every causal SDPA call is torch's
    ring attention over the group.
    """
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel

    pos = torch.arange(n, device=device)[None]
    sdpa = F.scaled_dot_product_attention
    try:
        with context_parallel(_cp_mesh(device, group), buffers=[pos], buffer_seq_dims=[1], no_restore_buffers={pos}):
            yield pos[0]
    finally:
        # torch 2.11's context_parallel restores SDPA only on a clean exit: after an error in the body (the
        # probe's, on a backend without a sharding rule) every later SDPA call of the process, CP or not,
        # went through the ring's DTensor dispatch (the H200 suite's VLM tests failed on it)
        F.scaled_dot_product_attention = sdpa


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the local shard under torch CP: q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D] -> [B, Hq, N_r, D].

    K/V heads are repeated for GQA: torch's ring handlers take the flash / efficient / cuDNN kernels,
    not all of which accept enable_gqa (the ring then passes Hq heads of K/V instead of Hkv).
    """
    import torch.nn.functional as F

    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def probe_inputs(n: int, device: torch.device) -> list[torch.Tensor]:
    """q, k, v [1, 2, n, 16] of the probe, the same on every rank whatever each rank's RNG did before: each rank
    compares its shard of torch CP's output with its own dense SDPA, which is only the same function when
    every rank holds the same tensors (unseeded, a 2-GPU `spava run` refused torch CP as 'disagreeing')."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [torch.randn(1, 2, n, 16, generator=g).to(device, dtype) for _ in range(3)]


def torch_cp_support(device: torch.device, group=None) -> str | None:
    """None when torch's context_parallel runs causal SDPA on this device and group, else the reason it does not."""
    world = dist.get_world_size(group)
    try:
        n = 16 * world
        t = probe_inputs(n, device)
        want = cp_attention(*t, 0.25)
        with torch_context_parallel(n, device, group) as pos:
            got = cp_attention(*(x[:, :, pos] for x in t), 0.25)
        if not torch.allclose(got.float(), want[:, :, pos].float(), atol=2e-2):
            return "context_parallel's causal SDPA disagrees with dense SDPA"
        return None
    except (NotImplementedError, RuntimeError, AssertionError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def exact_engine(cp_reason: str | None, n: int, world: int, sliding: bool) -> tuple[str, str | None]:
    """Which exact baseline runs a prompt of n tokens: (TORCH_CP or TORCH_CP_SLIDING_RING, None) where torch CP
    runs, else (ZIGZAG_RING, why not torch CP). sliding: the model has sliding-window layers (they ride our
    ring on torch's shards, so torch CP still serves its global layers)."""
    if cp_reason is not None:
        return ZIGZAG_RING, cp_reason
    if n % (2 * world):
        return ZIGZAG_RING, f"torch context_parallel needs the length divisible by 2W = {2 * world}; got {n}"
    return (TORCH_CP_SLIDING_RING if sliding else TORCH_CP), None


def check_zigzag_shard(pos: torch.Tensor, n: int, world: int, rank: int) -> None:
    """ValueError unless torch CP's shard of 0..n-1 on this rank (pos long [N_r]) is the zigzag ring's: the
    sliding layers under TORCH_CP_SLIDING_RING pass K/V round our ring, which assumes every rank holds
    chunks r and 2W-1-r. A torch whose load balancer shards otherwise is refused, not silently wrong."""
    want = zigzag_positions(n, world, rank)
    if pos.tolist() != want:
        raise ValueError(f"torch context_parallel's shard on rank {rank} is not the zigzag layout our sliding-window ring needs "
                         f"(first positions {pos[:4].tolist()}, expected {want[:4]}); run without torch CP")
