"""SPAVA's sequence layout (paper 001 §3.2, §4.3): anchor, 2W virtual hosts in ZigZag, query at the end.

A prompt of n tokens is [context (n_ctx tokens) ; query (q tokens)]. The context is
[anchor (l_a) ; block_0 ; ... ; block_{2W-1}]. Rank r of W holds virtual hosts r and 2W-1-r, so its local
sequence is [anchor ; block_r ; block_{2W-1-r} ; query] (anchor and query replicated on every rank).

Reading chosen: the paper sets the block length b = ceil((n_ctx - l_a)/(2W)); we split the remainder
evenly instead (lengths floor(m/2W) or floor(m/2W)+1, the longer ones first), so that no block is empty
or a stub for lengths that are not multiples of 2W. The passing length each vhost sends is
p = min(l_p, shortest block): one fixed size per layer for all_gather_into_tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MULTIPLE = 128  # the paper's kernel constraint on l_a and l_p (App. C: "l_p must be a multiple of 128")


def default_lengths(n: int) -> tuple[int, int]:
    """Paper defaults for a prompt of n tokens: l_a = n/64, l_p = n/128, rounded up to multiples of 128."""
    return MULTIPLE * math.ceil((n // 64) / MULTIPLE), MULTIPLE * math.ceil((n // 128) / MULTIPLE)


@dataclass(frozen=True)
class Layout:
    """n_ctx context tokens (anchor included), q query tokens, W ranks; l_a anchor, l_p passing per vhost."""

    n_ctx: int
    q: int
    world: int
    l_a: int
    l_p: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"nproc must be >= 1, got {self.world}")
        if self.q < 1:
            raise ValueError(f"the query block needs at least one token, got {self.q}")
        if self.l_a < 0 or self.l_p < 0:
            raise ValueError(f"l_a and l_p must be >= 0, got l_a={self.l_a}, l_p={self.l_p}")
        if self.n_ctx - self.l_a < 2 * self.world:
            raise ValueError(
                f"{self.n_ctx} context tokens with anchor {self.l_a} leave {self.n_ctx - self.l_a} for 2x{self.world} "
                f"virtual hosts: nproc {self.world} is larger than this context allows (at most {max(0, (self.n_ctx - self.l_a) // 2)})"
            )

    @property
    def hosts(self) -> int:
        return 2 * self.world

    @property
    def n(self) -> int:
        return self.n_ctx + self.q

    def block(self, j: int) -> tuple[int, int]:
        """Global [start, stop) of virtual host j's context block."""
        m, h = self.n_ctx - self.l_a, self.hosts
        base, extra = divmod(m, h)
        start = self.l_a + j * base + min(j, extra)
        return start, start + base + (1 if j < extra else 0)

    @property
    def shortest(self) -> int:
        return (self.n_ctx - self.l_a) // self.hosts

    @property
    def longest(self) -> int:
        return -(-(self.n_ctx - self.l_a) // self.hosts)

    @property
    def passing(self) -> int:
        """Tokens each vhost passes on (per KV head): min(l_p, shortest block)."""
        return min(self.l_p, self.shortest)

    def vhosts(self, rank: int) -> tuple[int, int]:
        """ZigZag: rank r holds virtual hosts r and 2W-1-r."""
        return rank, self.hosts - 1 - rank

    def anchor_slice(self, rank: int) -> tuple[int, int]:
        """The part [start, stop) of the anchor rank r's query partial attends (App. B.3 balance)."""
        base, extra = divmod(self.l_a, self.world)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    def local_positions(self, rank: int) -> list[int]:
        """Global positions of rank r's local tokens [anchor ; block_r ; block_{2W-1-r} ; query]."""
        a, b = (self.block(j) for j in self.vhosts(rank))
        return [*range(self.l_a), *range(*a), *range(*b), *range(self.n_ctx, self.n)]

    def local_sizes(self, rank: int) -> tuple[int, int, int, int]:
        """(anchor, block_a, block_b, query) token counts of rank r's local sequence."""
        a, b = (self.block(j) for j in self.vhosts(rank))
        return self.l_a, a[1] - a[0], b[1] - b[0], self.q


def check_lengths(layout: Layout, *, multiple: int = MULTIPLE) -> None:
    """The run-level rules on l_a / l_p (§7): multiples of `multiple`, neither larger than a block (the
    anchor is attended by every row and computed on every rank: past a block it outweighs the split)."""
    for name, value in (("anchor (l_a)", layout.l_a), ("passing (l_p)", layout.l_p)):
        if value % multiple:
            raise ValueError(f"{name} must be a multiple of {multiple}, got {value}")
    if layout.l_p > layout.longest:
        raise ValueError(f"passing (l_p) {layout.l_p} is larger than a block ({layout.longest} tokens at nproc {layout.world})")
    if layout.l_a > layout.longest:
        raise ValueError(f"anchor (l_a) {layout.l_a} is larger than a block ({layout.longest} tokens at nproc {layout.world})")
