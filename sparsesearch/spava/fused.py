"""One rank's attention pieces through fused kernels, with lse for the merges (paper 001 §3.3; issue 12 §6).

Every piece SPAVA and the exact zigzag ring compute on a rank is one of two shapes:

* causal: M rows over K >= M keys, bottom-right aligned (row i admits key j <= i + K - M) — anchor rows,
  block rows over [passing ; anchor ; block], the owner's query over [context ; its own keys], the ring's
  diagonal step;
* full: every row admits every key — a non-owner's query over its context keys, the ring's off-diagonal
  steps (zigzag: an earlier chunk is wholly before both of a rank's chunks, see ``zigzag_step``).

``Engine`` runs them:

* ``torch`` — the plain path (sparsesearch.reference.masked_attention: chunked rows, fp32 softmax). The
  CPU path and the reference the fast path is tested against.
* ``triton`` — the block-sparse kernel (sparsesearch/kernels/block_sparse.py) over a dense index (every
  causal block listed; full pieces through the row_pos frame with every row at K - 1), which returns lse in
  natural log. Indices depend on shapes only: built once per shape and cached (flashinfer's plan/run
  split), so the per-call work is the launch. Square causal pieces whose lse nobody merges (the anchor
  rows) go to torch SDPA (flash on CUDA) instead: nothing to merge, and flash is the faster kernel there.
* ``auto`` — triton for CUDA tensors, torch otherwise.

Why not SDPA everywhere: F.scaled_dot_product_attention returns no lse, and its is_causal is top-left
aligned for M != K (torch refuses flash there). torch's internal ``aten._scaled_dot_product_flash_attention``
does return logsumexp on CUDA, but its semantics for non-square causal inputs are not checkable on the CPU
machines this was written on; the Triton kernel is, under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..index import BlockIndex
from ..reference import causal_mask_fn, masked_attention

ENGINES = ("auto", "torch", "triton")
INDEX_CACHE = 64  # indices kept per engine: a run has a handful of piece shapes per (W, rank)


def _every_key(kv_len: int):
    return lambda rows: torch.ones(1, 1, rows.numel(), kv_len, dtype=torch.bool, device=rows.device)


class Engine:
    """How a rank's pieces run (see the module docstring). block: the kernel's block_m = block_n (16..128)."""

    def __init__(self, kind: str = "auto", block: int = 128):
        if kind not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")
        if block not in (16, 32, 64, 128):
            raise ValueError(f"engine block must be 16, 32, 64 or 128, got {block}")
        self.kind, self.block = kind, block
        self._indices: dict[tuple, tuple[BlockIndex, torch.Tensor | None]] = {}

    def resolve(self, device: torch.device) -> str:
        """The engine that runs on `device`: auto -> triton on CUDA, torch elsewhere."""
        if self.kind == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.kind

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
               need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [B, Hq, M, D] over k/v [B, Hkv, K, D], causal (bottom-right) or every key.

        -> out [B, Hq, M, D] (fp32 on the torch engine, q's dtype on triton), lse fp32 [B, Hq, M] (None
        when need_lse is False and the piece ran on SDPA). No key: out 0, lse -inf.
        """
        if k.shape[2] == 0:  # an empty shard contributes o = 0, lse = -inf
            return q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        if self.resolve(q.device) == "torch":
            mask = causal_mask_fn(q.shape[2], k.shape[2]) if causal else _every_key(k.shape[2])
            return masked_attention(q, k, v, mask, scale=scale)
        if causal and not need_lse and q.shape[2] == k.shape[2]:
            group = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1), None
        from ..kernels import block_sparse_attention

        index, row_pos = self.index(q.shape[0], k.shape[1], q.shape[2], k.shape[2], causal, q.device)
        return block_sparse_attention(q, k, v, index, scale=scale, row_pos=row_pos)

    def index(self, batch: int, kv_heads: int, q_len: int, kv_len: int, causal: bool,
              device: torch.device) -> tuple[BlockIndex, torch.Tensor | None]:
        """The dense index of one piece shape (kv head space) and its row_pos frame (None when causal)."""
        key = (batch, kv_heads, q_len, kv_len, causal, device)
        if key not in self._indices:
            from ..patterns import dense

            if len(self._indices) >= INDEX_CACHE:
                self._indices.pop(next(iter(self._indices)))
            row_pos = None if causal else torch.full((q_len,), kv_len - 1, dtype=torch.int64, device=device)
            index = dense.build_index(None, q_len, kv_len, batch=batch, heads=kv_heads, block_m=self.block,
                                      block_n=self.block, head_space="kv", device=device, row_pos=row_pos)
            self._indices[key] = (index, row_pos)
        return self._indices[key]


def as_engine(engine: "Engine | str | None") -> Engine:
    """None -> Engine('auto'); a name -> Engine(name); an Engine as is."""
    if isinstance(engine, Engine):
        return engine
    return Engine("auto" if engine is None else engine)
