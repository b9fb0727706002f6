"""Query-agnostic per-token scores e_i (docs/peers.md 2(a) step 4): a trained eviction head or training-free
proxies, each *refreshed at block boundaries* so that the candidates' scores stay frozen inside a block
(condition (2) of the locality bound).

A refresh at position P (the prompt's end, then every position that starts a new block) sees the rows
before P only; tokens >= P get score 0 until the next refresh (they are in the tail or window blocks,
which are forced). Rows' attention probabilities are over the full cache, which the host holds.

Proxies (all summed over the GQA group of a KV head):
  trained      A_h * softplus(W_h . v_i): the eviction head of a NOSA checkpoint (ED-DMA: no exp before
               selection); the same value is the attention's additive logit bias. Needs the weights.
  snapkv       attention of the last OBS_WINDOW rows before P, summed, smoothed by a 1-D average pool
               of SMOOTH_KERNEL (APB's SnapKV baseline uses 5).
  h2o          accumulated attention of every row before P, divided by the number of rows that could
               see token i (P - i): de-biased toward early tokens.
  tova         attention of the last row before P (cheap, volatile).
  vnorm        ||v_i|| (the trained head is a function of v_i only; the closest training-free analogue).
  persistence  how often block(i) was in the query-aware set (sink + window + max(k_q, k/4) blocks by
               the query score) over the last `block` rows before P (Scissorhands-like).
  random       uniform noise drawn anew at each refresh: the control.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PROXIES = ("trained", "snapkv", "h2o", "tova", "vnorm", "persistence", "random")
TRAINING_FREE = PROXIES[1:]
OBS_WINDOW = 32
SMOOTH_KERNEL = 5


def check_proxy(name: str) -> None:
    if name not in PROXIES:
        raise ValueError(f"--proxy {name!r} is unknown; choose from {', '.join(PROXIES)}")


def trained_scores(v: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Eviction head (paper 004 §3.1, DMA without the final exp).

    v: [..., Hkv, T, D]; w: [Hkv, D]; a: [Hkv]. Returns float32 [..., Hkv, T].
    """
    return a.float()[:, None] * F.softplus(torch.einsum("...htd,hd->...ht", v.float(), w.float()))


def eviction_weights(module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The eviction head of an attention module, or None for a stock model.

    Protocol: a NOSA checkpoint's attention module carries ``eviction_w`` [Hkv, D] and ``eviction_a``
    [Hkv] (parameters or buffers).
    """
    w, a = getattr(module, "eviction_w", None), getattr(module, "eviction_a", None)
    if w is None or a is None:
        return None
    return w, a


def refresh_positions(start: int, stop: int, block: int) -> list[int]:
    """Where scores are recomputed: the prompt's end ``start``, then each block start in (start, stop)."""
    first = (start // block + 1) * block
    return [start, *range(first, stop, block)]


def _probs_rows(q_rows: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention probabilities summed over the group.

    q_rows: [Hkv, G, R, D] at positions pos [R]; k: [Hkv, T, D]. Returns float32 [Hkv, R, T].
    """
    logits = torch.einsum("hgrd,htd->hgrt", q_rows.float(), k.float()) * scale
    cols = torch.arange(k.shape[-2], device=k.device)
    logits = logits.masked_fill(cols[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(1)


def proxy_versions(
    name: str,
    *,
    k: torch.Tensor,
    v: torch.Tensor,
    rows_q: torch.Tensor,
    rows_pos: torch.Tensor,
    refresh: list[int],
    scale: float,
    colsum_before: torch.Tensor | None = None,
    rows_before: int = 0,
    eviction: tuple[torch.Tensor, torch.Tensor] | None = None,
    query_aware: torch.Tensor | None = None,
    block: int = 64,
    seed: int = 0,
) -> torch.Tensor:
    """Per-token scores at each refresh position, float32 [V, Hkv, T] (0 for tokens >= the refresh).

    k, v: [Hkv, T, D] the whole cache; rows_q: [Hkv, G, R, D] the rows the proxies may look at, at
    positions rows_pos [R] (increasing, contiguous, ending at T - 1). colsum_before: h2o only, [Hkv, T]
    column sums of the attention of the ``rows_before`` rows preceding rows_pos[0]. query_aware:
    persistence only, bool [Hkv, R, N] whether each block was in the row's query-aware set.
    """
    check_proxy(name)
    n = k.shape[-2]
    tokens = torch.arange(n, device=k.device)
    out = torch.zeros(len(refresh), k.shape[0], n, dtype=torch.float32, device=k.device)
    need_probs = name in ("snapkv", "h2o", "tova")
    probs = _probs_rows(rows_q, k, rows_pos, scale) if need_probs else None
    for i, p in enumerate(refresh):
        before = rows_pos < p  # rows a refresh at p may use
        if name == "trained":
            if eviction is None:
                raise ValueError("--proxy trained needs a NOSA checkpoint with an eviction head; this model has none")
            e = trained_scores(v, *eviction)
        elif name == "vnorm":
            e = v.float().norm(dim=-1)
        elif name == "random":
            gen = torch.Generator().manual_seed(seed * 1_000_003 + p)
            e = torch.rand(k.shape[0], n, generator=gen).to(k.device)
        elif name == "tova":
            last = int(before.nonzero().max())
            e = probs[:, last]
        elif name == "snapkv":
            idx = before.nonzero().flatten()[-OBS_WINDOW:]
            e = probs[:, idx].sum(1)
            e = F.avg_pool1d(e[:, None], SMOOTH_KERNEL, stride=1, padding=SMOOTH_KERNEL // 2, count_include_pad=False)[:, 0]
        elif name == "h2o":
            if colsum_before is None:
                raise ValueError("h2o needs the column sums of the prompt's attention")
            e = colsum_before + probs[:, before].sum(1)
            seen_by = (p - tokens).clamp(min=1).float()  # rows 0..p-1 that could see token i
            e = e / seen_by
        else:  # persistence
            if query_aware is None:
                raise ValueError("persistence needs the rows' query-aware block sets")
            idx = before.nonzero().flatten()[-block:]
            freq = query_aware[:, idx].float().mean(1)  # [Hkv, N]
            e = freq.repeat_interleave(block, dim=-1)[:, :n]
        out[i] = torch.where(tokens[None, :] < p, e.float(), torch.zeros((), device=k.device))
    return out


def h2o_column_sums(q: torch.Tensor, k: torch.Tensor, scale: float, *, chunk: int = 256) -> torch.Tensor:
    """Column sums of causal attention over all rows (summed over the group), streamed by row chunks.

    q: [Hkv, G, T, D]; k: [Hkv, T, D]. Returns float32 [Hkv, T]; no T x T matrix is held at once.
    """
    n = k.shape[-2]
    total = torch.zeros(k.shape[0], n, dtype=torch.float32, device=k.device)
    for start in range(0, q.shape[-2], chunk):
        pos = torch.arange(start, min(start + chunk, q.shape[-2]), device=k.device)
        total += _probs_rows(q[:, :, start : start + chunk], k, pos, scale).sum(1)
    return total


def h2o_debias(colsum: torch.Tensor, p: int) -> torch.Tensor:
    """h2o's score at a refresh at position p from the accumulated attention of the rows before p.

    colsum: [..., T] each token's attention summed over rows < p (and the GQA group). Returns float32
    [..., T]: colsum / (p - i), the number of rows 0..p-1 that could see token i; 0 for tokens >= p.
    """
    tokens = torch.arange(colsum.shape[-1], device=colsum.device)
    seen_by = (p - tokens).clamp(min=1).float()
    return torch.where(tokens < p, colsum.float() / seen_by, torch.zeros((), device=colsum.device))


def persistence_set_size(k: int, k_q: int, n_init: int, n_win: int) -> int:
    """Blocks in persistence's query-aware set: sink + window + max(k_q, k/4) by the query score (a
    set of at least k/4 blocks, so that k_q = 0 still leaves something to count)."""
    return n_init + n_win + max(k_q, k // 4)


def persistence_sets(sq: torch.Tensor, tail: torch.Tensor, *, k: int, k_q: int, n_init: int, n_win: int) -> torch.Tensor:
    """The query-aware set persistence counts, per row: sink and window forced, then the best blocks by
    the query score (ties by block index) up to ``persistence_set_size``.

    sq: [..., R, N] query block scores; tail: long [R] the block of each row's own token. Returns bool [..., R, N].
    """
    from .nosa_selection import POS, forced_mask, top_mask

    valid, forced = forced_mask(tail, sq.shape[-1], n_init, n_win)
    return top_mask(sq.float().masked_fill(forced, POS), persistence_set_size(k, k_q, n_init, n_win), valid)


def persistence_from_counts(counts: torch.Tensor, rows: int, n: int, p: int, block: int) -> torch.Tensor:
    """Persistence's per-token score: how often the token's block was in the query-aware set, over the
    ``rows`` rows counted (the last ``block`` rows before the refresh position p).

    counts: [..., N] per block. Returns float32 [..., n], 0 for tokens >= p.
    """
    freq = counts.float() / max(rows, 1)
    e = freq.repeat_interleave(block, dim=-1)[..., :n]
    e = F.pad(e, (0, n - e.shape[-1]))
    tokens = torch.arange(n, device=counts.device)
    return torch.where(tokens < p, e, torch.zeros((), device=counts.device))
