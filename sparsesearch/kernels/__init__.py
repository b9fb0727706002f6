"""Triton attention kernels driven by a BlockIndex. Importing this needs no GPU."""

from .block_sparse import block_sparse_attention
from .merge import merge_partials, merge_two
from .triangle import tail_attention, triangle_attention

__all__ = ["block_sparse_attention", "merge_partials", "merge_two", "tail_attention", "triangle_attention"]
