"""Triton attention kernels driven by a BlockIndex. Importing this needs no GPU."""

from .block_sparse import block_sparse_attention
from .triangle import tail_attention, triangle_attention

__all__ = ["block_sparse_attention", "tail_attention", "triangle_attention"]
