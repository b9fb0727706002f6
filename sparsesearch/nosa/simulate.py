"""One layer of teacher-forced NOSA decoding, all steps at once: selection, the sparse attention output
and every per-(KV head, step) measurement of docs/peers.md 2(a) steps 6-8.

Step t is the query at position T + t; it sees keys <= T + t. Its selection comes from its own query, so
running all S steps in one forward is exact for teacher forcing. Step 0 has no previous selection: its
blocks are the cold fill (``cold``), its gamma is NaN and it is excluded from steady-state averages.

Accounting (NOSI semantics): the GPU holds the k selected blocks plus the tail block (written on the GPU,
never fetched). ``miss`` = |S_t minus (S_t-1 and the previous tail)|, hit rate 1 - miss/k, H2D bytes
miss * block * d * 2 (K and V) * bytes per element; D2H one tail block when it completes.
gamma_raw = |S_t & S_t-1| / |S_t|; gamma_res also counts the previous tail as resident. The bound
gamma_raw >= (k - k_q)/k is checked at *stable* steps (same candidate blocks with the same
query-agnostic scores as at t-1: condition (2) of docs/peers.md "NOSA fine print"); steps where the
conditions fail are reported apart (``stable`` False), never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.nosa_config import NosaConfig
from ..runtime.nosa_proxies import proxy_versions, refresh_positions, trained_scores
from ..runtime.nosa_selection import agnostic_unit_scores, compress, forced_mask, pool_blocks, query_unit_scores, select_blocks, top_mask, unit_count


@dataclass
class LayerInputs:
    """One layer's tensors for S teacher-forced steps after a T-token prompt (one sequence).

    q: [Hkv, G, S, D] decode queries (positions T..T+S-1); k, v: [Hkv, T+S, D] the whole cache;
    hist_q: [Hkv, G, H, D] the last H prompt queries (positions T-H..T-1); colsum: [Hkv, T+S] h2o
    column sums of prompt rows 0..T-H-1 (None unless h2o runs); eviction: (w [Hkv, D], a [Hkv]) or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    hist_q: torch.Tensor
    scale: float
    colsum: torch.Tensor | None = None
    eviction: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def prompt(self) -> int:
        return self.k.shape[-2] - self.q.shape[-2]


def block_scores(x: LayerInputs, cfg: NosaConfig, seed: int = 0):
    """Query-aware and query-agnostic block scores of the decode steps.

    Returns (sq [Hkv, S, N], se [Hkv, S, N], tail long [S], version long [S], bias [Hkv, T+S] or None).
    """
    steps, total = x.q.shape[-2], x.k.shape[-2]
    n_blocks = -(-total // cfg.block)
    hist = x.hist_q.shape[-2]
    rows_q = torch.cat([x.hist_q, x.q], dim=-2)
    rows_pos = torch.arange(x.prompt - hist, total, device=x.k.device)
    n_units = unit_count(rows_pos + 1, cfg.kernel, cfg.stride)
    units = compress(x.k, cfg.kernel, cfg.stride)
    sq_all = pool_blocks(query_unit_scores(rows_q, units, n_units, x.scale), n_blocks, cfg.ratio)  # [Hkv, H+S, N]
    qa_all = None
    if cfg.proxy == "persistence":
        tails = torch.div(rows_pos, cfg.block, rounding_mode="floor")
        valid, forced = forced_mask(tails, n_blocks, cfg.n_init, cfg.n_win)
        count = cfg.n_init + cfg.n_win + max(cfg.k_q, cfg.k // 4)
        qa_all = top_mask(sq_all.masked_fill(forced, float("inf")), count, valid)
    refresh = refresh_positions(x.prompt, total, cfg.block)
    versions = proxy_versions(
        cfg.proxy, k=x.k, v=x.v, rows_q=rows_q, rows_pos=rows_pos, refresh=refresh, scale=x.scale,
        colsum_before=x.colsum, eviction=x.eviction, query_aware=qa_all, block=cfg.block, seed=seed,
    )  # [V, Hkv, T+S]
    pos = rows_pos[hist:]
    version = torch.searchsorted(torch.tensor(refresh, device=pos.device), pos, right=True) - 1
    e_rows = versions[version].transpose(0, 1)  # [Hkv, S, T+S]
    se = pool_blocks(agnostic_unit_scores(e_rows, n_units[hist:], cfg.kernel, cfg.stride), n_blocks, cfg.ratio)
    tail = torch.div(pos, cfg.block, rounding_mode="floor")
    # the trained head's score is also the attention's additive logit bias, for every cached token
    bias = trained_scores(x.v, *x.eviction) if x.eviction is not None else None
    return sq_all[:, hist:], se, tail, version, bias


def admitted_keys(selected: torch.Tensor, tail: torch.Tensor, pos: torch.Tensor, total: int, block: int) -> torch.Tensor:
    """Keys a step attends: its selected blocks plus its tail block up to its own position.

    selected: bool [Hkv, S, N]; tail, pos: long [S]. Returns bool [Hkv, S, total]."""
    key_block = torch.arange(total, device=pos.device) // block
    in_sel = selected[..., key_block]
    in_tail = (key_block[None, :] == tail[:, None]) & (torch.arange(total, device=pos.device)[None, :] <= pos[:, None])
    return in_sel | in_tail[None]


def attend(x: LayerInputs, keys: torch.Tensor, bias: torch.Tensor | None):
    """Dense and sparse attention of the decode steps.

    keys: bool [Hkv, S, T+S]. Returns (sparse out [Hkv, G, S, D], dense out, dense probs [Hkv, G, S, T+S]).
    """
    total = x.k.shape[-2]
    pos = torch.arange(x.prompt, total, device=x.k.device)
    logits = torch.einsum("hgsd,htd->hgst", x.q.float(), x.k.float()) * x.scale
    causal = torch.arange(total, device=x.k.device)[None, :] <= pos[:, None]
    dense_p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    sparse_logits = logits if bias is None else logits + bias[:, None, None, :]
    sparse_p = torch.softmax(sparse_logits.masked_fill(~keys[:, None], float("-inf")), dim=-1)
    v = x.v.float()[:, None]
    return sparse_p @ v, dense_p @ v, dense_p


def simulate_layer(x: LayerInputs, cfg: NosaConfig, *, bytes_per_elem: int = 2, seed: int = 0):
    """Select, attend and measure one layer. Returns (sparse output [Hkv, G, S, D] float32, metrics):
    metrics maps column name -> tensor [Hkv, S] (see the module docstring)."""
    sq, se, tail, version, bias = block_scores(x, cfg, seed)
    selected, query_aware = select_blocks(sq, se, tail, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
    total, steps = x.k.shape[-2], x.q.shape[-2]
    pos = torch.arange(x.prompt, total, device=x.k.device)
    keys = admitted_keys(selected, tail, pos, total, cfg.block)
    sparse_o, dense_o, dense_p = attend(x, keys, bias)
    recall = (dense_p * keys[:, None]).sum(-1).mean(1)
    err = ((sparse_o - dense_o).norm(dim=-1) / dense_o.norm(dim=-1).clamp_min(1e-30)).mean(1)
    metrics = {"recall": recall, "out_rel_err": err, **locality(selected, se, tail, cfg)}
    block_bytes = cfg.block * x.k.shape[-1] * 2 * bytes_per_elem
    metrics["h2d_bytes"] = metrics["miss"] * block_bytes
    metrics["d2h_bytes"] = metrics["tail_completed"].float() * block_bytes
    metrics["query_aware"] = (query_aware & ~forced_mask(tail, sq.shape[-1], cfg.n_init, cfg.n_win)[1]).sum(-1).float()
    metrics["layer_union_blocks"] = selected.any(0).sum(-1).float().expand(selected.shape[0], steps)
    metrics["proxy_version"] = version.float().expand(selected.shape[0], steps)
    return sparse_o, metrics


def locality(selected: torch.Tensor, se: torch.Tensor, tail: torch.Tensor, cfg: NosaConfig) -> dict:
    """gamma, misses, stability and the bound check per (KV head, step) from the selections.

    selected: bool [Hkv, S, N]; se: [Hkv, S, N] query-agnostic block scores; tail: long [S].
    """
    heads, steps, n_blocks = selected.shape
    size = selected.sum(-1).float()
    prev = torch.cat([torch.zeros_like(selected[:, :1]), selected[:, :-1]], dim=1)
    prev_tail = torch.cat([tail[:1] - 1, tail[:-1]])  # step 0: no previous tail (block -1 matches none)
    resident = prev | (torch.arange(n_blocks, device=tail.device)[None, None, :] == prev_tail[None, :, None])
    inter_raw = (selected & prev).sum(-1).float()
    inter_res = (selected & resident).sum(-1).float()
    valid, forced = forced_mask(tail, n_blocks, cfg.n_init, cfg.n_win)
    cand = valid & ~forced
    prev_cand = torch.cat([torch.zeros_like(cand[:1]), cand[:-1]])
    prev_se = torch.cat([se[:, :1], se[:, :-1]], dim=1)
    same_scores = ((se == prev_se) | ~cand[None]).all(-1)
    first = torch.zeros(steps, dtype=torch.bool, device=tail.device)
    first[0] = True
    stable = same_scores & (cand == prev_cand).all(-1)[None] & ~first[None]
    nan = torch.full_like(size, float("nan"))
    gamma_raw = torch.where(first[None], nan, inter_raw / size.clamp_min(1))
    gamma_res = torch.where(first[None], nan, inter_res / size.clamp_min(1))
    holds = inter_raw * cfg.k >= (cfg.k - cfg.k_q) * size  # exact in integers: gamma_raw >= (k - k_q)/k
    holds_res = inter_res * cfg.k >= (cfg.k - cfg.k_q) * size
    miss = torch.where(first[None], size, size - inter_res)
    return {
        "selected": size, "gamma_raw": gamma_raw, "gamma_res": gamma_res, "stable": stable.float(),
        "bound_holds": torch.where(first[None], nan, holds.float()), "bound_holds_res": torch.where(first[None], nan, holds_res.float()),
        "violation": (stable & ~holds).float(), "miss": miss, "hit_rate": torch.where(first[None], nan, 1 - miss / cfg.k),
        "cold": first[None].expand(heads, steps).float(), "tail_completed": torch.cat([first[:1] & False, tail[1:] != tail[:-1]]).expand(heads, steps),
    }
