"""Dynamic index builds replayed from CUDA graphs: what makes them cheap at short lengths.

A vertical-slash or block top-k index is estimated from q/k on every call, in about eighty small torch
launches plus device syncs (the packed lists are as wide as their largest count). At 8K tokens that costs
1.1–2.5 ms on an H200 against 0.93 ms for the whole of SDPA (benchmarks/RESULTS.md, Run 5), so below ~16K
index + kernel lost to dense on launch overhead alone. Here each (pattern, params, shapes, head space,
device) is built once with ``static_widths`` (lists as wide as their bound, no sync), captured in a CUDA
graph, and replayed: per call, two index_select launches into the graph's static inputs and one replay.
Where the fused Triton build (kernels/index_build.py: 2 launches for block top-k, 4 for vertical-slash)
takes the inputs, the runtime's ``execute.StaticIndexCache`` launches it directly instead: a replay's two
index_select copies cost more than those few launches (H200, 8K: 0.22 vs 0.11 ms). Graphs remain for the
inputs the fused build refuses (``kernels.dynamic_index.fused_refusal``); a graph captured over inputs it takes
would capture the fused build.

The index a replay returns lives in the graph's static outputs: the next replay of the same entry
overwrites it. The runtime consumes each index in the launch that follows on the same stream (one head
group at a time), which stream order makes safe; a caller that keeps an index across calls must copy it.
Graphs are used only on CUDA, in the identity frame (no region row_pos), up to ``MAX_TOKENS`` keys (the
static lists and each graph's pool grow with the square of the length, and past 16K one build is no
longer launch-bound), and never while another capture is running. Every new (group, shape) pays one
warm-up build and one capture, once: a stream of prompts of ever-new lengths gains nothing from graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .index import BlockIndex

# Longest key length built through a graph. The replay saved 1.2-1.4 ms at 4K-8K but 0.3 ms at 32K (H200,
# benchmarks/RESULTS.md), while each captured build keeps its intermediates in its own memory pool, and those
# grow with the square of the length (block top-k over 32 heads: ~8 MB per [B, H, QB, KB] fp32 tensor at
# 16K, ~32 MB at 32K): past 16K the memory is not worth the saving.
MAX_TOKENS = 16384
LIMIT = 16  # graphs kept per cache: at most ~1-2 GB of pools at 16K, far less at the lengths graphs pay at


@dataclass
class _Entry:
    """One captured build: static inputs q [B, Hq', N, D], k [B, Hkv', Nk, D] (the group's heads), the head
    ids they are selected with, the graph and the index it writes."""

    q_ids: torch.Tensor
    kv_ids: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    graph: torch.cuda.CUDAGraph
    index: BlockIndex


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a build on these tensors may go through a graph (see the module docstring)."""
    return q.is_cuda and k.shape[2] <= MAX_TOKENS and not torch.cuda.is_current_stream_capturing()


class GraphedIndexCache:
    """Captured dynamic-index builds by (pattern, params, heads, block shape, head space, shapes, dtype,
    device), bounded: past ``limit`` entries the oldest goes first."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._entries: dict[tuple, _Entry] = {}

    def index(self, g, q: torch.Tensor, k: torch.Tensor, space: str) -> BlockIndex:
        """The group's index from q [B, Hq, N, D], k [B, Hkv, Nk, D], as execute.build_group_index builds it.
        Valid until the next call with the same key."""
        key = (g.pattern, g.params, g.heads, g.block_m, g.block_n, space, tuple(q.shape), tuple(k.shape), q.dtype, q.device)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._capture(g, q, k, space)
            if len(self._entries) >= self.limit:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = entry
        torch.index_select(q, 1, entry.q_ids, out=entry.q)
        torch.index_select(k, 1, entry.kv_ids, out=entry.k)
        entry.graph.replay()
        return entry.index

    @staticmethod
    def _capture(g, q: torch.Tensor, k: torch.Tensor, space: str) -> _Entry:
        from .execute import device_ids, estimate_heads
        from .kernels.dynamic_index import build as build_dynamic

        q_ids, kv_ids = estimate_heads(g, q.shape[1] // k.shape[1], space)  # the heads the eager build slices
        qi, ki = device_ids(tuple(q_ids), q.device), device_ids(tuple(kv_ids), q.device)
        sq, sk = q.index_select(1, qi), k.index_select(1, ki)

        def build() -> BlockIndex:
            return build_dynamic(g.pattern, g.params, sq, sk, head_space=space, block_m=g.block_m, block_n=g.block_n, static_widths=True)

        # Warm-up on a side stream (the pattern PyTorch's CUDA-graph notes give): lazy library handles and
        # the allocator's first blocks come into being outside the capture.
        side = torch.cuda.Stream(q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):
            build()
        torch.cuda.current_stream(q.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            index = build()
        return _Entry(qi, ki, sq, sk, graph, index)
