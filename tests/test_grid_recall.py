"""Recall of sparse patterns (reference.admitted_mass), per-row index masks, per-head index stacking, and the
grid-vs-vertical-slash benchmark on planted grid attention (benchmarks/grid_recall.py)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import grid_recall
from sparsesearch.index import select_q_blocks, stack, to_block_masks, to_column_mask
from sparsesearch.patterns import grid, vertical_slash
from sparsesearch.reference import admitted_mass, causal_mask_fn, index_mask_fn


def _qk(n: int = 96, heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, dim, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, generator=gen)
    return q, k


def test_admitted_mass_is_the_softmax_share_of_the_admitted_keys():
    q, k = _qk()
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    rows = torch.tensor([0, 5, 40, 95])
    keep = torch.rand(1, 4, rows.numel(), n, generator=torch.Generator().manual_seed(1)) < 0.3
    mass = admitted_mass(q, k, rows, lambda r: keep[:, :, (rows[:, None] == r[None, :]).nonzero()[:, 0]], chunk=3)
    scores = q[:, :, rows] @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.arange(n)[None, :] <= rows[:, None]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    expected = (probs * (keep & causal)).sum(-1)
    torch.testing.assert_close(mass, expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(admitted_mass(q, k, rows, causal_mask_fn(n, n)), torch.ones_like(mass))


def _vs_index(q, k, **kw):
    params = vertical_slash.VerticalSlashParams(vertical_size=12, slash_size=6, last_q=16, force_vertical=2, force_slash=2)
    return vertical_slash.build_index(params, q, k, head_space="kv", block_m=32, block_n=32, **kw)


def test_index_mask_fn_expands_only_the_rows_blocks():
    q, k = _qk()
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    index = _vs_index(q, k)
    rows = torch.tensor([3, 31, 32, 70, 95, 3])
    full, partial = to_block_masks(index, 3)
    columns = to_column_mask(index, n)
    blocks, keys = rows // 32, torch.arange(n) // 32
    expected = (full[:, :, blocks][..., keys] | partial[:, :, blocks][..., keys] | columns[:, :, blocks])
    expected = expected.repeat_interleave(group, 1) & (torch.arange(n)[None, :] <= rows[:, None])
    assert torch.equal(index_mask_fn(index, n, n, group=group)(rows), expected)
    picked = select_q_blocks(index, torch.tensor([2, 0, 2]))
    assert torch.equal(picked.full_count[0, :, 0], index.full_count[0, :, 2]) and picked.q_blocks == 3


def test_stack_over_heads_equals_the_whole_build():
    q, k = _qk()
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    whole = _vs_index(q, k)
    parts = [_vs_index(q[:, h * group: (h + 1) * group], k[:, h: h + 1]) for h in range(k.shape[1])]
    stacked = stack(parts, dim=1)
    assert stacked.heads == k.shape[1]
    rows = torch.arange(n)
    assert torch.equal(index_mask_fn(stacked, n, n, group=group)(rows), index_mask_fn(whole, n, n, group=group)(rows))
    with pytest.raises(ValueError, match="dim must be 0"):
        stack(parts, dim=2)
    with pytest.raises(ValueError, match="different blocks/batch"):
        stack([parts[0], stack(parts, dim=0)], dim=1)


def test_planted_grid_holds_its_mass_on_the_lines():
    n, p = 1024, grid.GridParams(stride=64, phase=3, use_hline=True, use_vline=True, local=128)
    q, k, _ = grid_recall.planted(n, p, heads=4, kv_heads=2, dim=64, band=8, seed=0, device="cpu", dtype=torch.float32)
    rows, weights = grid_recall.sample_rows(n, p, 16, seed=0)
    assert math.isclose(float(weights.sum()), 1.0, rel_tol=1e-6)
    assert ((rows[-4:] - p.phase) % p.stride == 0).all() and ((rows[:-4] - p.phase) % p.stride != 0).all()
    grid_mask = lambda r: grid.lines_mask(p, n, n, block_m=64, block_n=64, rows=r)[None, None]
    assert grid_recall.recall(q, k, rows, weights, grid_mask)["recall"] > 0.99
    # Half the vertical lines keep about half the line mass: the planting is what the recall sees.
    half = torch.zeros(n, dtype=torch.bool)
    half[p.phase:: 2 * p.stride] = True
    local = lambda r: (r[:, None] - torch.arange(n)[None, :] < p.local)
    half_mask = lambda r: (half[None, :] | local(r))[None, None]
    assert grid_recall.recall(q, k, rows, weights, half_mask)["recall"] < 0.7


def test_benchmark_smoke_run(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = grid_recall.parse_args(["--quick", "--cases", "grid_v", "--out", str(out)])
    rows = grid_recall.run(args)
    assert len(rows) == 1 and out.read_text().count("\n") == 1
    row = rows[0]
    assert row["grid"]["recall"] > 0.99 and row["grid"]["density"] < 0.5
    assert len(row["vs_ladder"]) >= 3 and {"recall", "density", "vertical", "slash"} <= set(row["vs_ladder"][0])
    assert row["vs"]["t_ms"] > 0 and row["grid"]["t_ms"] > 0
    assert row["equal_recall"] == any(s["recall"] >= row["grid"]["recall"] - args.tolerance for s in row["vs_ladder"])
