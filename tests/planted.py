"""Planted heads for the search (issue 13): q/k/v built so each head's attention follows a known pattern.

Every head is built from exact feature families in its own coordinates of a D-dim head (no learned
weights, no randomness in what the head attends to, random V):

* flags:      k_j[f] = 1 for a chosen key set, q_i[f] = beta for the rows that love it -> those rows put
              logit beta * scale on the flagged keys (sinks, vertical lines, grid lines);
* positional: q_i, k_j = amp * (cos, sin)(w * pos) over a band of frequencies; q_i . k_j depends only on
              i - j: a smooth local band (low frequencies) or a sharp slash at offset d (k shifted by d,
              frequencies up to pi);
* one-hot blocks: k rows of key block b = e_b, q rows of query block m = beta * e_{t(m)} -> block m attends
              uniformly to key block t(m) (block top-k);
* zero rows:  q_i = 0 -> uniform attention over the row's causal prefix (grid horizontal lines, the
              triangle's last rows, dense-like heads).

A KV head is built with its GQA group of query heads (``kv_head``): the group shares k and v, the query
heads may differ (block top-k groups whose heads want different blocks). ``layer`` stacks KV heads into
q [1, Hq, N, D], k/v [1, Hkv, N, D]. ``spans`` and ``boundary_targets`` plant the multi-modality layouts
of the boundary types (one-hot keys, as tests/planted_boundary.py, but any layout and seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

DIM = 128
BETA = 12.0 * math.sqrt(DIM)  # flag logit 12 after the 1/sqrt(D) scale: e^12 ~ 1.6e5 plain keys


@dataclass
class Head:
    """One query head's planted features: q [N, D] and the keys it needs (k [N, D], shared in a group)."""

    kind: str
    q: torch.Tensor
    k: torch.Tensor
    truth: dict = field(default_factory=dict)


def _freqs(lo: float, hi: float, count: int) -> torch.Tensor:
    return torch.logspace(math.log10(lo), math.log10(hi), count)


def positional(n: int, amp: float, lo: float, hi: float, count: int, shift: int = 0, spread: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [N, 2 * count]: q_i . k_j = amp^2 * sum_w cos(w * (i - j - shift)), peaked at i - j = shift.
    Frequencies log-spaced in [lo, hi], or (spread) spaced evenly and jittered (a fixed generator) so that
    the sum has no second peak: a sharp slash line."""
    if spread:
        gen = torch.Generator().manual_seed(count)
        w = ((torch.arange(count) + torch.rand(count, generator=gen)) / count * (hi - lo) + lo)[None, :]
    else:
        w = _freqs(lo, hi, count)[None, :]
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    q = torch.cat([torch.cos(pos * w), torch.sin(pos * w)], 1) * amp
    k = torch.cat([torch.cos((pos + shift) * w), torch.sin((pos + shift) * w)], 1) * amp
    return q, k


def _local(n: int, width: int, amp: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A local band about ``width`` tokens wide: 16 dims, frequencies spread evenly in [0.5, 1.5] / width
    (jittered) so the far aliases stay low."""
    return positional(n, amp=amp, lo=0.5 / width, hi=1.5 / width, count=8, spread=True)


def ashape(n: int, sink: int, width: int) -> Head:
    """Sink keys [0, sink) plus a local band: what A-shape(sink, local ~ 2 width) holds."""
    q, k = torch.zeros(n, DIM), torch.zeros(n, DIM)
    q[:, 0], k[:sink, 0] = BETA * 0.45, 1.0
    q[:, 8:24], k[:, 8:24] = _local(n, width)
    return Head("ashape", q, k, {"sink": sink, "width": width})


def vertical_slash(n: int, verticals: list[int], slashes: list[int], *, amp: float = 2.0, flag: float = 0.75) -> Head:
    """Vertical lines at ``verticals`` and sharp slash lines at offsets ``slashes`` (far ones included).
    Logits: flag x 12 on the verticals, amp^2 x 24 / sqrt(D) at a slash's peak (8.5 at the defaults)."""
    q, k = torch.zeros(n, DIM), torch.zeros(n, DIM)
    q[:, 0] = BETA * flag
    k[verticals, 0] = 1.0
    for s, offset in enumerate(slashes[:2]):  # 48 dims each: a sharp line (no alias above ~1/2 the peak)
        qs, ks = positional(n, amp=amp, lo=0.1, hi=3.1, count=24, shift=offset, spread=True)
        q[:, 8 + 48 * s: 56 + 48 * s], k[:, 8 + 48 * s: 56 + 48 * s] = qs, ks
    return Head("vertical_slash", q, k, {"verticals": verticals, "slashes": slashes})


def exact_vertical_slash(n: int, verticals: list[int], slashes: list[int]) -> Head:
    """``vertical_slash`` whose lines hold all but ~1e-4 of every row's mass: vertical logit 19.2, slash
    peaks 19.1 (amp 3), while the other keys' logits spread with std ~4 (the other slash's cosines), far
    below. A vertical-slash index that keeps the lines errs by ~1e-4; whatever else a budget buys holds
    nothing."""
    return vertical_slash(n, verticals, slashes, amp=3.0, flag=1.6)


def block_targets(n: int, block: int, gen: torch.Generator) -> list[int]:
    """A causal target key block t(m) < m for every query block m >= 2 (m < 2: its own diagonal)."""
    blocks = (n + block - 1) // block
    return [m if m < 2 else int(torch.randint(1, m, (1,), generator=gen)) for m in range(blocks)]


def block_topk(n: int, block: int, targets: list[int]) -> Head:
    """Query block m attends uniformly to key block targets[m] (one-hot block codes, D >= blocks)."""
    blocks = (n + block - 1) // block
    if blocks > DIM:
        raise ValueError(f"{blocks} blocks need head_dim >= {blocks}, have {DIM}")
    ids = torch.arange(n) // block
    k = torch.nn.functional.one_hot(ids, DIM).float()
    q = BETA * 0.5 * torch.nn.functional.one_hot(torch.tensor(targets)[ids], DIM).float()
    return Head("block_topk", q, k, {"targets": targets, "block": block})


def block_topk_group(n: int, block: int, group: int, gen: torch.Generator) -> list[Head]:
    """A GQA group of block top-k heads that want different blocks and avoid each other's: head h's rows
    in block m score +beta/2 on its own target and -beta/2 on every other head's target (which it never
    attends). Summing raw pooled scores over the group cancels the targets; each head's own attention
    is as sharp as a lone head's."""
    targets = [block_targets(n, block, gen) for _ in range(group)]
    heads = [block_topk(n, block, t) for t in targets]
    ids = torch.arange(n) // block
    for h, head in enumerate(heads):
        for other in range(group):
            if other != h:
                theirs = torch.tensor(targets[other])[ids]
                away = (theirs != torch.tensor(targets[h])[ids]).float()[:, None]
                head.q -= away * BETA * 0.5 * torch.nn.functional.one_hot(theirs, DIM).float()
    return heads


def grid(n: int, stride: int, phase: int, *, hline: bool = True) -> Head:
    """Vertical lines at keys j % stride == phase, rows on the grid (i % stride == phase) uniform when
    ``hline`` (horizontal lines), and a narrow local band."""
    q, k = torch.zeros(n, DIM), torch.zeros(n, DIM)
    q[:, 0], k[phase::stride, 0] = BETA, 1.0
    q[:, 8:24], k[:, 8:24] = _local(n, 8, amp=3.0)  # peak ~6 nats: the lines (~10) hold most of the mass
    if hline:
        q[phase::stride] = 0.0
    return Head("grid", q, k, {"stride": stride, "phase": phase, "hline": hline})


def grid_in_video(n_text: int, n_video: int, stride: int, phase: int, *, flag: float = 0.5, noise: float = 0.3,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One head on text | video | text spans (n_text, n_video, n_text tokens): inside the video span a grid
    head of its own frame (``grid``, lines at logit flag x 12), everywhere random q, k of std ``noise`` so
    that every row also spreads mass the lines do not hold (the planted grid's lines form errs by ~0.15
    at the defaults, its block cover, a superset, by ~0). Returns q, k, v [1, 1, N, D] and modality ids
    [N] (0 text, 2 video)."""
    gen = torch.Generator().manual_seed(seed)
    head = grid(n_video, stride, phase)
    n = 2 * n_text + n_video
    q, k = torch.randn(n, DIM, generator=gen) * noise, torch.randn(n, DIM, generator=gen) * noise
    video = slice(n_text, n_text + n_video)
    q[video] += head.q * torch.tensor([flag] + [1.0] * (DIM - 1))  # the line flag weakened, the band kept
    k[video] += head.k
    modality = torch.tensor([TEXT] * n_text + [VIDEO] * n_video + [TEXT] * n_text)
    return q[None, None].contiguous(), k[None, None].contiguous(), torch.randn(1, 1, n, DIM, generator=gen), modality


def triangle(n: int, sink: int, width: int, last: int) -> Head:
    """A-shape rows, then the last ``last`` rows attend uniformly to their whole prefix."""
    head = ashape(n, sink, width)
    head.q[n - last:] = 0.0
    return Head("triangle", head.q, head.k, {"sink": sink, "width": width, "last": last})


def dense_like(n: int, gen: torch.Generator) -> Head:
    """Attention spread wide and scattered: random q, k with logits ~ N(0, 4), so every row puts its
    mass on its own few hundred keys anywhere in its prefix; no sink + window, handful of lines or
    block choice per query block holds them."""
    return Head("dense", torch.randn(n, DIM, generator=gen) * 2.0, torch.randn(n, DIM, generator=gen) * 2.0)


def layer(kv_heads: list[list[Head]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, Hq, N, D], k/v [1, Hkv, N, D] from KV heads, each a list of its group's query heads (which
    must share k: the first head's k is used). V is random normal."""
    gen = torch.Generator().manual_seed(seed + 1000)
    group = len(kv_heads[0])
    if any(len(g) != group for g in kv_heads):
        raise ValueError("every KV head needs the same number of query heads")
    q = torch.stack([h.q for g in kv_heads for h in g])[None]
    k = torch.stack([g[0].k for g in kv_heads])[None]
    v = torch.randn(k.shape, generator=gen)
    return q.contiguous(), k.contiguous(), v


# ------------------------------------------------------------------------------ modality layouts

TEXT, VIDEO = 0, 2


def spans(seed: int, n: int = 256, min_len: int = 16) -> list[tuple[int, int]]:
    """An alternating text/video layout of n tokens starting and ending with text, span lengths random
    (>= min_len, not block multiples in general)."""
    gen = torch.Generator().manual_seed(seed)
    count = 7
    cuts = sorted(int(x) for x in torch.randperm(n // min_len - 1, generator=gen)[: count - 1] + 1)
    edges = [0] + [c * min_len + int(torch.randint(-3, 4, (1,), generator=gen)) for c in cuts] + [n]
    lengths = [b - a for a, b in zip(edges, edges[1:])]
    return [(TEXT if i % 2 == 0 else VIDEO, length) for i, length in enumerate(lengths)]


def modality(layout: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.full((length,), m, dtype=torch.long) for m, length in layout])


def boundary_targets(kind: str, layout: list[tuple[int, int]], sink: int = 4, local: int = 8) -> list[set[int]]:
    """Target key sets per row for a head of boundary type ``kind`` on ``layout``:
    none: sink + last ``local`` positions; k: sink + last ``local`` video tokens (key-permuted frame);
    q: text rows sink + 4 verticals in the first text span, video rows sink + 4 in the first video span;
    2d: video rows as k, text rows sink + the video verticals."""
    mod = modality(layout)
    n = mod.numel()
    video_pos = (mod == VIDEO).nonzero().flatten().tolist()
    text_pos = (mod == TEXT).nonzero().flatten().tolist()
    v_text = [p for p in text_pos if p >= sink][:: max(1, len(text_pos) // 16)][:4]
    v_video = video_pos[2::5][:4]
    rows = []
    for i in range(n):
        base = set(range(min(sink, i + 1)))
        recent_video = {j for j in video_pos if j <= i}
        recent_video = set(sorted(recent_video)[-local:])
        if kind == "none":
            rows.append(base | set(range(max(0, i - local + 1), i + 1)))
        elif kind == "k":
            rows.append(base | recent_video)
        elif kind == "q":
            rows.append(base | {j for j in (v_text if mod[i] == TEXT else v_video) if j <= i})
        else:
            rows.append(base | (recent_video if mod[i] == VIDEO else {j for j in v_video if j <= i}))
    return rows


def plant_targets(heads: list[list[set[int]]], seed: int = 0, beta: float = 12.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-hot keys (head_dim = N): q [1, H, N, N] puts logit beta on each row's targets, k = identity,
    v random [1, H, N, N]; run with scale 1."""
    gen = torch.Generator().manual_seed(seed)
    n = len(heads[0])
    q = torch.zeros(1, len(heads), n, n)
    for h, rows in enumerate(heads):
        for i, keys in enumerate(rows):
            q[0, h, i, sorted(keys)] = beta
    k = torch.eye(n).expand(1, len(heads), n, n).contiguous()
    return q, k, torch.randn(1, len(heads), n, n, generator=gen)
