"""One device standing in for every rank of a W-rank run, one rank at a time (issue 12 §6).

For rank r of W this builds exactly what r would hold in a real launch — its local q/k/v (anchor, its two
zigzag virtual hosts, the query; or its two ring chunks) — and everything r would receive (the passing
selections and query partials every rank all-gathers; the K/V blocks that reach it round the ring),
wrapped in a comm.Replay. ``spava_attention`` / ``ring_attention`` then run r's compute alone, with no
process group: what the benchmark times (benchmarks/spava_rank.py --simulate-world) and what
tests/test_spava.py checks against a real gloo run, tensor for tensor.

What other ranks send is computed with the same code and the same engine they would run
(attention.select_passing, attention.query_partial), so the replayed tensors are theirs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import query_partial, select_passing
from .comm import Replay
from .exact import zigzag_positions
from .fused import Engine
from .layout import Layout


@dataclass
class RankInputs:
    """What rank `rank` of `world` holds: local q [B, Hq, N_r, D], k/v [B, Hkv, N_r, D], global positions
    pos long [N_r], and the replay of what it receives."""

    rank: int
    world: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    replay: Replay


def _local(q, k, v, positions: list[int]):
    pos = torch.tensor(positions, device=q.device)
    return q[:, :, pos], k[:, :, pos], v[:, :, pos], pos


def spava_world(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float,
                engine: Engine) -> list[RankInputs]:
    """Every rank's inputs for SPAVA over the global q [B, Hq, N, D], k/v [B, Hkv, N, D] (N = layout.n).

    The all-gathered tensors are shared by all ranks (an all-gather gives each the same result).
    """
    locals_ = [_local(q, k, v, layout.local_positions(r)) for r in range(layout.world)]
    sent = {"passing_a": [], "passing_b": [], "query_out": [], "query_lse": []}
    for r, (qr, kr, vr, _) in enumerate(locals_):
        sel_a, sel_b = select_passing(qr, kr, vr, layout, r)
        o, lse = query_partial(qr, kr, vr, layout, r, scale, engine)
        for name, t in zip(sent, (sel_a, sel_b, o, lse)):
            sent[name].append(t)
    arrivals = {name: torch.stack(ts) for name, ts in sent.items()}
    return [RankInputs(r, layout.world, *loc, Replay(layout.world, r, arrivals)) for r, loc in enumerate(locals_)]


def ring_world(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int) -> list[RankInputs]:
    """Every rank's inputs for the exact zigzag ring over the global sequence (n = q.shape[2]): at step s
    rank r receives the K‖V block rank (r - s - 1) mod W started with."""
    n = q.shape[2]
    locals_ = [_local(q, k, v, zigzag_positions(n, world, r)) for r in range(world)]
    kvs = [torch.cat([kr, vr], dim=-1).contiguous() for _, kr, vr, _ in locals_]
    out = []
    for r, loc in enumerate(locals_):
        arrivals = {f"ring{s}": kvs[(r - s - 1) % world] for s in range(world - 1)}
        out.append(RankInputs(r, world, *loc, Replay(world, r, arrivals)))
    return out
