"""NOSA block selection (paper 004 Eq. 3-5, docs/peers.md 2(a)), batched over any leading dims.

The reading this module implements (paper inconsistencies resolved once, tested in tests/test_nosa.py):

* Compressed keys are the InfLLM-v2 ones the code uses: mean over windows of ``kernel`` = 32 keys at
  ``stride`` = 16 (B.2.2 swaps the two numbers); a unit exists once its whole window is in the cache, so
  one new unit appears every ``stride`` tokens while decoding. Eq. 3's sum runs over ``kernel`` terms.
* Query score: per query head a softmax over the compressed keys (scaled by 1/sqrt(d)), summed over the
  GQA group (the code's reading; §2.1's raw q.K_c ranks the same only when G = 1).
* Block pooling: block j takes the max over units [r*j - 1, r*j + r - 1], r = block / stride (window
  r + 1, stride r, padding 1), i.e. the overlapping 5-unit window of the code at block 64, not Eq. 4's
  "units inside [j]".
* The tail block (the one holding the current token) is always attended and lives in its own GPU slot,
  outside the budget. The budget k counts n_init sink blocks + n_win window blocks (the complete blocks
  right before the tail) + k_q query-aware + k_e query-agnostic blocks, k = n_init + n_win + k_q + k_e.
* Both top-k's order blocks by (score descending, block index ascending): a stable sort, exact for any
  dtype and any number of ties. ``torch.topk`` alone does not fix the order of ties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG = float("-inf")
POS = float("inf")


def unit_count(n_keys: torch.Tensor | int, kernel: int, stride: int):
    """Complete compressed units over ``n_keys`` keys: floor((n - kernel) / stride) + 1, 0 below kernel."""
    if isinstance(n_keys, int):
        return max(0, (n_keys - kernel) // stride + 1) if n_keys >= kernel else 0
    return torch.where(n_keys >= kernel, torch.div(n_keys - kernel, stride, rounding_mode="floor") + 1, 0)


def compress(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Mean over windows of ``kernel`` positions every ``stride`` along dim -2.

    x: [..., T, D] -> [..., M, D], M = unit_count(T). (Per-token scores: pass x[..., None].)
    """
    n = x.shape[-2]
    m = unit_count(n, kernel, stride)
    if m == 0:
        return x.new_zeros(*x.shape[:-2], 0, x.shape[-1])
    return x[..., : (m - 1) * stride + kernel, :].unfold(-2, kernel, stride).mean(-1)


def pool_blocks(units: torch.Tensor, n_blocks: int, ratio: int) -> torch.Tensor:
    """Max over each block's units [ratio*j - 1, ratio*j + ratio - 1] (-inf where a unit is missing).

    units: [..., M] (-inf for units not to count) -> [..., n_blocks].
    """
    m = units.shape[-1]
    need = ratio * n_blocks + 1  # padded length so that every block has its (ratio + 1)-wide window
    padded = F.pad(units, (1, max(0, need - m - 1)), value=NEG)
    return padded.unfold(-1, ratio + 1, ratio)[..., :n_blocks, :].amax(-1)


def query_unit_scores(q: torch.Tensor, units: torch.Tensor, n_units: torch.Tensor, scale: float) -> torch.Tensor:
    """Eq. 3 for the query: softmax over the compressed keys each row sees, summed over the GQA group.

    q: [..., Hkv, G, R, D] rows grouped by KV head; units: [..., Hkv, M, D] compressed keys;
    n_units: long [R], how many units row r sees, or [B, R] per sequence when the leading dim is a batch
    (each sequence has its own length). Returns float32 [..., Hkv, R, M], -inf on unseen units.
    """
    logits = torch.einsum("...hgrd,...hmd->...hgrm", q.float(), units.float()) * scale
    seen = torch.arange(units.shape[-2], device=q.device) < n_units[..., None]  # [R, M] or [B, R, M]
    per_seq = seen.dim() == 3
    logits = logits.masked_fill(~(seen[:, None, None] if per_seq else seen), NEG)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(-3)  # a row that sees no unit has all zeros
    return probs.masked_fill(~(seen[:, None] if per_seq else seen), NEG)


def agnostic_unit_scores(e: torch.Tensor, n_units: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Eq. 3 for the query-agnostic score: mean over (kernel, stride) windows of per-token scores.

    e: [..., R, T] per-token scores as row r sees them; n_units: long [R], or [B, R] when e is
    [B, Hkv, R, T]. Returns float32 [..., R, M], -inf on units row r lacks.
    """
    units = compress(e.float()[..., None], kernel, stride)[..., 0]
    seen = torch.arange(units.shape[-1], device=e.device) < n_units[..., None]
    return units.masked_fill(~(seen[:, None] if seen.dim() == 3 else seen), NEG)


def top_mask(scores: torch.Tensor, count: int, valid: torch.Tensor) -> torch.Tensor:
    """The ``count`` best valid entries along the last dim by (score desc, index asc); exact on ties.

    scores: [..., N] (invalid entries are ignored whatever their value); valid: bool broadcastable to it.
    Returns bool [..., N]. Fewer than ``count`` valid entries: all valid ones.
    """
    n = scores.shape[-1]
    count = min(count, n)
    if count <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    keyed = scores.float().masked_fill(~valid, NEG)
    # stable sort: equal scores keep index order, so the lower block index wins a tie; an invalid entry
    # (-inf, index >= every valid one below it) never outranks a valid -inf one before it.
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[..., :count]
    picked = torch.zeros_like(keyed, dtype=torch.bool).scatter_(-1, order, True)
    return picked & valid


def forced_mask(tail: torch.Tensor, n_blocks: int, n_init: int, n_win: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (valid, forced) bool [R, N]. valid = complete blocks before the tail (the budget's
    candidates); forced = the n_init sink blocks and the n_win blocks right before the tail.

    tail: long [R], the block holding each row's current token."""
    j = torch.arange(n_blocks, device=tail.device)[None, :]
    valid = j < tail[:, None]
    forced = valid & ((j < n_init) | (j >= tail[:, None] - n_win))
    return valid, forced


def select_blocks(sq: torch.Tensor, se: torch.Tensor, tail: torch.Tensor, *, k: int, k_q: int, n_init: int, n_win: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5: Q_t = top (n_init + n_win + k_q) by the query score with sink/window forced; then S_t = top k
    by the query-agnostic score with Q_t forced. The tail block is not part of either (own slot).

    sq, se: [..., R, N] block scores (query-aware, query-agnostic); tail: long [R].
    Returns (selected, query_aware), bool [..., R, N].
    """
    valid, forced = forced_mask(tail, sq.shape[-1], n_init, n_win)
    q_score = sq.float().masked_fill(forced, POS)
    query_aware = top_mask(q_score, n_init + n_win + k_q, valid)
    e_score = se.float().masked_fill(query_aware, POS)
    return top_mask(e_score, k, valid), query_aware
