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

Split-K: a piece of few rows (M <= block: one row tile, e.g. the query partial of q <= 128 tokens) over a
long shard (K > split_k keys) is cut along K (``key_splits``): every split sees all M rows over its keys
(the owner's causal piece = its context prefix, split, plus the square causal tail over the query's own keys),
and the partials merge by lse. On triton the equal-length splits fold into the batch axis, one launch with
S times the programs (one row tile per head leaves most SMs idle otherwise); on torch they run one after
another, so the plain path holds M x split_k scores and split_k upcast keys per head at a time instead of
the whole shard.

Why not SDPA everywhere: F.scaled_dot_product_attention returns no lse, and its is_causal is top-left
aligned for M != K (torch refuses flash there). torch's internal ``aten._scaled_dot_product_flash_attention``
does return logsumexp on CUDA, but its semantics for non-square causal inputs are not checkable on the CPU
machines this was written on; the Triton kernel is, under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..index import BlockIndex
from ..merge import merge_partials
from ..reference import causal_mask_fn, masked_attention

ENGINES = ("auto", "torch", "triton")
INDEX_CACHE = 64  # indices kept per engine: a run has a handful of piece shapes per (W, rank)
SPLIT_K = 4096  # keys per split of a few-row piece: 16K-key shards -> 4 splits, 4x the programs of one row tile


def key_splits(kv_len: int, rows: int, causal: bool, split: int) -> list[tuple[int, int, bool]]:
    """Cut a piece of `rows` rows over `kv_len` keys along K: [(start, stop, causal)], contiguous, covering
    0..kv_len. Full pieces: chunks of `split` keys (the last shorter). Causal (bottom-right, kv_len >= rows):
    the prefix every row sees, chunked, then the square causal piece over the last `rows` keys."""
    if split < 1:
        raise ValueError(f"split_k must be >= 1 keys, got {split}")
    prefix = kv_len - rows if causal else kv_len
    if prefix < 0:
        raise ValueError(f"a causal piece needs kv_len >= rows, got {kv_len} keys for {rows} rows")
    pieces = [(s, min(prefix, s + split), False) for s in range(0, prefix, split)]
    return pieces + ([(prefix, kv_len, True)] if causal else [])


def _every_key(kv_len: int):
    return lambda rows: torch.ones(1, 1, rows.numel(), kv_len, dtype=torch.bool, device=rows.device)


class Engine:
    """How a rank's pieces run (see the module docstring). block: the kernel's block_m = block_n (16..128)."""

    def __init__(self, kind: str = "auto", block: int = 128, split_k: int | None = SPLIT_K):
        if kind not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")
        if block not in (16, 32, 64, 128):
            raise ValueError(f"engine block must be 16, 32, 64 or 128, got {block}")
        if split_k is not None and split_k < 1:
            raise ValueError(f"engine split_k must be >= 1 keys or None, got {split_k}")
        self.kind, self.block, self.split_k = kind, block, split_k
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
        m, kv = q.shape[2], k.shape[2]
        if self.split_k is not None and m <= self.block and kv > self.split_k and (kv >= m or not causal):
            return self._split(q, k, v, scale, causal)
        return self._one(q, k, v, scale, causal, need_lse)

    def _split(self, q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """attend() of a few-row piece cut along K (key_splits), partials merged by lse."""
        pieces = key_splits(k.shape[2], q.shape[2], causal, self.split_k)
        full = [p for p in pieces if not p[2] and p[1] - p[0] == self.split_k]
        parts = []
        if full and self.resolve(q.device) == "triton":  # equal splits as batch entries: one launch
            parts.append(self._folded(q, k, v, scale, len(full)))
            pieces = pieces[len(full):]
        for start, stop, c in pieces:
            o, lse = self._one(q, k[:, :, start:stop], v[:, :, start:stop], scale, c, True)
            parts.append((o[None], lse[None]))
        out, lse = merge_partials(torch.cat([o.float() for o, _ in parts]), torch.cat([l for _, l in parts]))
        return (out if self.resolve(q.device) == "torch" else out.to(q.dtype)), lse

    def _folded(self, q, k, v, scale: float, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `splits` chunks of split_k keys as S·B batch entries -> (out [S, B, Hq, M, D], lse [S, B, Hq, M])."""
        b, h, c = k.shape[0], k.shape[1], self.split_k
        fold = lambda t: t[:, :, : splits * c].reshape(b, h, splits, c, t.shape[-1]).permute(2, 0, 1, 3, 4).reshape(splits * b, h, c, t.shape[-1])
        o, lse = self._one(q.repeat(splits, 1, 1, 1), fold(k), fold(v), scale, False, True)
        return o.view(splits, *q.shape), lse.view(splits, *q.shape[:3])

    def _one(self, q, k, v, scale: float, causal: bool, need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One piece, unsplit (attend's contract)."""
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
