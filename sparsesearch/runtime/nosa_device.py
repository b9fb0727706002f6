"""Sync-free NOSA decode for one global layer (paper 004 §3.2, NOSI): every step is a fixed sequence of
launches over static shapes, with no host synchronisation, so a whole model step can be captured in one
CUDA graph (benchmarks/nosa_decode.py does).

The engine (runtime/nosa_engine.py) serves transformers' ``generate()`` for every proxy; its torch decoder keeps
per-sequence Python where the proxies need the full history (snapkv, tova re-score all keys at each block
boundary), and its slot decoder (engine.SlotLayer) runs this class. This decoder is the throughput path for the proxies whose per-token score is a function of the token
alone (``trained``: A·softplus(W·v), ``vnorm``: ||v||, ``random``), which is what a NOSA checkpoint runs:

* host store: keys/values [B, Hkv, capacity, D] in pinned memory; each new token is written there by the
  UVA kernel (kernels/gather.py, GPU -> pinned) in the step's launch sequence;
* device: k block slots plus the tail block per (sequence, KV head) as one [B, Hkv, (k+1)·block, D]
  buffer (the tail is slot k), so attention reads one tensor; the slot map [B, Hkv, k] (block id or -1);
  compressed keys [B, Hkv, M, D] in the cache dtype; per-token query-agnostic scores [B, Hkv, capacity];
* query-agnostic block scores are recomputed only when a sequence starts a new block and frozen in
  between, which is what makes the locality bound hold at every other step (docs/peers.md "NOSA fine print");
* the fetch list is sized by that bound: at a step inside a block at most k_q selected blocks can be new
  (sink, window and the frozen agnostic order do not move), so the step gathers ``k_q`` ranks per
  (sequence, KV head), and all k at a step where some sequence starts a block. Blocks beyond the list
  would be dropped, so they are counted (``dropped``); tests and the benchmark assert it stays 0.

Attention reads the slots with the group's query heads as rows (no GQA expansion). With the fused step it
is one Triton launch (kernels/nosa_attend.py) that also fetches the step's missed blocks from the host
store through UVA, so the PCIe reads overlap the attention's HBM reads instead of running before them;
otherwise q [B, Hkv, G, D] against the slot buffer [B, Hkv, T, D] with a validity (and eviction-bias)
mask, one SDPA call after the gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels.gather import gather_blocks
from ..kernels.nosa_append import append_token
from ..kernels.nosa_attend import AttendScratch, default_splits, slot_attend
from ..kernels.nosa_select import SelectScratch, select_and_map
from .nosa_config import NosaConfig
from .nosa_proxies import trained_scores
from .nosa_selection import NEG, agnostic_unit_scores, pool_blocks, select_blocks, unit_count

DEVICE_PROXIES = ("trained", "vnorm", "random")


def token_scores(proxy: str, v: torch.Tensor, eviction: tuple[torch.Tensor, torch.Tensor] | None, positions: torch.Tensor, seed: int) -> torch.Tensor:
    """Per-token query-agnostic score of tokens whose values are v [..., Hkv, T, D] at positions [T] or
    [..., T] -> float32 [..., Hkv, T]. ``random`` hashes (seed, position, head) so a token keeps its score."""
    if proxy == "trained":
        return trained_scores(v, *eviction)
    if proxy == "vnorm":
        return v.float().norm(dim=-1)
    heads = torch.arange(v.shape[-3], device=v.device)[:, None]
    pos = positions[..., None, :] if positions.dim() > 1 else positions
    mixed = (pos * 1_000_003 + heads * 7919 + seed * 104_729) % 2_147_483_647
    return (mixed * 48271 % 2_147_483_647).float() / 2_147_483_647.0


class SlotDecoder:
    """One global layer's offloaded cache and its decode step, batched over B sequences and Hkv KV heads.

    cfg: the NOSA configuration (block, k, k_q, sink, window, proxy); group: query heads per KV head;
    capacity: tokens per sequence the host store holds (prompt + decode steps); eviction: (W [Hkv, D],
    A [Hkv]) for proxy ``trained`` (its scores are also the attention's additive logit bias); fused: select,
    map slots and build the mask in one Triton launch (kernels/nosa_select.py) instead of the torch ops
    below — the default on a GPU, where the torch path's ~80 launches per
    layer dominated a step; attention: ``triton`` (the fused step's default: kernels/nosa_attend.py, which
    fetches the missed blocks inside the attention) or ``sdpa`` (UVA gathers, then masked SDPA; the torch
    path's only choice); scratch / attend_scratch: the fused kernels' buffers, which layers run one after
    another may share (a step's selection is consumed within the layer's step); scale: the attention's
    logit scale (default head_dim ** -0.5; a model's own, e.g. Gemma's query_pre_attn_scalar)."""

    def __init__(self, cfg: NosaConfig, *, batch: int, kv_heads: int, group: int, dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, eviction=None, seed: int = 0, host=None,
                 fused: bool | None = None, attention: str | None = None, scratch: SelectScratch | None = None,
                 attend_scratch: AttendScratch | None = None, scale: float | None = None):
        if cfg.proxy not in DEVICE_PROXIES:
            raise ValueError(f"proxy {cfg.proxy!r} needs the full history at each refresh; the sync-free decoder serves {', '.join(DEVICE_PROXIES)}")
        if cfg.proxy == "trained" and eviction is None:
            raise ValueError("proxy 'trained' needs the eviction head (W [Hkv, D], A [Hkv])")
        device = torch.device(device)
        self.cfg, self.eviction, self.seed = cfg, eviction, seed
        self.batch, self.kv_heads, self.group, self.dim = batch, kv_heads, group, dim
        bs = cfg.block
        self.capacity = -(-capacity // bs) * bs
        self.n_blocks = self.capacity // bs
        pinned = device.type == "cuda"
        shape = (batch, kv_heads, self.capacity, dim)
        # host=(keys, values) lets layers share one store (a benchmark whose host RAM cannot hold every layer)
        self.keys_host, self.values_host = host if host is not None else (
            torch.empty(shape, dtype=dtype, pin_memory=pinned), torch.empty(shape, dtype=dtype, pin_memory=pinned))
        slots = (batch, kv_heads, (cfg.k + 1) * bs, dim)
        self.slots_k = torch.zeros(slots, dtype=dtype, device=device)
        self.slots_v = torch.zeros(slots, dtype=dtype, device=device)
        self.slot_map = torch.full((batch, kv_heads, cfg.k), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, kv_heads, self.capacity, dtype=torch.float32, device=device)
        self.units = torch.zeros(batch, kv_heads, unit_count(self.capacity, cfg.kernel, cfg.stride), dim, dtype=dtype, device=device)
        self.ring = torch.zeros(batch, kv_heads, cfg.kernel, dim, dtype=dtype, device=device)  # the last `kernel` keys
        self.se = torch.full((batch, kv_heads, self.n_blocks), NEG, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.host_lengths = [0] * batch  # the host's copy: every step adds 1 to each, so it needs no sync
        self.cold = True
        self.counters = torch.zeros(2, dtype=torch.long, device=device)
        self.fetched = self.counters[0]  # blocks moved host -> device
        self.dropped = self.counters[1]  # misses beyond the fetch list (must stay 0)
        self.scale = dim ** -0.5 if scale is None else scale
        self.backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # a masked call: no flash
        self._pairs = torch.arange(batch * kv_heads, device=device).view(batch, kv_heads, 1)
        self._dst_row0 = self._pairs * (cfg.k + 1)  # first slot row of each (sequence, KV head)
        self.fused = device.type == "cuda" if fused is None else fused
        if self.fused:
            self._use_scratch(scratch)
        self.attention = attention or ("triton" if self.fused else "sdpa")
        if self.attention not in ("triton", "sdpa"):
            raise ValueError(f"attention must be 'triton' or 'sdpa', got {self.attention!r}")
        if self.attention == "triton":
            if not self.fused:
                raise ValueError("attention 'triton' fetches from the fused selection's slot list: it needs fused=True")
            if bs & (bs - 1) or bs < 16:
                raise ValueError(f"attention 'triton' needs a power-of-two block >= 16, got {bs}")
            pairs = batch * kv_heads
            self.attend_scratch = attend_scratch or AttendScratch(pairs, default_splits(pairs, cfg.k + 1, device), self.scratch.group_pad, dim, device)

    def _use_scratch(self, scratch: SelectScratch | None) -> None:
        """The fused selection's buffers for the current capacity: ``scratch`` when given (it must fit), else new."""
        shape = (self.batch * self.kv_heads, self.group, self.units.shape[2], self.n_blocks, self.cfg.k, self.cfg.block, self.slots_k.dtype)
        self.scratch = scratch or SelectScratch(*shape, self.slots_k.device)
        if not self.scratch.fits(*shape):
            raise ValueError("the shared selection scratch was made for another shape")

    def grow(self, capacity: int, scratch: SelectScratch | None = None) -> None:
        """Re-allocate the host store and the per-token state for ``capacity`` tokens per sequence, contents
        kept (the engine calls it when a generation outruns its hint). Buffers change address: a step
        captured in a CUDA graph must be captured again. scratch: a shared selection scratch of the new shape."""
        bs = self.cfg.block
        capacity = -(-capacity // bs) * bs
        if capacity <= self.capacity:
            return
        old, m_old, pinned = self.capacity, self.units.shape[2], self.keys_host.is_pinned()
        for name in ("keys_host", "values_host"):
            x = getattr(self, name)
            grown = torch.empty((*x.shape[:2], capacity, x.shape[-1]), dtype=x.dtype, pin_memory=pinned)
            grown[:, :, :old] = x
            setattr(self, name, grown)
        self.capacity, self.n_blocks = capacity, capacity // bs
        self.scores = F.pad(self.scores, (0, capacity - old))
        self.units = F.pad(self.units, (0, 0, 0, unit_count(capacity, self.cfg.kernel, self.cfg.stride) - m_old))
        self.se = F.pad(self.se, (0, self.n_blocks - old // bs), value=NEG)
        if self.fused:
            self._use_scratch(scratch)

    @property
    def _src_row0(self) -> torch.Tensor:
        """long [B, Hkv, 1]: the first host block row of each (sequence, KV head) at the current capacity."""
        return self._pairs * self.n_blocks

    # ------------------------------------------------------------------------------------------ prefill

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """keys/values [B, Hkv, N, D] on the device, each sequence from its first token (right-padded);
        lengths long [B]. Fills the host store, compressed keys, scores, the key ring and the tail slot;
        the first decode step fetches the selected blocks (a cold start, counted in ``fetched``)."""
        cfg, bs = self.cfg, self.cfg.block
        n = keys.shape[2]
        if n > self.capacity or int(lengths.max()) > self.capacity - 1:
            raise ValueError(f"prompt of {n} tokens leaves no room in a store of capacity {self.capacity}")
        self._store_prompt(keys, self.keys_host)
        self._store_prompt(values, self.values_host)
        lengths = lengths.to(self.lengths.device)
        self.lengths.copy_(lengths)
        self.host_lengths = [int(x) for x in lengths.tolist()]  # once per prompt
        pos = torch.arange(n, device=keys.device)
        self.scores[:, :, :n] = token_scores(cfg.proxy, values, self.eviction, pos, self.seed)
        m = unit_count(n, cfg.kernel, cfg.stride)
        for b in range(keys.shape[0]):  # one sequence at a time: the float32 windows are kernel x its keys
            if m:
                self.units[b, :, :m] = keys[b, :, : (m - 1) * cfg.stride + cfg.kernel].unfold(1, cfg.kernel, cfg.stride).float().mean(-1).to(self.units.dtype)
        self.ring.copy_(self._ring_from(keys, lengths))
        start = torch.div(lengths - 1, bs, rounding_mode="floor") * bs  # the tail block's first token
        offs = start[:, None] + torch.arange(bs, device=keys.device)
        idx = offs.clamp(max=n - 1)[:, None, :, None].expand(-1, self.kv_heads, -1, self.dim)
        self.slots_k[:, :, cfg.k * bs:] = keys.gather(2, idx)
        self.slots_v[:, :, cfg.k * bs:] = values.gather(2, idx)
        self._refresh(torch.ones_like(lengths, dtype=torch.bool))
        self.cold = True  # the first step fills every slot

    def _store_prompt(self, x: torch.Tensor, store: torch.Tensor) -> None:
        """x [B, Hkv, N, D] -> store[:, :, :N] as whole blocks through the UVA kernel (a strided copy into
        pinned memory would go through a pageable staging buffer at a few GB/s)."""
        bs = self.cfg.block
        batch, heads, n, dim = x.shape
        nb = -(-n // bs)
        src = F.pad(x, (0, 0, 0, nb * bs - n)).reshape(batch * heads * nb, bs, dim)
        dst = (self._src_row0.view(-1, 1) + torch.arange(nb, device=x.device)).flatten()
        gather_blocks(src, torch.arange(src.shape[0], device=x.device), store.view(-1, bs, dim), dst)

    def _ring_from(self, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The key ring after a prompt: position p lives at p % kernel, for the last ``kernel`` positions."""
        kernel = self.cfg.kernel
        slot = torch.arange(kernel, device=keys.device)
        last = lengths[:, None] - 1
        pos = last - ((last - slot) % kernel)  # the newest position p <= last with p % kernel == slot
        idx = pos.clamp(min=0)[:, None, :, None].expand(-1, self.kv_heads, -1, self.dim)
        return keys.gather(2, idx)

    # ------------------------------------------------------------------------------------------- decode

    def step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """One decode token per sequence: q [B, Hq, D], k_new/v_new [B, Hkv, D] -> [B, Hq, D].
        Appends the token, refreshes agnostic scores where a block starts, selects, fetches the new blocks,
        attends over slots and tail."""
        boundary_any = self.boundary_next()
        self.append(k_new, v_new)
        if boundary_any:
            self._refresh(self.lengths % self.cfg.block == 1 % self.cfg.block)
        ranks = self.cfg.k if boundary_any or self.cold else self.cfg.k_q
        self.cold = False
        if self.fused:
            q = q.contiguous()  # both kernels address q as [B·Hq, D] rows
            self.fused_select(q, ranks)
            if self.attention == "triton":
                return slot_attend(q, self.slots_k, self.slots_v, self.keys_host, self.values_host, self.slot_map,
                                   self.scratch.fetch_from, self.scores, self.lengths, self.attend_scratch, block=self.cfg.block,
                                   scale=self.scale, bias=self.cfg.proxy == "trained")
            return self.attend(q, self.scratch.mask.view(self.batch, self.kv_heads, 1, -1))
        self._selected = self.select(q)
        self.fetch(self._selected, ranks=ranks)
        return self.attend(q)

    @property
    def last_selected(self) -> torch.Tensor:
        """bool [B, Hkv, n_blocks]: the last step's selected blocks (the tail block excluded)."""
        return self.scratch.sel.view(self.batch, self.kv_heads, -1).bool() if self.fused else self._selected

    def fused_select(self, q: torch.Tensor, ranks: int) -> None:
        """Selection and slot map (kernels/nosa_select.py) for the step's contiguous q [B, Hq, D]. For SDPA
        attention also the two UVA gathers of its fetch list and the attention mask (left in scratch.mask);
        the Triton attention fetches by itself."""
        cfg, bs, dim = self.cfg, self.cfg.block, self.dim
        src, dst = select_and_map(self.units, q, self.lengths, self.se, self.scores, self.slot_map, self.counters, self.scratch,
                                  block=bs, k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win, kernel=cfg.kernel,
                                  stride=cfg.stride, ranks=min(ranks, self.n_blocks), scale=self.scale, bias=cfg.proxy == "trained",
                                  mask=self.attention == "sdpa")
        if self.attention == "triton":
            return
        gather_blocks(self.keys_host.view(-1, bs, dim), src, self.slots_k.view(-1, bs, dim), dst)
        gather_blocks(self.values_host.view(-1, bs, dim), src, self.slots_v.view(-1, bs, dim), dst)

    def boundary_next(self) -> bool:
        """Whether the next token starts a block in some sequence (known on the host: no sync). A CUDA
        graph of a step is captured once per answer (benchmarks/nosa_decode.py)."""
        return any(n % self.cfg.block == 0 for n in self.host_lengths)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """k_new/v_new [B, Hkv, D]: the host store (through UVA), the tail slot, score, key ring, units."""
        cfg, bs = self.cfg, self.cfg.block
        if self.fused:  # one launch (kernels/nosa_append.py) for the ~25 below
            append_token(k_new, v_new, self.lengths, self.keys_host, self.values_host, self.slots_k, self.slots_v, self.scores, self.ring,
                         self.units, proxy=cfg.proxy, eviction=self.eviction, seed=self.seed, block=bs, kernel=cfg.kernel, stride=cfg.stride)
            self.lengths += 1
            self.host_lengths = [n + 1 for n in self.host_lengths]
            return
        batch, heads, dim = k_new.shape
        pos = self.lengths  # [B] the new token's position
        rows = torch.arange(batch * heads, device=k_new.device)
        dst = rows * self.capacity + pos.repeat_interleave(heads)
        for new, store in ((k_new, self.keys_host), (v_new, self.values_host)):
            gather_blocks(new.reshape(-1, 1, dim).contiguous(), rows, store.view(-1, 1, dim), dst)
        b = torch.arange(batch, device=k_new.device)
        col = cfg.k * bs + pos % bs
        self.slots_k[b, :, col] = k_new
        self.slots_v[b, :, col] = v_new
        self.scores[b, :, pos] = token_scores(cfg.proxy, v_new[:, :, None], self.eviction, pos[:, None], self.seed)[..., 0]
        self.ring[b, :, pos % cfg.kernel] = k_new
        done = ((pos + 1 - cfg.kernel) >= 0) & ((pos + 1 - cfg.kernel) % cfg.stride == 0)
        m = torch.div((pos + 1 - cfg.kernel).clamp(min=0), cfg.stride, rounding_mode="floor")
        mean = self.ring.float().mean(2).to(self.units.dtype)  # [B, Hkv, D]
        self.units[b, :, m] = torch.where(done[:, None, None], mean, self.units[b, :, m])
        self.lengths += 1
        self.host_lengths = [n + 1 for n in self.host_lengths]

    def _refresh(self, rows: torch.Tensor) -> None:
        """Query-agnostic block scores of the sequences in rows (bool [B]) from their per-token scores."""
        cfg = self.cfg
        n_units = unit_count(self.lengths, cfg.kernel, cfg.stride)[:, None]  # [B, 1]
        seen = torch.arange(self.capacity, device=self.scores.device) < self.lengths[:, None, None]
        units = agnostic_unit_scores(self.scores.masked_fill(~seen, 0.0)[:, :, None], n_units, cfg.kernel, cfg.stride)[:, :, 0]
        fresh = pool_blocks(units, self.n_blocks, cfg.ratio)
        self.se.copy_(torch.where(rows[:, None, None], fresh, self.se))  # in place: a captured graph replays it

    def query_scores(self, q: torch.Tensor) -> torch.Tensor:
        """Eq. 3-4 for the step's query q [B, Hq, D]: softmax over seen compressed keys per query head,
        summed over the group, max-pooled to blocks -> float32 [B, Hkv, n_blocks]. The dot runs in the cache
        dtype (fp32 accumulation): the compressed keys are read once, never copied to float32."""
        cfg = self.cfg
        qg = q.view(self.batch, self.kv_heads, self.group, self.dim).to(self.units.dtype)
        # units @ q^T ([M, D] x [D, G] per pair) rather than q @ units^T: with G rows the latter falls to a
        # batched GEMM path that ran at a tenth of HBM bandwidth on an H200 (benchmarks/nosa_decode.py --profile)
        logits = torch.matmul(self.units, qg.transpose(-1, -2)).float().transpose(-1, -2) * self.scale  # [B, Hkv, G, M]
        n_units = unit_count(self.lengths, cfg.kernel, cfg.stride)
        seen = torch.arange(self.units.shape[2], device=q.device) < n_units[:, None]  # [B, M]
        probs = torch.softmax(logits.masked_fill(~seen[:, None, None], NEG), -1).nan_to_num(0.0).sum(2)
        return pool_blocks(probs.masked_fill(~seen[:, None], NEG), self.n_blocks, cfg.ratio)

    def select(self, q: torch.Tensor) -> torch.Tensor:
        """Eq. 5 for every (sequence, KV head) -> bool [B, Hkv, n_blocks] (the tail block excluded)."""
        cfg = self.cfg
        tail = torch.div(self.lengths - 1, cfg.block, rounding_mode="floor")
        sel, _ = select_blocks(self.query_scores(q).transpose(0, 1), self.se.transpose(0, 1), tail,
                               k=cfg.k, k_q=cfg.k_q, n_init=cfg.n_init, n_win=cfg.n_win)
        return sel.transpose(0, 1)

    def fetch(self, selected: torch.Tensor, ranks: int) -> None:
        """Slot map by set difference, then one gather per K and V of the first ``ranks`` missing blocks of
        each (sequence, KV head) into its free slots (i-th missing block, in block order, to the i-th free
        slot, in slot order). Misses past ``ranks`` are counted in ``dropped``."""
        ranks = min(ranks, self.n_blocks)
        old = self.slot_map.clone()  # the map is updated in place below (a captured graph replays the update)
        keep = (old >= 0) & selected.gather(-1, old.clamp(min=0))
        resident = torch.zeros(selected.shape, dtype=torch.int32, device=old.device).scatter_add_(-1, old.clamp(min=0), keep.int()) > 0
        missing = selected & ~resident
        n_miss = missing.sum(-1, keepdim=True)  # [B, Hkv, 1]
        self.dropped += (n_miss - ranks).clamp(min=0).sum()
        if ranks == 0:
            self.slot_map.copy_(torch.where(keep, old, -1))
            return
        miss_order = torch.sort((~missing).to(torch.int8), dim=-1, stable=True).indices[..., :ranks]  # missing ids first
        free_order = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices[..., :ranks]  # free slot ids first
        take = torch.arange(ranks, device=old.device) < n_miss  # [B, Hkv, ranks]
        new_map = torch.where(keep, old, -1)
        self.slot_map.copy_(new_map.scatter(-1, free_order, torch.where(take, miss_order, new_map.gather(-1, free_order))))
        src = torch.where(take, self._src_row0 + miss_order, -1).flatten()
        dst = (self._dst_row0 + free_order).flatten()
        bs, dim = self.cfg.block, self.dim
        gather_blocks(self.keys_host.view(-1, bs, dim), src, self.slots_k.view(-1, bs, dim), dst)
        gather_blocks(self.values_host.view(-1, bs, dim), src, self.slots_v.view(-1, bs, dim), dst)
        self.fetched += take.sum()

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D] over the resident slots and the tail's tokens so far -> [B, Hq, D]. mask: the
        additive [B, Hkv, 1, (k+1)·block] mask when the fused kernel built it, else built here."""
        qg = q.view(self.batch, self.kv_heads, self.group, self.dim)
        mask = self._mask(q) if mask is None else mask
        with sdpa_kernel(self.backends):
            out = F.scaled_dot_product_attention(qg, self.slots_k, self.slots_v, attn_mask=mask, scale=self.scale)
        return out.reshape(self.batch, -1, self.dim)

    def _mask(self, q: torch.Tensor) -> torch.Tensor:
        """The attention mask from the slot map: bool, or additive with the eviction bias (proxy trained)."""
        cfg, bs = self.cfg, self.cfg.block
        offs = torch.arange(bs, device=q.device)
        slot_ok = (self.slot_map >= 0)[..., None].expand(-1, -1, -1, bs).flatten(2)  # [B, Hkv, k·bs]
        tail_ok = (offs <= ((self.lengths - 1) % bs)[:, None])[:, None].expand(-1, self.kv_heads, -1)
        ok = torch.cat([slot_ok, tail_ok], dim=2)[:, :, None]  # [B, Hkv, 1, T]
        if cfg.proxy == "trained":  # the eviction score is also the logit bias (ED-DMA)
            tokens = torch.cat([(self.slot_map.clamp(min=0)[..., None] * bs + offs).flatten(2),
                                (torch.div(self.lengths - 1, bs, rounding_mode="floor") * bs)[:, None, None] + offs.expand(self.kv_heads, -1)], 2)
            bias = self.scores.gather(-1, tokens.clamp(max=self.capacity - 1))[:, :, None]
            return bias.masked_fill(~ok, NEG).to(q.dtype)
        return ok

    def memory(self) -> dict:
        """Bytes on the device (slots + tail, map, compressed keys, scores, ring) and in the host store."""
        device = sum(t.numel() * t.element_size() for t in (self.slots_k, self.slots_v, self.slot_map, self.units, self.scores, self.ring, self.se))
        host = sum(t.numel() * t.element_size() for t in (self.keys_host, self.values_host))
        return {"device_bytes": device, "host_bytes": host}
