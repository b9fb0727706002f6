"""The exchanges of one rank: real collectives on a process group, or a replay of what a rank would receive.

SPAVA (attention.py) and the exact ring (exact.py) talk to their peers only through two calls:

* ``all_gather(name, t)`` — t [T, ...] from every rank -> ([W, T, ...], wait): the passing selections and
  the query partials;
* ``ring_pass(step, kv, recv_len)`` — send this rank's current K‖V block to rank + 1, receive rank - 1's
  [B, Hkv, recv_len, 2D] -> (received, wait).

``Collectives`` runs them on torch.distributed (async, so compute overlaps them); ``Replay`` hands back
tensors built beforehand (simulate.py: one GPU standing in for rank r of W), so the same per-rank code runs
with or without a process group. Both count the bytes this rank sends the same way: an all-gather sends
its piece to each of the W - 1 peers (what a ring all-gather moves per rank), a ring step one block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.12 renames all_gather_into_tensor to all_gather_single (the old name warns); GPU hosts run 2.11.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _no_wait() -> None:
    return None


def gather_async(t: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """All-gather into one tensor, async: t [T, ...] -> ([W, T, ...] view, work). The output is flat along
    dim 0 ([W·T, ...]): the layout gloo requires and NCCL accepts."""
    world = dist.get_world_size(group)
    flat = t.new_empty((world * t.shape[0], *t.shape[1:]))
    work = _ALL_GATHER(flat, t.contiguous(), group=group, async_op=True)
    return flat.view(world, *t.shape), work


class Exchange:
    """Bookkeeping shared by both exchanges: world, rank, bytes sent, and (record=True) what arrived."""

    def __init__(self, world: int, rank: int, record: bool = False):
        self.world, self.rank, self.bytes_sent = world, rank, 0
        self.sent_by: dict[str, int] = {}  # bytes by exchange name ("ring" for every ring step)
        self.received: dict[str, torch.Tensor] | None = {} if record else None

    def _count(self, name: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.sent_by[name] = self.sent_by.get(name, 0) + nbytes

    def _count_gather(self, name: str, t: torch.Tensor) -> None:
        self._count(name, t.numel() * t.element_size() * (self.world - 1))

    def _count_pass(self, kv: torch.Tensor) -> None:
        self._count("ring", kv.numel() * kv.element_size())

    def _keep(self, name: str, t: torch.Tensor) -> None:
        if self.received is not None:
            self.received[name] = t


class Collectives(Exchange):
    """The real exchange on `group` (None: the default group)."""

    def __init__(self, group=None, record: bool = False):
        super().__init__(dist.get_world_size(group), dist.get_rank(group), record)
        self.group = group

    def all_gather(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """gather_async on this group: t [T, ...] -> ([W, T, ...], wait)."""
        self._count_gather(name, t)
        got, work = gather_async(t, self.group)
        self._keep(name, got)  # filled once work is waited on; callers read it after the attention returns
        return got, work.wait

    def ring_pass(self, step: int, kv: torch.Tensor, recv_len: int) -> tuple[torch.Tensor, object]:
        """Start sending kv [B, Hkv, L, 2D] to rank + 1 and receiving rank - 1's [B, Hkv, recv_len, 2D]."""
        self._count_pass(kv)
        recv = kv.new_empty((*kv.shape[:2], recv_len, kv.shape[-1]))
        ops = [dist.P2POp(dist.isend, kv, (self.rank + 1) % self.world, self.group),
               dist.P2POp(dist.irecv, recv, (self.rank - 1) % self.world, self.group)]
        works = dist.batch_isend_irecv(ops)
        self._keep(f"ring{step}", recv)

        def wait() -> None:
            for w in works:
                w.wait()

        return recv, wait


class Replay(Exchange):
    """Rank `rank` of `world` without a process group: every exchange returns the tensor stored for it.

    arrivals: name -> tensor, "passing_a" / "passing_b" / "query_out" / "query_lse" ([W, ...], as all_gather
    returns) and "ring<step>" (the block received at that step). Built by simulate.py.
    """

    def __init__(self, world: int, rank: int, arrivals: dict[str, torch.Tensor]):
        super().__init__(world, rank)
        self.arrivals = arrivals

    def _take(self, name: str) -> torch.Tensor:
        if name not in self.arrivals:
            raise ValueError(f"replay of rank {self.rank} of {self.world} has no {name!r} (has {sorted(self.arrivals)})")
        return self.arrivals[name]

    def all_gather(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        self._count_gather(name, t)
        return self._take(name), _no_wait

    def ring_pass(self, step: int, kv: torch.Tensor, recv_len: int) -> tuple[torch.Tensor, object]:
        self._count_pass(kv)
        return self._take(f"ring{step}"), _no_wait
