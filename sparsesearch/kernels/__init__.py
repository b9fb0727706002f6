"""Triton attention kernels driven by a BlockIndex. Importing this needs no GPU."""

from ._common import region_maps
from .block_sparse import block_sparse_attention
from .triangle import tail_attention, triangle_attention

__all__ = ["block_sparse_attention", "region_maps", "tail_attention", "triangle_attention"]
