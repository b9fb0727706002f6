"""Offloaded NOSA decode (paper 004 §3.2, NOSI): the full KV cache in host memory (pinned where a GPU
exists), k block slots per (layer, sequence, KV head) plus the tail block on the device, missed blocks
fetched by set difference of the slot map, decode attention over the slots only.

Use::

    engine = enable_nosa(model, artifact)              # registers the attention function (AttentionInterface)
    cache = engine.new_cache(max_new_tokens=64)        # a transformers Cache: generate() needs no patching
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)
    print(cache.memory_report())                       # device vs host bytes, H2D/D2H traffic
    disable_nosa(model)

Prefill runs dense attention (SDPA) and fills the host store, one row per sequence in its own coordinates
(left padding stripped, so sink and blocks are the sequence's own); each decode step, per global layer,
batched over sequences and KV heads: compressed keys grow by one unit every ``stride`` tokens, the
query-agnostic scores are recomputed when a sequence starts a new block, the selection (runtime.nosa_selection)
picks k blocks, the slot map keeps the blocks still selected, and only the others are copied in
(kernels/gather.py; the previous tail block moves from the tail slot, never from the host).
Sliding-window layers of hybrid models keep transformers' own cache path (dense over their window).

Two decoders (``decoder=`` of ``enable_nosa``; docs/nosa.md "Which decoder serves generate()"): ``SlotLayer``
runs a ``device.SlotDecoder`` per global layer, batched over sequences and KV heads (the fused Triton
step on a GPU), for trained, vnorm and random; ``OffloadedLayer``, described below, runs every proxy with
per-sequence torch code and is the reference. ``auto`` takes the slot decoder on a GPU where it can.

Query-agnostic proxies (runtime/nosa_proxies.py defines them for the sweep) are recomputed only at a sequence's
refresh positions P (the prompt's end, then each new block's first token) and frozen in between, so the
locality bound holds at every stable step. Every proxy of ``proxies.PROXIES`` runs here:

* trained, vnorm, random: functions of the token (and the refresh) alone, as in the sweep.
* snapkv, tova: re-score every key at P from the ring of the last max(OBS_WINDOW, block) queries (dense
  attention over the host store's whole history, once per block), as in the sweep.
* h2o: the sweep accumulates every row's *dense* attention; a decode step here attends only its resident
  blocks and the tail, so the engine's reading is: prompt rows contribute their dense attention (the
  prefill has every key: one streamed pass over the prompt, ``proxies.h2o_column_sums``), each decode row
  contributes the attention it actually computed (0 for the keys it did not attend), accumulated on the
  device every step into ``colsum`` [B, Hkv, capacity]; at P the score is colsum / (P - i), the number of
  rows that could see token i, exactly the sweep's de-biasing. Non-resident tokens therefore lose mass
  relative to the sweep (H2O's own accumulate-over-what-is-kept behaviour); with a budget that covers the
  context the two are equal.
* persistence: the same as the sweep's. Each decode step's persistence set (sink + window +
  max(k_q, k/4) blocks by the step's query score, ``proxies.persistence_sets``; the selection's own
  query-aware set when k_q >= k/4) is written as block ids into a ring ``qa_ring`` [B, Hkv, block, set
  size] at slot position % block on the device; the prompt's last ``block`` rows are filled at prefill
  from the query ring. At P the ring holds exactly rows P - block .. P - 1, and the score of token i is
  the fraction of those rows whose set held block(i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels._common import interpreting
from .nosa_config import NosaConfig
from .nosa_proxies import (
    OBS_WINDOW,
    PROXIES,
    eviction_weights,
    h2o_column_sums,
    h2o_debias,
    persistence_from_counts,
    persistence_set_size,
    persistence_sets,
    proxy_versions,
    trained_scores,
)
from .nosa_selection import agnostic_unit_scores, pool_blocks, query_unit_scores, select_blocks, unit_count

ATTN_NAME = "sparsesearch_nosa"
_ENGINE = "_sparsesearch_nosa_engine"
ENGINE_PROXIES = PROXIES  # every proxy the sweep measures runs here (the module docstring gives the readings)
H2O_CHUNK_BYTES = 1 << 28  # prefill's h2o column sums hold one [Hq, chunk, T] float32 block of rows at a time


def _pinned(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    """Host memory for the store: pinned when a GPU will read it through UVA, plain on a CPU-only run."""
    pin = like.is_cuda
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class DecodeLayer:
    """The transformers cache-layer protocol both decoders share (``runtime.offload_cache`` adds
    CacheLayerMixin): prefill K/V are returned as they are (the attention function hands them to
    ``prefill`` with the padding it sees); a decode token goes to ``_append`` once the layer is ``filled``,
    and the attention function then calls ``decode``. ``seen`` counts padded positions, for masks."""

    def __init__(self, cfg: NosaConfig, seed: int = 0):
        self.keys = self.values = None
        self.is_initialized = False
        self.cfg, self.seed = cfg, seed
        self.seen = 0
        self.steps = 0
        self.eviction = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        if key_states.shape[-2] == 1 and self.filled:
            self._append(key_states[:, :, 0], value_states[:, :, 0])
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1


class OffloadedLayer(DecodeLayer):
    """One global layer's offloaded cache, decoded by per-sequence torch code (every proxy). Host:
    keys/values [B, Hkv, capacity, D] (each sequence from its own first token), per-token query-agnostic
    scores [B, Hkv, capacity]. Device: slots [B, Hkv, k, block, D], slot map [B, Hkv, k] (block id or -1),
    tail block [B, Hkv, block, D], compressed keys [B, Hkv, M, D]; h2o: accumulated attention ``colsum``
    [B, Hkv, capacity]; persistence: ``qa_ring`` [B, Hkv, block, set size] of block ids (-1 empty)."""

    def __init__(self, cfg: NosaConfig, seed: int = 0):
        super().__init__(cfg, seed)
        self.h2d_bytes = self.d2h_bytes = self.moved_blocks = 0
        self.last_selected = None
        self.colsum = self.qa_ring = None

    @property
    def filled(self) -> bool:
        return hasattr(self, "keys_host")

    # ------------------------------------------------------------------------------------------ storage

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, starts: torch.Tensor, scale: float) -> None:
        """Store a dense prefill: keys/values [B, Hkv, N, D], queries [B, Hq, N, D]; starts: long [B] the
        first real token of each (left-padded) sequence."""
        batch, kv_heads, n, dim = keys.shape
        cfg = self.cfg
        self.scale, self.kv_heads, self.group = scale, kv_heads, queries.shape[1] // kv_heads
        self.lengths = (n - starts).to(keys.device)
        capacity = _whole_blocks(max(2 * n, n + 256), cfg.block)
        self.keys_host = _pinned((batch, kv_heads, capacity, dim), keys.dtype, keys)
        self.values_host = _pinned((batch, kv_heads, capacity, dim), keys.dtype, keys)
        hist = max(OBS_WINDOW, cfg.block)
        self.queries = torch.zeros(batch, queries.shape[1], hist, dim, dtype=torch.float32, device=keys.device)  # ring of recent queries
        if cfg.proxy == "h2o":
            self.colsum = torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=keys.device)
        for b in range(batch):  # once per prompt, not per step: strip each sequence's padding
            real = n - int(starts[b])
            self.keys_host[b, :, :real] = keys[b, :, int(starts[b]):].cpu()
            self.values_host[b, :, :real] = values[b, :, int(starts[b]):].cpu()
            take = min(real, hist)
            self.queries[b, :, hist - take:] = queries[b, :, n - take:].float()
            if self.colsum is not None:  # the prompt rows' dense attention: the prefill has every key
                q_b = queries[b, :, int(starts[b]):].reshape(kv_heads, self.group, real, dim)
                chunk = max(1, min(256, H2O_CHUNK_BYTES // (4 * queries.shape[1] * real)))
                self.colsum[b, :, :real] = h2o_column_sums(q_b, keys[b, :, int(starts[b]):], scale, chunk=chunk)
        self.slots_k = torch.zeros(batch, kv_heads, cfg.k, cfg.block, dim, dtype=keys.dtype, device=keys.device)
        self.slots_v = torch.zeros_like(self.slots_k)
        self.slot_map = torch.full((batch, kv_heads, cfg.k), -1, dtype=torch.long, device=keys.device)
        self.tail_k = torch.zeros(batch, kv_heads, cfg.block, dim, dtype=keys.dtype, device=keys.device)
        self.tail_v = torch.zeros_like(self.tail_k)
        for b in range(batch):
            self._load_tail(b)
        self.scores = torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=keys.device)
        self.units = torch.zeros(batch, kv_heads, unit_count(capacity, cfg.kernel, cfg.stride), dim, dtype=torch.float32, device=keys.device)
        self.n_units = torch.zeros(batch, dtype=torch.long, device=keys.device)
        self._grow_units()
        if cfg.proxy == "persistence":
            size = persistence_set_size(cfg.k, cfg.k_q, cfg.n_init, cfg.n_win)
            self.qa_ring = torch.full((batch, kv_heads, cfg.block, size), -1, dtype=torch.long, device=keys.device)
            for b in range(batch):
                self._remember_prompt_sets(b)
        self.pending_tail_move = torch.zeros(batch, dtype=torch.bool, device=keys.device)
        self.old_tail_k, self.old_tail_v = self.tail_k, self.tail_v
        for b in range(batch):
            self._refresh(b, n - int(starts[b]))

    def _remember_prompt_sets(self, b: int) -> None:
        """Persistence: the query-aware sets of sequence b's last ``block`` prompt rows (from the query
        ring, each row with the compressed keys and tail of its own position) into ``qa_ring``."""
        cfg = self.cfg
        n = int(self.lengths[b])
        rows = min(n, cfg.block)
        hist = self.queries.shape[2]
        q = self.queries[b, :, hist - rows :].reshape(self.kv_heads, self.group, rows, -1)
        pos = torch.arange(n - rows, n, device=q.device)
        unit_scores = query_unit_scores(q, self.units[b], unit_count(pos + 1, cfg.kernel, cfg.stride), self.scale)
        sq = pool_blocks(unit_scores, -(-n // cfg.block), cfg.ratio)  # [Hkv, rows, N]
        sets = persistence_sets(sq, torch.div(pos, cfg.block, rounding_mode="floor"), k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
        self.qa_ring[b, :, pos % cfg.block] = _set_ids(sets, self.qa_ring.shape[-1])

    def _load_tail(self, b: int) -> None:
        """The tail slot of sequence b from the host (prefill only: afterwards it is written on the device)."""
        last = int(self.lengths[b]) - 1
        start = last // self.cfg.block * self.cfg.block
        self.tail_k[b].zero_()
        self.tail_v[b].zero_()
        self.tail_k[b, :, : last - start + 1] = self.keys_host[b, :, start : last + 1].to(self.tail_k.device)
        self.tail_v[b, :, : last - start + 1] = self.values_host[b, :, start : last + 1].to(self.tail_v.device)

    def _ensure_capacity(self, need: int) -> None:
        cap = self.keys_host.shape[2]
        if need <= cap:
            return
        new = _whole_blocks(max(need, 2 * cap), self.cfg.block)
        for name in ("keys_host", "values_host"):
            old = getattr(self, name)
            grown = _pinned((*old.shape[:2], new, old.shape[-1]), old.dtype, self.slots_k)
            grown[:, :, :cap] = old
            setattr(self, name, grown)
        self.scores = _grown(self.scores, new)
        if self.colsum is not None:
            self.colsum = _grown(self.colsum, new)
        units = torch.zeros(*self.units.shape[:2], unit_count(new, self.cfg.kernel, self.cfg.stride), self.units.shape[-1], device=self.units.device)
        units[:, :, : self.units.shape[2]] = self.units
        self.units = units

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, D], the new token of every sequence: host store (the full cache) and tail slot."""
        batch = k.shape[0]
        self._ensure_capacity(int(self.lengths.max()) + 1)
        pos = self.lengths.clone()
        rows = torch.arange(batch, device=k.device)
        self.keys_host[rows.cpu(), :, pos.cpu()] = k.cpu()
        self.values_host[rows.cpu(), :, pos.cpu()] = v.cpu()
        self.lengths = self.lengths + 1
        new_block = pos % self.cfg.block == 0
        self.pending_tail_move = new_block  # the old tail is complete: it moves to a slot at selection time
        self.old_tail_k, self.old_tail_v = self.tail_k.clone(), self.tail_v.clone()
        self.d2h_bytes += k.numel() * 2 * k.element_size()  # each new token's K and V go to the host store
        self.tail_k[new_block] = 0
        self.tail_v[new_block] = 0
        off = pos % self.cfg.block
        self.tail_k[rows, :, off] = k
        self.tail_v[rows, :, off] = v
        self._grow_units()

    def _grow_units(self) -> None:
        """One compressed key per (kernel, stride) window that has become complete."""
        cfg = self.cfg
        target = unit_count(self.lengths, cfg.kernel, cfg.stride)
        for b in (target > self.n_units).nonzero().flatten().tolist():  # at most every `stride` steps per sequence
            for m in range(int(self.n_units[b]), int(target[b])):
                window = self.keys_host[b, :, m * cfg.stride : m * cfg.stride + cfg.kernel].float()
                self.units[b, :, m] = window.mean(1).to(self.units.device)
        self.n_units = target

    def _refresh(self, b: int, p: int) -> None:
        """Recompute sequence b's per-token query-agnostic scores at position p (the prompt's end, then each
        new block's first token) from the rows before p: the query ring holds positions p - hist .. p - 1;
        h2o's accumulated attention and persistence's set ring hold what rows < p contributed."""
        cfg = self.cfg
        n = int(self.lengths[b])
        if cfg.proxy in ("h2o", "persistence"):  # device state only: no host read
            self.scores[b].zero_()
            self.scores[b, :, :n] = h2o_debias(self.colsum[b, :, :n], p) if cfg.proxy == "h2o" else self._persistence(b, n, p)
            return
        k = self.keys_host[b, :, :n].to(self.units.device)
        v = self.values_host[b, :, :n].to(self.units.device)
        hist = self.queries.shape[2]
        rows_q = self.queries[b].reshape(self.kv_heads, self.group, hist, -1)
        rows_pos = torch.arange(p - hist, p, device=k.device)
        keep = rows_pos >= 0
        scores = proxy_versions(cfg.proxy, k=k, v=v, rows_q=rows_q[:, :, keep], rows_pos=rows_pos[keep], refresh=[p],
                                scale=self.scale, eviction=self.eviction, block=cfg.block, seed=self.seed)
        self.scores[b].zero_()
        self.scores[b, :, :n] = scores[0]

    def _persistence(self, b: int, n: int, p: int) -> torch.Tensor:
        """Sequence b's persistence scores at p from the set ring (rows p - block .. p - 1), [Hkv, n]."""
        block = self.cfg.block
        ids = self.qa_ring[b].flatten(1) + 1  # [Hkv, block * size]; -1 (empty) lands in column 0
        counts = torch.zeros(self.kv_heads, -(-n // block) + 1, device=ids.device).scatter_add_(-1, ids, torch.ones_like(ids, dtype=torch.float32))
        return persistence_from_counts(counts[:, 1:], min(p, block), n, p, block)

    # ------------------------------------------------------------------------------------------- decode

    def decode(self, query: torch.Tensor) -> torch.Tensor:
        """query: [B, Hq, 1, D] of the token just appended. Returns [B, 1, Hq, D]."""
        cfg = self.cfg
        batch, heads, _, dim = query.shape
        last = self.lengths - 1
        for b in self.pending_tail_move.nonzero().flatten().tolist():  # a new block: scores change only here
            self._refresh(b, int(last[b]))
        selected = self.select(query, last)
        self._map_slots(selected, last)
        self.queries = torch.cat([self.queries[:, :, 1:], query.float()], dim=2)  # the ring's newest row: this step
        self.steps += 1
        probs = self.attention_probs(query, last)
        if self.colsum is not None:  # h2o: this row's attention over what it attended (0 elsewhere)
            self.colsum.scatter_add_(-1, self._slot_tokens(last), probs.sum(2))
        return self.attend(probs, query)

    def select(self, query: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Eq. 5 for every (sequence, KV head): bool [B, Hkv, N]."""
        cfg = self.cfg
        n_blocks = -(-int(self.lengths.max()) // cfg.block)
        q = query.reshape(query.shape[0], self.kv_heads, self.group, 1, query.shape[-1])
        n_units = self.n_units[:, None]  # [B, R=1]
        sq = pool_blocks(query_unit_scores(q, self.units, n_units, self.scale)[:, :, 0], n_blocks, cfg.ratio)  # [B, Hkv, N]
        cap = self.scores.shape[-1]
        se = pool_blocks(agnostic_unit_scores(self.scores[:, :, None, :cap], n_units, cfg.kernel, cfg.stride)[:, :, 0], n_blocks, cfg.ratio)
        tail = torch.div(last, cfg.block, rounding_mode="floor")
        # select_blocks takes rows as its second-to-last dim: sequences are the rows, KV heads lead
        sel, query_aware = select_blocks(sq.transpose(0, 1), se.transpose(0, 1), tail, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
        if self.qa_ring is not None:  # persistence: this row's set, at slot position % block
            sets = query_aware if cfg.k_q >= cfg.k // 4 else persistence_sets(  # the same set when k_q >= k/4
                sq.transpose(0, 1), tail, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
            self.qa_ring[torch.arange(sets.shape[1], device=sets.device), :, last % cfg.block] = _set_ids(sets.transpose(0, 1), self.qa_ring.shape[-1])
        self.last_selected = sel.transpose(0, 1)
        return self.last_selected

    def _map_slots(self, selected: torch.Tensor, last: torch.Tensor) -> None:
        """Slot map by set difference: slots whose block stays selected keep it; the newly selected blocks
        take the freed slots in block order; the previous tail block comes from the tail slot, others from
        the host store."""
        cfg = self.cfg
        batch, kv_heads, n_blocks = selected.shape
        in_slot = self.slot_map >= 0
        keep = in_slot & selected.gather(-1, self.slot_map.clamp(min=0))
        resident = torch.zeros(selected.shape, dtype=torch.int32, device=selected.device).scatter_add_(-1, self.slot_map.clamp(min=0), keep.int()) > 0
        missing = selected & ~resident
        # i-th missing block (block order) -> i-th free slot (slot order)
        free = ~keep
        miss_order = torch.sort((~missing).to(torch.int8), dim=-1, stable=True).indices  # missing block ids first
        free_order = torch.sort((~free).to(torch.int8), dim=-1, stable=True).indices  # free slot ids first
        n_miss = missing.sum(-1)
        rank = torch.arange(cfg.k, device=selected.device)
        take = rank[None, None, :] < n_miss[..., None]  # [B, Hkv, k]
        blocks = miss_order[..., : cfg.k]
        slots = free_order
        new_map = torch.where(keep, self.slot_map, torch.full_like(self.slot_map, -1))
        b_idx, h_idx, r_idx = take.nonzero(as_tuple=True)
        blk, slt = blocks[b_idx, h_idx, r_idx], slots[b_idx, h_idx, r_idx]
        new_map[b_idx, h_idx, slt] = blk
        prev_tail = torch.div(last - 1, cfg.block, rounding_mode="floor")
        from_tail = self.pending_tail_move[b_idx] & (blk == prev_tail[b_idx])
        t = from_tail
        self.slots_k[b_idx[t], h_idx[t], slt[t]] = self.old_tail_k[b_idx[t], h_idx[t]]
        self.slots_v[b_idx[t], h_idx[t], slt[t]] = self.old_tail_v[b_idx[t], h_idx[t]]
        h = ~from_tail
        _gather(self, b_idx[h], h_idx[h], blk[h], slt[h])
        self.h2d_bytes += int(h.sum()) * cfg.block * self.slots_k.shape[-1] * 2 * self.slots_k.element_size()
        self.moved_blocks += int(t.sum())
        self.slot_map = new_map
        self.pending_tail_move = torch.zeros_like(self.pending_tail_move)

    def attention_probs(self, query: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Decode attention probabilities over the k slots and the tail slot (eviction bias added when the
        head exists): query [B, Hq, 1, D] -> float32 [B, Hkv, G, (k+1)*block], 0 on empty slots and on
        tail positions after the token."""
        cfg = self.cfg
        batch, heads, _, dim = query.shape
        keys = torch.cat([self.slots_k.flatten(2, 3), self.tail_k], dim=2).float()  # [B, Hkv, (k+1)*block, D]
        offs = torch.arange(cfg.block, device=query.device)
        slot_ok = (self.slot_map >= 0)[..., None].expand(-1, -1, -1, cfg.block).flatten(2)
        tail_ok = (offs[None, :] <= (last % cfg.block)[:, None])[:, None].expand(-1, self.kv_heads, -1)
        ok = torch.cat([slot_ok, tail_ok], dim=2)  # [B, Hkv, (k+1)*block]
        q = query.reshape(batch, self.kv_heads, self.group, dim).float()
        logits = torch.einsum("bhgd,bhtd->bhgt", q, keys) * self.scale
        if self.eviction is not None:
            logits = logits + self._bias(last)[:, :, None]
        return torch.softmax(logits.masked_fill(~ok[:, :, None], float("-inf")), dim=-1)

    def attend(self, probs: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """probs [B, Hkv, G, (k+1)*block] (``attention_probs``) over the slots' and tail's values -> [B, 1, Hq, D]."""
        batch, heads, _, dim = query.shape
        values = torch.cat([self.slots_v.flatten(2, 3), self.tail_v], dim=2).float()
        out = torch.einsum("bhgt,bhtd->bhgd", probs, values)
        return out.reshape(batch, heads, dim)[:, None].to(query.dtype)

    def _slot_tokens(self, last: torch.Tensor) -> torch.Tensor:
        """The position of the token each slot key holds, long [B, Hkv, (k+1)*block] (slots, then the tail
        block; an empty slot reads as block 0, and its probability is 0)."""
        cfg = self.cfg
        offs = torch.arange(cfg.block, device=last.device)
        tokens = (self.slot_map.clamp(min=0)[..., None] * cfg.block + offs).flatten(2)
        tail_tokens = (torch.div(last, cfg.block, rounding_mode="floor") * cfg.block)[:, None, None] + offs
        return torch.cat([tokens, tail_tokens.expand(-1, self.kv_heads, -1)], dim=2)

    def _bias(self, last: torch.Tensor) -> torch.Tensor:
        """Per slot key: the trained score of the token it holds (the additive logit bias), [B, Hkv, (k+1)*block]."""
        cap = self.keys_host.shape[2]
        v = self.values_host[:, :, :cap].to(self.slots_v.device)
        bias = trained_scores(v, *self.eviction)  # [B, Hkv, cap]
        return bias.gather(-1, self._slot_tokens(last).clamp(max=cap - 1))

    def memory(self) -> dict:
        """Bytes held on the device (slots, tail, map, compressed keys, scores) and on the host (full KV)."""
        state = [t for t in (self.colsum, self.qa_ring) if t is not None]
        device = sum(t.numel() * t.element_size() for t in (self.slots_k, self.slots_v, self.tail_k, self.tail_v, self.slot_map, self.units, self.scores, self.queries, *state))
        host = sum(t.numel() * t.element_size() for t in (self.keys_host, self.values_host))
        used = int(self.lengths.sum()) * self.kv_heads * self.keys_host.shape[-1] * 2 * self.keys_host.element_size()
        return {"device_bytes": device, "host_bytes": host, "host_bytes_used": used, "h2d_bytes": self.h2d_bytes,
                "d2h_bytes": self.d2h_bytes, "blocks_moved_from_tail": self.moved_blocks, "steps": self.steps}


def _grown(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """A per-token float32 state [B, Hkv, capacity] grown to ``tokens`` (zeros after the old capacity)."""
    out = torch.zeros(*x.shape[:2], tokens, dtype=x.dtype, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def _set_ids(sets: torch.Tensor, size: int) -> torch.Tensor:
    """A block set as its ids: bool [..., N] with at most ``size`` members -> long [..., size], members in
    block order, -1 after them."""
    if sets.shape[-1] < size:
        sets = torch.nn.functional.pad(sets, (0, size - sets.shape[-1]))
    order = torch.sort((~sets).to(torch.int8), dim=-1, stable=True).indices[..., :size]  # members first
    return torch.where(sets.gather(-1, order), order, -1)


def _whole_blocks(tokens: int, block: int) -> int:
    """A host store's capacity in tokens, rounded up to whole blocks (the gather addresses blocks as rows)."""
    return -(-tokens // block) * block


def _gather(layer: OffloadedLayer, b, h, blocks, slots) -> None:
    """Missed blocks from the host store into their slots: kernels/gather.py (through UVA from pinned memory
    on a GPU; torch indexing, or the kernel under TRITON_INTERPRET=1, on a CPU). The store [B, Hkv, capacity,
    D] is read as rows of one block, [B·Hkv·capacity/block, block, D]; the slots [B, Hkv, k, block, D] as
    [B·Hkv·k, block, D]. b, h, blocks, slots: long [n]."""
    from ..kernels.gather import gather_blocks

    batch, kv_heads, capacity, dim = layer.keys_host.shape
    k, block = layer.slots_k.shape[2], layer.slots_k.shape[3]
    device = layer.slots_k.device
    pair = b.to(device) * kv_heads + h.to(device)
    rows = pair * (capacity // block) + blocks.to(device)
    dst = pair * k + slots.to(device)
    for store, slot in ((layer.keys_host, layer.slots_k), (layer.values_host, layer.slots_v)):
        gather_blocks(store.view(-1, block, dim), rows, slot.view(-1, block, dim), dst)


def right_aligned(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Left-padded x [B, H, N, D] with each sequence's first real token at starts[b] -> each sequence from
    its first token, zeros after its length (the SlotDecoder's right-padded prompt), [B, H, N, D]."""
    n = x.shape[2]
    idx = torch.arange(n, device=x.device)[None] + starts.to(x.device)[:, None]  # [B, N]
    out = x.gather(2, idx.clamp(max=n - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
    return out.masked_fill((idx >= n)[:, None, :, None], 0)


class SlotLayer(DecodeLayer):
    """One global layer decoded by a ``device.SlotDecoder`` batched over sequences and KV heads (proxies
    trained, vnorm, random): on a GPU the fused Triton step (append, selection + slot map, slot attention
    that reads missed blocks from pinned memory), with no per-sequence Python after the prefill.

    Capacity: the decoder's host store holds the longest prompt plus ``max_new_tokens`` (the hint given to
    ``new_cache``; DEFAULT_HEADROOM without one) and is re-allocated at twice its size when a generation
    outruns it (``SlotDecoder.grow``: one host copy of the store, rare). ``shared`` is a dict the cache's
    slot layers share: the fused kernels' scratch, made by the first layer of each capacity (a step's
    scratch is consumed within the layer's step, so ``last_selected`` is the layer's own only until the
    next layer steps when the scratch is shared)."""

    def __init__(self, cfg: NosaConfig, seed: int = 0, *, fused: bool | None = None, max_new_tokens: int | None = None, shared: dict | None = None):
        """fused: the Triton step; None: on a GPU where the shape allows it (``_fusable``), else the torch step."""
        super().__init__(cfg, seed)
        self.fused, self.max_new_tokens = fused, max_new_tokens
        self.shared = {} if shared is None else shared
        self.decoder = None
        self.pending = None
        self.grown = 0  # re-allocations of the host store

    @property
    def filled(self) -> bool:
        return self.decoder is not None

    @property
    def lengths(self) -> torch.Tensor:
        return self.decoder.lengths

    @property
    def last_selected(self) -> torch.Tensor:
        """bool [B, Hkv, n_blocks] of the last step (the tail block excluded)."""
        return self.decoder.last_selected

    @property
    def slot_map(self) -> torch.Tensor:
        return self.decoder.slot_map

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, starts: torch.Tensor, scale: float) -> None:
        """keys/values [B, Hkv, N, D], queries [B, Hq, N, D] (only their head count is read: the device
        proxies do not look at queries); starts long [B]: the first real token of each left-padded sequence."""
        from .nosa_device import SlotDecoder

        batch, kv_heads, n, dim = keys.shape
        self.kv_heads, self.group, self.scale = kv_heads, queries.shape[1] // kv_heads, scale
        lengths = (n - starts).to(keys.device)
        capacity = int(lengths.max()) + (DEFAULT_HEADROOM if self.max_new_tokens is None else self.max_new_tokens) + 1
        fused = keys.is_cuda and _fusable(self.cfg, dim) if self.fused is None else self.fused
        if fused and not keys.is_cuda and not interpreting():
            raise ValueError("fused=True runs Triton kernels: the model must be on a GPU (or TRITON_INTERPRET=1 set)")
        eviction = None if self.eviction is None else tuple(t.detach().float() for t in self.eviction)  # scores in fp32, as the torch decoder
        dec = SlotDecoder(self.cfg, batch=batch, kv_heads=kv_heads, group=self.group, dim=dim, capacity=capacity, dtype=keys.dtype,
                          device=keys.device, eviction=eviction, seed=self.seed, fused=fused,
                          scratch=self.shared.get(("select", _whole_blocks(capacity, self.cfg.block))) if fused else None,
                          attend_scratch=self.shared.get("attend") if fused else None,
                          scale=scale)  # the model's own scaling (Gemma's query_pre_attn_scalar), not dim ** -0.5
        self._share(dec)
        dec.prefill(right_aligned(keys, starts), right_aligned(values, starts), lengths)
        self.decoder = dec

    def _share(self, dec) -> None:
        if dec.fused:
            self.shared[("select", dec.capacity)] = dec.scratch
            if dec.attention == "triton":
                self.shared["attend"] = dec.attend_scratch

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, Hkv, D], the new token; the decoder appends it inside its step (``decode``)."""
        dec = self.decoder
        if max(dec.host_lengths) >= dec.capacity:  # host-side lengths: no sync
            capacity = 2 * dec.capacity
            dec.grow(capacity, self.shared.get(("select", capacity)) if dec.fused else None)
            self._share(dec)
            self.grown += 1
        self.pending = (k, v)

    def decode(self, query: torch.Tensor) -> torch.Tensor:
        """query: [B, Hq, 1, D] of the token ``_append`` received. Returns [B, 1, Hq, D]."""
        k, v = self.pending
        self.pending = None
        self.steps += 1
        return self.decoder.step(query[:, :, 0], k, v)[:, None]

    def memory(self) -> dict:
        """The engine's accounting from the decoder: device vs host bytes, H2D from its ``fetched`` counter
        (whole blocks, K and V), D2H the new tokens; ``dropped_blocks`` (misses past the fetch list) must be 0."""
        dec = self.decoder
        fetched, dropped = (int(x) for x in dec.counters.tolist())
        token = self.kv_heads * dec.dim * 2 * dec.keys_host.element_size()  # K and V of one token, every KV head
        block = self.cfg.block * dec.dim * 2 * dec.keys_host.element_size()  # K and V of one block, one KV head
        return dec.memory() | {"host_bytes_used": int(self.lengths.sum()) * token, "h2d_bytes": fetched * block,
                               "d2h_bytes": self.steps * dec.batch * token, "blocks_moved_from_tail": 0, "steps": self.steps,
                               "fetched_blocks": fetched, "dropped_blocks": dropped, "store_regrowths": self.grown}


def _fusable(cfg: NosaConfig, dim: int) -> bool:
    """Whether the fused Triton step serves this shape: none of its three kernels refuses it (each kernel
    module states its own limits); otherwise the slot decoder's torch step."""
    from ..kernels import nosa_append, nosa_attend, nosa_select

    refusals = (nosa_append.shape_refusal(dim, cfg.kernel), nosa_attend.shape_refusal(cfg.block),
                nosa_select.shape_refusal(dim, cfg.block, cfg.stride))
    return all(why is None for why in refusals)


DECODERS = ("auto", "slot", "torch")
DEFAULT_HEADROOM = 256  # decode tokens a slot layer's store holds beyond the prompt without a max_new_tokens hint


def resolve_decoder(decoder: str, proxy: str, device: torch.device) -> str:
    """``auto``: the slot decoder on a GPU for the proxies it serves (``device.DEVICE_PROXIES``), the torch
    decoder otherwise (snapkv, tova, h2o, persistence need the history or the attention at a refresh; on a
    CPU the torch decoder is the reference). Returns ``slot`` or ``torch``; ValueError names a bad value."""
    from .nosa_device import DEVICE_PROXIES

    if decoder not in DECODERS:
        raise ValueError(f"decoder {decoder!r} is unknown; choose one of {', '.join(DECODERS)}")
    if decoder == "slot" and proxy not in DEVICE_PROXIES:
        raise ValueError(f"decoder 'slot' serves proxies {', '.join(DEVICE_PROXIES)}, not {proxy!r}; use decoder 'torch' or 'auto'")
    if decoder == "auto":
        return "slot" if proxy in DEVICE_PROXIES and torch.device(device).type == "cuda" else "torch"
    return decoder


@dataclass
class NosaEngine:
    cfg: NosaConfig
    layers: frozenset[int]
    num_layers: int
    eviction: dict
    seed: int = 0
    active: object = None
    decoder: str = "torch"  # resolved: "slot" or "torch" (``resolve_decoder``)
    fused: bool | None = None  # slot decoder: the Triton step (None: on a GPU)

    def new_cache(self, max_new_tokens: int | None = None):
        """A fresh ``runtime.offload_cache.NosaCache`` (a transformers Cache) for one ``generate`` call.
        max_new_tokens: the slot decoder's store is sized for the prompt plus this many tokens (it grows
        past them by re-allocation); the torch decoder grows its store on demand."""
        from .offload_cache import NosaCache

        return NosaCache(self, max_new_tokens=max_new_tokens)


def config_from_artifact(artifact) -> NosaConfig:
    """The recommended configuration of ``methods.nosa`` (ValueError naming what is missing)."""
    section = artifact.manifest["methods"].get("nosa")
    if not section or "recommended" not in section:
        raise ValueError("the artifact has no methods.nosa.recommended; run sparsesearch sweep-nosa first")
    rec = section["recommended"]
    missing = [key for key in ("block", "k", "k_q", "n_init", "n_win", "proxy", "kernel", "stride") if key not in rec]
    if missing:
        raise ValueError(f"methods.nosa.recommended lacks {', '.join(missing)}; rerun sparsesearch sweep-nosa")
    if rec["proxy"] not in ENGINE_PROXIES:
        raise ValueError(f"methods.nosa.recommended.proxy {rec['proxy']!r} is unknown; the offload engine runs {', '.join(ENGINE_PROXIES)}")
    cfg = NosaConfig(block=rec["block"], k=rec["k"], k_q=rec["k_q"], n_init=rec["n_init"], n_win=rec["n_win"], proxy=rec["proxy"],
                     kernel=rec["kernel"], stride=rec["stride"])
    if cfg.block <= 0 or cfg.stride <= 0 or cfg.block % cfg.stride:
        raise ValueError(f"methods.nosa.recommended.block {cfg.block} is not a positive multiple of the pooling stride {cfg.stride}")
    if cfg.k_q < 0 or cfg.k_e < 0:
        raise ValueError(f"methods.nosa.recommended: k {cfg.k} < sink {cfg.n_init} + window {cfg.n_win} + k_q {cfg.k_q}")
    return cfg


def active_layer(module) -> DecodeLayer | None:
    """The NosaLayer of the cache in use for this attention module, or None (no engine, no NOSA cache in
    use, or a sliding layer)."""
    engine: NosaEngine | None = getattr(module, _ENGINE, None)
    cache = engine.active() if engine is not None and engine.active is not None else None
    layer = cache.layers[module.layer_idx] if cache is not None and module.layer_idx < len(cache.layers) else None
    return layer if isinstance(layer, DecodeLayer) else None


def route(module, query, key, value, attention_mask, scaling, prefill_attention):
    """Shared by every attention function that offloads decode: a decode step of a layer whose NOSA store
    is filled runs over the slots; otherwise ``prefill_attention()`` computes the output (dense SDPA, or
    the runtime's per-head sparse prefill) and a prefill fills the store. Returns (output, weights)."""
    layer = active_layer(module)
    if layer is None:
        return prefill_attention()
    filled = layer.filled
    if filled and query.shape[2] == 1:
        return layer.decode(query), None
    if filled:
        raise ValueError("NOSA decode takes one token per step after the prefill; chunked decoding is not supported")
    out = prefill_attention()
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer.prefill(key, value, query, _padding_starts(attention_mask, query.shape[0], key.device), scale)
    return out


def nosa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """AttentionInterface function: dense SDPA prefill that fills the NOSA store; decode over the slots."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def dense():
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    return route(module, query, key, value, attention_mask, scaling, dense)


def _padding_starts(mask, batch: int, device) -> torch.Tensor:
    """First real token of each left-padded sequence, from the prefill mask (None: no padding)."""
    if mask is None or mask.dim() != 4:
        return torch.zeros(batch, dtype=torch.long, device=device)
    last_row = mask[:, 0, -1, :] if mask.dtype == torch.bool else mask[:, 0, -1, :] == 0
    return last_row.long().argmax(-1).expand(batch)


def attach(model, cfg: NosaConfig, *, seed: int = 0, decoder: str = "auto", fused: bool | None = None) -> NosaEngine:
    """Give the text decoder's attention modules a NOSA engine (``engine.new_cache()`` makes its caches).
    decoder: ``auto`` | ``slot`` | ``torch`` (``resolve_decoder``, on the model's device); fused: the slot
    decoder's Triton step (None: on a GPU). Registration of an attention function is the caller's
    (``enable_nosa``, or ``runtime.apply``)."""
    from ..models import info_from_model

    info = info_from_model(model)
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "k_proj")]
    eviction = {m.layer_idx: eviction_weights(m) for m in modules if eviction_weights(m) is not None}
    if cfg.proxy == "trained" and not eviction:
        raise ValueError("proxy 'trained' needs a NOSA checkpoint with an eviction head; this model has none")
    resolved = resolve_decoder(decoder, cfg.proxy, next(model.parameters()).device)
    engine = NosaEngine(cfg, frozenset(info.global_layers), info.num_layers, eviction, seed, decoder=resolved, fused=fused)
    for module in modules:
        setattr(module, _ENGINE, engine)
    return engine


def engine_of(model) -> NosaEngine | None:
    return next((getattr(m, _ENGINE) for m in model.modules() if hasattr(m, _ENGINE)), None)


def detach(model) -> None:
    for module in model.modules():
        if hasattr(module, _ENGINE):
            delattr(module, _ENGINE)


def enable_nosa(model, artifact=None, *, cfg: NosaConfig | None = None, seed: int = 0, decoder: str = "auto",
                fused: bool | None = None) -> NosaEngine:
    """Route the text decoder's attention through NOSA decode with the artifact's recommended configuration
    (or ``cfg``), dense prefill. Returns the engine; ``engine.new_cache(max_new_tokens)`` is the cache for
    ``generate``. decoder: ``auto`` (the slot decoder on a GPU for trained/vnorm/random, else torch),
    ``slot`` or ``torch``; fused: the slot decoder's Triton step (None: on a GPU). (``sparsesearch.runtime.apply``
    does the same on top of the artifact's sparse prefill, with decoder ``auto``.)"""
    from ..models.attention import install

    if artifact is not None:
        from ..artifacts.io import check_fits
        from ..models import info_from_model

        check_fits(artifact.manifest, info_from_model(model))
    engine = attach(model, cfg if cfg is not None else config_from_artifact(artifact), seed=seed, decoder=decoder, fused=fused)
    install(model, ATTN_NAME, nosa_attention)
    return engine


def disable_nosa(model) -> None:
    """Undo ``enable_nosa``."""
    from ..models.attention import uninstall

    detach(model)
    uninstall(model, ATTN_NAME)
