"""BlockIndex: the only thing sparse kernels see.

A BlockIndex lists, for every (batch, head, query block), which key blocks a query block attends to and
which single key columns it gathers besides. It is plain tensors plus a few integers: no pattern objects,
no methods that hide work.

Semantics (what the kernel computes, and what ``reference.index_to_mask`` reproduces). For query row ``i``
(0-based within its sequence, in query block ``i // block_m``) of a sequence with ``q_len`` queries and
``kv_len`` keys, let ``pos = i + kv_len - q_len`` (queries are bottom-right aligned, as in FlashAttention).
Key ``j`` is admitted iff ``j < kv_len`` and ``j <= pos`` and one of:

* ``j // block_n`` is a *full* block of the row's query block (no mask at all is applied: the builder
  guarantees every such key is causal and in range for every valid row of the block);
* ``j // block_n`` is a *partial* block and the token mask holds: ``window < 0`` or ``pos - j < window``
  or ``j < sink`` (causality and ``j < kv_len`` are always applied in partial blocks);
* ``j`` is one of the row's query block's gathered *columns* (vertical lines outside every listed block).

Full blocks, partial blocks and columns are disjoint. A row with no admitted key yields output 0 and
lse = -inf.

Shapes (``B`` batch or number of varlen sequences, ``H`` heads of ``head_space``, ``QB`` query blocks of
the longest sequence):

* ``full_count``    int32 [B, H, QB]       number of valid entries in ``full_idx``
* ``full_idx``      int32 [B, H, QB, F]    key-block ids, ascending in the first ``full_count`` entries
* ``partial_count`` int32 [B, H, QB]
* ``partial_idx``   int32 [B, H, QB, P]
* ``col_count``     int32 [B, H, QB]       or None
* ``col_idx``       int32 [B, H, QB, C]    token ids, ascending in the first ``col_count`` entries, or None

Entries past a count are padding (0) and are never read. ``head_space`` says whether ``H`` counts query
heads ("query") or KV heads ("kv": every query head of a GQA group shares its KV head's index).

``col_table`` (optional, a ``ColumnTable``) states the gathered columns a second way, for kernels: each head's
columns as one ascending table, and per query block which of its slots the block uses. It names the same
keys as ``col_idx``; a kernel that can reads the table's K/V rows as contiguous tiles of a compact copy
instead of gathering token by token. Anything that cannot carry it drops it (the lists stay the truth).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

HEAD_SPACES = ("query", "kv")
BLOCK_SIZES = (16, 32, 64, 128)


@dataclass(frozen=True)
class ColumnTable:
    """A head's gathered columns as slots of one table (see the module docstring).

    * ``ids``   int32 [B, H, V]        each head's column ids, ascending (slots past its real count: padding)
    * ``bits``  int32 [B, H, QB, W]    W = ceil(V / 32): query block uses slot s iff bit s % 32 of word s // 32
    * ``clean`` int32 [B, H, QB]       slots [0, clean) are all used and causal for every row of the block
      (id <= the block's first row position): a kernel reads them with no mask
    * ``span``  int32 [B, H, QB]       no slot >= span is used

    For query block q, {ids[s] : slot s used} equals ``col_idx[q, :col_count[q]]`` as a set.
    """

    ids: torch.Tensor
    bits: torch.Tensor
    clean: torch.Tensor
    span: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 3 or self.bits.dim() != 4:
            raise ValueError(f"col_table ids must be [B, H, V] and bits [B, H, QB, W], got {tuple(self.ids.shape)} and {tuple(self.bits.shape)}")
        shape = tuple(self.bits.shape[:3])
        if tuple(self.ids.shape[:2]) != shape[:2] or self.bits.shape[3] != -(-self.ids.shape[2] // 32):
            raise ValueError(f"col_table bits {tuple(self.bits.shape)} do not fit ids {tuple(self.ids.shape)} (W = ceil(V / 32))")
        for name in ("ids", "bits", "clean", "span"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.device != self.ids.device:
                raise ValueError(f"col_table {name} must be int32 on {self.ids.device}, got {t.dtype} on {t.device}")
            if name in ("clean", "span") and tuple(t.shape) != shape:
                raise ValueError(f"col_table {name} must have shape {shape}, got {tuple(t.shape)}")

    def map(self, fn) -> "ColumnTable":
        """The table with ``fn(name, tensor)`` applied to each of its tensors."""
        return ColumnTable(**{name: fn(name, getattr(self, name)) for name in ("ids", "bits", "clean", "span")})


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., V] -> int32 [..., ceil(V / 32)]: bit s % 32 of word s // 32 is mask[..., s]."""
    words = -(-mask.shape[-1] // 32)
    padded = torch.nn.functional.pad(mask, (0, words * 32 - mask.shape[-1])).view(*mask.shape[:-1], words * 4, 8)
    # A byte at a time (disjoint bits: the sum is their OR, at most 255), so the working memory is one byte per
    # bit; four little-endian bytes are one int32 word (bit s % 32 of word s // 32), as CPUs and GPUs lay them.
    # Made on the device (no host copy): builds run inside CUDA-graph capture (graphed.GraphedIndexCache).
    weights = torch.ones(8, dtype=torch.uint8, device=mask.device) << torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (padded.to(torch.uint8) * weights).sum(-1, dtype=torch.uint8).view(torch.int32)


def unpack_bits(bits: torch.Tensor, slots: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., slots], the inverse of ``pack_bits``."""
    s = torch.arange(slots, device=bits.device)
    return ((bits[..., s // 32] >> (s % 32)) & 1).bool()


@dataclass(frozen=True)
class BlockIndex:
    full_count: torch.Tensor
    full_idx: torch.Tensor
    partial_count: torch.Tensor
    partial_idx: torch.Tensor
    block_m: int
    block_n: int
    head_space: str = "query"
    col_count: torch.Tensor | None = None
    col_idx: torch.Tensor | None = None
    window: int = -1
    sink: int = 0
    meta: dict = field(default_factory=dict, compare=False)
    col_table: ColumnTable | None = None

    def __post_init__(self) -> None:
        if self.head_space not in HEAD_SPACES:
            raise ValueError(f"head_space must be one of {HEAD_SPACES}, got {self.head_space!r}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value not in BLOCK_SIZES:
                raise ValueError(f"{name} must be one of {BLOCK_SIZES}, got {value}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.window == 0 or self.window < -1:
            raise ValueError(f"window must be -1 (off) or >= 1, got {self.window}")
        if (self.col_count is None) != (self.col_idx is None):
            raise ValueError("col_count and col_idx must be given together")
        shape = tuple(self.full_count.shape)
        if len(shape) != 3:
            raise ValueError(f"full_count must be [B, H, QB], got shape {shape}")
        pairs = [("full", self.full_count, self.full_idx), ("partial", self.partial_count, self.partial_idx)]
        if self.col_count is not None:
            pairs.append(("col", self.col_count, self.col_idx))
        for name, count, idx in pairs:
            if tuple(count.shape) != shape:
                raise ValueError(f"{name}_count must have shape {shape}, got {tuple(count.shape)}")
            if idx.dim() != 4 or tuple(idx.shape[:3]) != shape:
                raise ValueError(f"{name}_idx must be [B, H, QB, n] with [B, H, QB] = {shape}, got {tuple(idx.shape)}")
            for tensor in (count, idx):
                if tensor.dtype != torch.int32:
                    raise ValueError(f"{name} tensors must be int32, got {tensor.dtype}")
                if tensor.device != self.full_count.device:
                    raise ValueError(f"{name} tensors are on {tensor.device}, full_count on {self.full_count.device}")
        if self.col_table is not None:
            if self.col_count is None:
                raise ValueError("a col_table needs the column lists it restates (col_count, col_idx)")
            if tuple(self.col_table.span.shape) != shape or self.col_table.ids.device != self.full_count.device:
                raise ValueError(f"col_table must be [B, H, QB] = {shape} on {self.full_count.device}, got {tuple(self.col_table.span.shape)} on {self.col_table.ids.device}")

    @property
    def batch(self) -> int:
        return self.full_count.shape[0]

    @property
    def heads(self) -> int:
        return self.full_count.shape[1]

    @property
    def q_blocks(self) -> int:
        return self.full_count.shape[2]

    @property
    def device(self) -> torch.device:
        return self.full_count.device

    def to(self, device: torch.device | str) -> "BlockIndex":
        moved = {
            name: getattr(self, name).to(device)
            for name in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
            if getattr(self, name) is not None
        }
        if self.col_table is not None:
            moved["col_table"] = self.col_table.map(lambda _, t: t.to(device))
        return replace(self, **moved)

    def expand_batch(self, batch: int) -> "BlockIndex":
        """Broadcast an index built once (B == 1) to ``batch`` sequences without copying."""
        if self.batch == batch:
            return self
        if self.batch != 1:
            raise ValueError(f"can only expand an index with batch 1, this one has batch {self.batch}")
        grown = {
            name: getattr(self, name).expand(batch, *getattr(self, name).shape[1:])
            for name in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
            if getattr(self, name) is not None
        }
        if self.col_table is not None:
            grown["col_table"] = self.col_table.map(lambda _, t: t.expand(batch, *t.shape[1:]))
        return replace(self, **grown)

    def computed_blocks(self) -> torch.Tensor:
        """int64 [B, H, QB]: key blocks each query block loads (full + partial; columns not included)."""
        return self.full_count.long() + self.partial_count.long()


@dataclass(frozen=True)
class GridLines:
    """A grid head's stride/phase read in place by index arithmetic (patterns/grid.py build_lines_index):
    no map, no permuted copy. The index covers every q row in order with key blocks in original
    coordinates; query block b also reads the vertical-line keys col_phase + stride * i, i < line_cols[b],
    as strided columns, and in its partial blocks the line keys below col_phase + stride * line_cols[b] are
    masked (the columns have them). The horizontal-line rows row_phase + stride * s, s < row_lines, attend
    every causal key: the kernels compute them apart (split over keys: one such row sees the whole context)
    and write them over the index's result. q_len / kv_len: the lengths it was built for (row_phase
    depends on kv_len - q_len)."""

    stride: int
    row_phase: int
    row_lines: int
    col_phase: int
    line_cols: torch.Tensor | None  # int32 [QB] or None (no vertical lines)
    q_len: int
    kv_len: int

    def rows(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [row_lines]: the horizontal-line q rows."""
        return self.row_phase + self.stride * torch.arange(self.row_lines, device=device)

    def is_line_row(self, rows: torch.Tensor) -> torch.Tensor:
        """bool like rows (q row ids): a horizontal-line row."""
        if self.row_lines == 0:
            return torch.zeros_like(rows, dtype=torch.bool)
        return (rows - self.row_phase) % self.stride == 0

    def entries(self, block_m: int) -> int:
        """Score entries the lines add to their index's per head: each query block's line columns for every
        row of the block (they lie below the band, so all are causal), and each line row's causal keys
        (its band, computed by the index pass and then overwritten, is counted there)."""
        cols = 0
        if self.line_cols is not None:
            rows_in = torch.full_like(self.line_cols, block_m, dtype=torch.int64)
            rows_in[-1] = self.q_len - block_m * (self.line_cols.numel() - 1)
            cols = int((self.line_cols.long() * rows_in).sum())
        return cols + int((self.rows() + 1 + self.kv_len - self.q_len).sum())


@dataclass(frozen=True)
class RegionMaps:
    """A modality region (or any permutation) read in place by the kernels: region row i is q row
    row_map[i], region key j is k/v row col_map[j] (None: every row, or every key, in order); row_pos, the
    region frame (patterns/boundary.py: each row's frontier among the region's keys), or None. q_len /
    kv_len: the token counts of the whole q and k the maps index. increasing: col_map is strictly
    increasing (a modality's keys in original order), so a key block is one run of consecutive k/v rows
    exactly when its first and last ids differ by its width, and the kernels load such blocks as plain
    contiguous tiles (TMA on Hopper) instead of gathering them row by row (kernels/region_runs.py).

    Build with ``kernels.region_maps`` (checks every value once, with a device sync) or
    ``boundary.Region.maps`` (valid by construction). The kernels check only shapes, dtypes and devices
    here, so a launch costs no sync: the values were checked when the maps were made."""

    row_map: torch.Tensor | None  # int32 [Nq_r]
    col_map: torch.Tensor | None  # int32 [Nk_r]
    row_pos: torch.Tensor | None  # int64 [Nq_r]
    q_len: int
    kv_len: int
    increasing: bool = False

    def __post_init__(self):
        for name in ("row_map", "col_map"):
            m = getattr(self, name)
            if m is not None and (m.dim() != 1 or m.dtype != torch.int32 or m.numel() == 0):
                raise ValueError(f"{name} must be a non-empty 1-D int32 tensor, got {m.dtype} {tuple(m.shape)}")
        if self.row_map is None and self.col_map is None:
            raise ValueError("region maps need a row_map, a col_map or both")
        devices = {t.device for t in (self.row_map, self.col_map, self.row_pos) if t is not None}
        if len(devices) > 1:
            raise ValueError(f"row_map, col_map and row_pos must share a device, got {sorted(map(str, devices))}")
        if self.row_pos is not None and (self.row_pos.dim() != 1 or self.row_pos.numel() != self.rows):
            raise ValueError(f"row_pos must be an int tensor [{self.rows}], got {self.row_pos.dtype} {tuple(self.row_pos.shape)}")

    @property
    def rows(self) -> int:
        """Nq_r: the region's rows."""
        return self.q_len if self.row_map is None else self.row_map.numel()

    @property
    def keys(self) -> int:
        """Nk_r: the region's keys."""
        return self.kv_len if self.col_map is None else self.col_map.numel()

    @property
    def pos_shift(self) -> int:
        """Nk - Nq: the bottom-right frame of the whole tensors places q row r at key position r + pos_shift."""
        return self.kv_len - self.q_len

    @property
    def device(self) -> torch.device:
        return (self.row_map if self.row_map is not None else self.col_map).device


def num_blocks(length: int, block: int) -> int:
    return (length + block - 1) // block


def list_width(count: torch.Tensor, bound: int | None) -> int:
    """Width of packed id lists: the largest count (one device sync), or ``bound`` when given — an upper
    bound known from the shapes, so the build has no sync and can be captured in a CUDA graph."""
    if bound is not None:
        return max(1, bound)
    return max(1, int(count.max().item()) if count.numel() else 1)


def pack_lists(mask: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a boolean selection into (count, sorted ids) without a Python loop.

    mask: bool [..., K] -> count int32 [...], ids int32 [..., W] ascending, 0-padded; W = max(1, max count),
    or ``width`` (>= every count: see ``list_width``). Used for block-level masks ([B, H, QB, KB]) and
    per-block column selections ([B, H, QB, N]).
    """
    count = mask.sum(-1, dtype=torch.int32)
    width = list_width(count, width)
    # Selected ids keep their own value, unselected get K (past every id); sorting puts the selection first.
    size = mask.shape[-1]
    ids = torch.arange(size, device=mask.device, dtype=torch.int32).expand(mask.shape)
    keyed = torch.where(mask, ids, torch.full_like(ids, size))
    ordered = keyed.sort(dim=-1).values[..., :width]
    ordered = torch.where(ordered == size, torch.zeros_like(ordered), ordered)
    return count, ordered.contiguous()


def from_block_masks(
    full: torch.Tensor,
    partial: torch.Tensor,
    block_m: int,
    block_n: int,
    *,
    head_space: str = "query",
    columns: torch.Tensor | None = None,
    window: int = -1,
    sink: int = 0,
) -> BlockIndex:
    """Build an index from block-level masks.

    full, partial: bool [B, H, QB, KB] (disjoint); columns: bool [B, H, QB, N] token selection or None.
    Block-level masks are O(QB x KB), never token x token.
    """
    if full.shape != partial.shape:
        raise ValueError(f"full and partial masks differ in shape: {tuple(full.shape)} vs {tuple(partial.shape)}")
    if bool((full & partial).any()):
        raise ValueError("a block cannot be both full and partial")
    full_count, full_idx = pack_lists(full)
    partial_count, partial_idx = pack_lists(partial)
    col_count = col_idx = None
    if columns is not None:
        col_count, col_idx = pack_lists(columns)
    return BlockIndex(
        full_count, full_idx, partial_count, partial_idx, block_m, block_n, head_space,
        col_count, col_idx, window, sink,
    )


def select_q_blocks(index: BlockIndex, q_blocks: torch.Tensor) -> BlockIndex:
    """The index of the query blocks ``q_blocks`` (int64 [R], repeats allowed), in that order: [B, H, R, *]."""
    picked = {
        name: getattr(index, name).index_select(2, q_blocks)
        for name in ("full_count", "full_idx", "partial_count", "partial_idx", "col_count", "col_idx")
        if getattr(index, name) is not None
    }
    if index.col_table is not None:
        picked["col_table"] = index.col_table.map(lambda name, t: t if name == "ids" else t.index_select(2, q_blocks))
    return replace(index, **picked)


def to_block_masks(index: BlockIndex, kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``from_block_masks`` for the block part: (full, partial) bool [B, H, QB, KB]."""
    return _scatter(index.full_count, index.full_idx, kv_blocks), _scatter(index.partial_count, index.partial_idx, kv_blocks)


def to_column_mask(index: BlockIndex, kv_len: int) -> torch.Tensor:
    """Gathered columns as bool [B, H, QB, kv_len] (all False when the index has none)."""
    if index.col_count is None:
        return torch.zeros(*index.full_count.shape, kv_len, dtype=torch.bool, device=index.device)
    return _scatter(index.col_count, index.col_idx, kv_len)


def _scatter(count: torch.Tensor, idx: torch.Tensor, size: int) -> torch.Tensor:
    valid = torch.arange(idx.shape[-1], device=idx.device) < count.unsqueeze(-1)
    out = torch.zeros(*count.shape, size + 1, dtype=torch.bool, device=idx.device)
    # Invalid entries land in the spare slot `size`, which is dropped.
    target = torch.where(valid, idx.long().clamp(0, size), torch.full_like(idx, size, dtype=torch.long))
    out.scatter_(-1, target, True)
    return out[..., :size]


def validate(index: BlockIndex, q_lens: list[int] | int, kv_lens: list[int] | int | None = None) -> None:
    """Check bounds, sortedness, disjointness and causality of an index; raise ValueError naming the problem.

    For tests and debugging: it moves the index to the CPU and is O(B·H·QB·(F+P+C)).
    """
    batch = index.batch
    q_lens = [q_lens] * batch if isinstance(q_lens, int) else list(q_lens)
    kv_lens = q_lens if kv_lens is None else ([kv_lens] * batch if isinstance(kv_lens, int) else list(kv_lens))
    if len(q_lens) != batch or len(kv_lens) != batch:
        raise ValueError(f"need {batch} lengths, got {len(q_lens)} query and {len(kv_lens)} key lengths")
    cpu = index.to("cpu")
    lists = [("full", cpu.full_count, cpu.full_idx, cpu.block_n), ("partial", cpu.partial_count, cpu.partial_idx, cpu.block_n)]
    if cpu.col_count is not None:
        lists.append(("col", cpu.col_count, cpu.col_idx, 1))
    for b in range(batch):
        q_len, kv_len = q_lens[b], kv_lens[b]
        if q_len > kv_len:
            raise ValueError(f"sequence {b}: q_len {q_len} exceeds kv_len {kv_len}")
        q_blocks = num_blocks(q_len, cpu.block_m)
        if q_blocks > cpu.q_blocks:
            raise ValueError(f"sequence {b}: needs {q_blocks} query blocks, index has {cpu.q_blocks}")
        kv_blocks = num_blocks(kv_len, cpu.block_n)
        offset = kv_len - q_len
        for name, count, idx, unit in lists:
            for h in range(cpu.heads):
                for qb in range(q_blocks):
                    n = int(count[b, h, qb])
                    where = f"{name} list of (batch {b}, head {h}, q block {qb})"
                    if n < 0 or n > idx.shape[-1]:
                        raise ValueError(f"{where}: count {n} outside [0, {idx.shape[-1]}]")
                    ids = idx[b, h, qb, :n]
                    if n and bool((ids[1:] <= ids[:-1]).any()):
                        raise ValueError(f"{where}: ids not strictly ascending: {ids.tolist()}")
                    limit = kv_blocks if unit != 1 else kv_len
                    if n and (int(ids.min()) < 0 or int(ids.max()) >= limit):
                        raise ValueError(f"{where}: id out of range [0, {limit}): {ids.tolist()}")
                    last_pos = min(q_len, (qb + 1) * cpu.block_m) - 1 + offset
                    if n and name != "col" and int(ids.max()) * cpu.block_n > last_pos:
                        raise ValueError(f"{where}: block {int(ids.max())} lies wholly above the causal diagonal")
                    if n and name == "col" and int(ids.max()) > last_pos:
                        raise ValueError(f"{where}: column {int(ids.max())} lies above the causal diagonal")
                    if name == "full" and n:
                        first_pos = qb * cpu.block_m + offset
                        top = (int(ids.max()) + 1) * cpu.block_n - 1
                        if top > first_pos or top >= kv_len:
                            raise ValueError(
                                f"{where}: full block {int(ids.max())} needs a mask (causal or kv_len bound); "
                                "list it as partial"
                            )
                        if cpu.window >= 0:
                            # Every key of every full block must pass the window-or-sink test for every row: the
                            # keys some row rejects are [sink, last_pos - window], so a full block must miss them.
                            lowest = ids.long() * cpu.block_n
                            highest = lowest + cpu.block_n - 1
                            rejected_hi = last_pos - cpu.window
                            crosses = (highest >= cpu.sink) & (lowest <= rejected_hi) & (rejected_hi >= cpu.sink)
                            if bool(crosses.any()):
                                raise ValueError(f"{where}: a full block holds keys the window/sink mask rejects; list it as partial")
    full, partial = to_block_masks(cpu, max(1, max(num_blocks(k, cpu.block_n) for k in kv_lens)))
    if bool((full & partial).any()):
        raise ValueError("a key block is listed as both full and partial")
    if cpu.col_count is not None:
        cols = to_column_mask(cpu, max(kv_lens))
        covered = (full | partial).repeat_interleave(cpu.block_n, dim=-1)[..., : cols.shape[-1]]
        if bool((cols & covered).any()):
            raise ValueError("a gathered column lies inside a listed key block")
        if cpu.col_table is not None:
            _validate_table(cpu, cols, q_lens, kv_lens)


def _validate_table(index: BlockIndex, cols: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> None:
    """The column table names the column lists' keys (``cols``: bool [B, H, QB, N]), its ids ascend and
    lie in range, and its clean prefix and span hold."""
    table = index.col_table
    slots = table.ids.shape[-1]
    used = unpack_bits(table.bits, slots)  # [B, H, QB, V]
    s = torch.arange(slots)
    if bool((used & (s >= table.span[..., None])).any()):
        raise ValueError("col_table uses a slot at or past its span")
    for b in range(index.batch):
        ids = table.ids[b].long()  # [H, V]
        live = used[b].any(1)  # [H, V]: slots some block uses
        ascending = (ids[:, 1:] > ids[:, :-1]) | ~live[:, 1:]
        if bool((~ascending).any()) or bool(((ids < 0) | (ids >= kv_lens[b]))[live].any()):
            raise ValueError(f"sequence {b}: col_table ids must ascend and lie in [0, {kv_lens[b]}) where used")
        named = torch.zeros(*used.shape[1:3], kv_lens[b] + 1, dtype=torch.bool)
        named.scatter_(-1, torch.where(used[b], ids[:, None, :].clamp(0, kv_lens[b]), kv_lens[b]).expand_as(used[b]), True)
        if not torch.equal(named[..., : kv_lens[b]], cols[b, :, :, : kv_lens[b]]):
            raise ValueError(f"sequence {b}: col_table names other keys than the column lists")
        first_pos = torch.arange(index.q_blocks) * index.block_m + kv_lens[b] - q_lens[b]  # [QB]
        in_clean = s < table.clean[b][..., None]  # [H, QB, V]
        if bool((in_clean & ~(used[b] & (ids[:, None, :] <= first_pos[None, :, None]))).any()):
            raise ValueError(f"sequence {b}: col_table's clean prefix holds a slot that is unused or not causal for every row")


def stack(indices: list[BlockIndex], dim: int = 0) -> BlockIndex:
    """Stack indices along the batch (dim 0: each batch 1, e.g. one per varlen sequence) or the heads (dim 1:
    e.g. one build per KV head, when a whole-layer build would not fit in memory).

    Query blocks and list widths are padded to the largest; padded entries have count 0.
    """
    if not indices:
        raise ValueError("stack needs at least one index")
    if dim not in (0, 1):
        raise ValueError(f"stack dim must be 0 (batch) or 1 (heads), got {dim}")
    first = indices[0]
    other_dim = "heads" if dim == 0 else "batch"
    for other in indices[1:]:
        same = (other.block_m, other.block_n, other.head_space, getattr(other, other_dim), other.window, other.sink)
        if same != (first.block_m, first.block_n, first.head_space, getattr(first, other_dim), first.window, first.sink):
            raise ValueError(f"cannot stack indices with different blocks/{other_dim}/masks: {same}")
        if (other.col_count is None) != (first.col_count is None):
            raise ValueError("cannot stack indices with and without gathered columns")
    q_blocks = max(i.q_blocks for i in indices)

    def pad(t: torch.Tensor, width: int | None) -> torch.Tensor:
        shape = (t.shape[0], t.shape[1], q_blocks) + (() if width is None else (width,))
        out = torch.zeros(shape, dtype=t.dtype, device=t.device)
        if width is None:
            out[:, :, : t.shape[2]] = t
        else:
            out[:, :, : t.shape[2], : t.shape[3]] = t
        return out

    def cat(name: str, is_list: bool) -> torch.Tensor | None:
        if getattr(first, name) is None:
            return None
        width = max(getattr(i, name).shape[-1] for i in indices) if is_list else None
        return torch.cat([pad(getattr(i, name), width) for i in indices], dim=dim)

    return replace(
        first,
        full_count=cat("full_count", False), full_idx=cat("full_idx", True),
        partial_count=cat("partial_count", False), partial_idx=cat("partial_idx", True),
        col_count=cat("col_count", False), col_idx=cat("col_idx", True),
        col_table=_stack_tables([i.col_table for i in indices], pad, dim),
    )


def _stack_tables(tables: list[ColumnTable | None], pad, dim: int) -> ColumnTable | None:
    """The column tables of stacked indices, slots padded to the widest (unused: their bits are 0); None
    when any index has none (the column lists still hold every column)."""
    if any(t is None for t in tables):
        return None
    slots = max(t.ids.shape[-1] for t in tables)
    ids = torch.cat([torch.nn.functional.pad(t.ids, (0, slots - t.ids.shape[-1])) for t in tables], dim=dim)
    bits = torch.cat([pad(t.bits, -(-slots // 32)) for t in tables], dim=dim)
    return ColumnTable(ids, bits, *(torch.cat([pad(getattr(t, name), None) for t in tables], dim=dim) for name in ("clean", "span")))


def explicit_lines(index: BlockIndex, lines: GridLines) -> BlockIndex:
    """The index of a grid read by arithmetic (``GridLines``) with its vertical-line keys as explicit
    gathered columns (those inside a listed block left to the block): the same tokens for every row but
    the horizontal-line rows. For the torch backend and benchmarks: the columns cost [QB, lines] ids, which
    is what the kernel's arithmetic saves."""
    if lines.line_cols is None:
        return index
    count = lines.line_cols.long().to(index.device)
    ids = torch.arange(max(1, int(count.max())), device=index.device)
    keys = lines.col_phase + lines.stride * ids  # [W]
    kv_blocks = num_blocks(lines.kv_len, index.block_n)
    full, partial = to_block_masks(index, kv_blocks)
    listed = (full | partial)[..., torch.clamp(keys // index.block_n, max=kv_blocks - 1)]  # [B, H, QB, W]
    keep = (ids < count[:, None]) & ~listed
    col_count, slots = pack_lists(keep)
    col_idx = torch.where(torch.arange(slots.shape[-1], device=index.device) < col_count[..., None],
                          lines.col_phase + lines.stride * slots, 0).to(torch.int32)
    # Kernels read the three counts with one set of strides: materialise them alike.
    return replace(index, full_count=index.full_count.contiguous(), partial_count=index.partial_count.contiguous(),
                   col_count=col_count.contiguous(), col_idx=col_idx.contiguous())
