"""Permutations read in place (issue 14; paper 000 Alg. 1-3, 5-7): the block-sparse kernel and its torch
twin take int32 row/column maps (Q/K/2D-boundary regions) or a grid's stride/phase as index arithmetic
(index.GridLines), so both run on the whole Q/K/V with outputs written in original positions.

References are masks built from the definitions in original positions (region frame -> original rows and
keys; the grid's band blocks, line columns and line rows), run by the oracle on the unpermuted tensors; the
gathered-copy path is a second, independent check. Inputs: multi-span layouts with odd span lengths,
GQA 4:2, batch 2, fp32 everywhere and bf16 through the Triton interpreter.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from conftest import DEVICE
from sparsesearch.execute import HeadGroup, attend_boundary, build_group_index, run_region
from sparsesearch.index import BlockIndex, explicit_lines
from sparsesearch.kernels import block_sparse_attention, region_maps
from sparsesearch.kernels.region_runs import fold_runs
from sparsesearch.kernels.torch_sparse import block_sparse_attention_torch
from sparsesearch.patterns import ashape, boundary, dense, grid, vertical_slash
from sparsesearch.reference import error_floor, index_mask_fn, masked_attention, pool_mask, predicate_mask_fn, relative_error
from sparsesearch.runtime.plan import LayerPlan, Plan
from sparsesearch.runtime.run import Runner

NAMES = ("text", "image", "video")
SCALE = 0.125
# Fragmented video/text (and one image span), odd lengths, text first so every row sees a key.
LAYOUT = [(0, 13), (2, 37), (0, 9), (1, 21), (2, 45), (0, 27), (2, 11), (0, 15)]
# A shorter fragmented layout for the interpreter (4 regions of two modalities, odd spans).
SMALL = [(0, 13), (2, 21), (0, 9), (2, 17), (0, 7)]
BACKENDS = {"torch": block_sparse_attention_torch, "triton": block_sparse_attention}


def layout_ids(layout=LAYOUT) -> torch.Tensor:
    return torch.cat([torch.full((n,), m, dtype=torch.long) for m, n in layout])


def qkv(n: int, batch: int = 2, q_heads: int = 4, kv_heads: int = 2, dim: int = 64, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, h, n, dim, generator=gen).to(DEVICE, dtype) for h in (q_heads, kv_heads, kv_heads))


def tolerance(out_low: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the low-precision oracle's own error plus the dtype floor (STYLE.md habit 4)."""
    return 2 * relative_error(out_low, ref) + error_floor(dtype, DEVICE)


# --------------------------------------------------------------------------------- region definitions


def region_frame_mask(region: boundary.Region, pattern: str, params) -> torch.Tensor:
    """bool [Nq_r, Nk_r]: the pattern's definition in the region frame (patterns/boundary.py): row i admits
    key j <= row_pos[i]; A-shape keeps the first `sink` keys and the `local` keys behind the frontier."""
    nq, nk = region.q_idx.numel(), region.k_idx.numel()
    frontier = region.row_pos if region.row_pos is not None else torch.arange(nq)
    j = torch.arange(nk)[None, :]
    f = frontier.cpu()[:, None]
    causal = j <= f
    if pattern == "dense":
        return causal
    if pattern == "ashape":
        return causal & ((j < params.sink) | (f - j < params.local))
    raise AssertionError(pattern)


def original_mask(region: boundary.Region, frame_mask: torch.Tensor, n: int) -> torch.Tensor:
    """[Nq_r, Nk_r] region-frame mask -> [Nq_r, n] over original keys, also asserting that it is causal by
    original position (the property the region frame promises)."""
    full = torch.zeros(frame_mask.shape[0], n, dtype=torch.bool)
    full[:, region.k_idx.cpu()] = frame_mask
    assert not bool((full & (torch.arange(n)[None, :] > region.q_idx.cpu()[:, None])).any())
    return full


def oracle_rows(q, k, v, rows: torch.Tensor, mask: torch.Tensor, upcast: bool = True):
    """The oracle over the region's rows of the whole q and every original key: mask [len(rows), N] or
    [B, Hq, len(rows), N]."""
    m = mask.to(q.device)
    m = m if m.dim() == 4 else m[None, None]
    return masked_attention(q[:, :, rows.to(q.device)], k, v, lambda r: m[..., r.cpu(), :], scale=SCALE, upcast=upcast)


def run_mapped(fn, q, k, v, index, region, full_out: bool):
    """One launch reading the region in place; full_out: out/lse of the whole q (written at row_map)."""
    maps = region.maps(q.device, q.shape[2])
    if not full_out:
        return fn(q, k, v, index, scale=SCALE, maps=maps)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    fn(q, k, v, index, scale=SCALE, maps=maps, out=out, lse=lse)
    rows = region.q_idx.to(q.device)
    untouched = torch.ones(q.shape[2], dtype=torch.bool, device=q.device)
    untouched[rows] = False
    assert bool(out[:, :, untouched].isnan().all()), "a launch wrote rows outside its region"
    return out[:, :, rows], lse[:, :, rows]


@pytest.mark.parametrize("kind", ["q", "k", "2d"])
@pytest.mark.parametrize("pattern, params", [("dense", dense.DenseParams()), ("ashape", ashape.AShapeParams(sink=5, local=19))],
                         ids=["dense", "ashape"])
def test_torch_backend_reads_regions_in_place_like_their_definition(kind, pattern, params):
    """Every region of every boundary type, compact and in-place outputs, against the oracle on the mask
    built from the pattern's definition in the region frame (batch 2, GQA, odd spans)."""
    ids = layout_ids()
    n = ids.numel()
    q, k, v = qkv(n)
    for region in boundary.regions(kind, ids.to(DEVICE), NAMES):
        index = _static_region_index(pattern, params, region, batch=2)
        ref, ref_lse = oracle_rows(q, k, v, region.q_idx, original_mask(region, region_frame_mask(region, pattern, params), n))
        for full_out in (False, True):
            out, lse = run_mapped(block_sparse_attention_torch, q, k, v, index, region, full_out)
            assert relative_error(out, ref) < 1e-5, (region.name, full_out)
            assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), region.name


def _static_region_index(pattern, params, region, batch: int):
    module = {"dense": dense, "ashape": ashape}[pattern]
    return module.build_index(params, region.q_idx.numel(), region.k_idx.numel(), batch=batch, heads=2, block_m=16,
                              block_n=16, head_space="kv", device=DEVICE, row_pos=region.row_pos)


@pytest.mark.parametrize("dtype, kind", [(torch.float32, "q"), (torch.float32, "k"), (torch.float32, "2d"), (torch.bfloat16, "2d")],
                         ids=["fp32-q", "fp32-k", "fp32-2d", "bf16-2d"])
def test_triton_kernel_reads_regions_in_place(dtype, kind):
    """The Triton kernel with row/col maps (interpreter on CPU) on the regions of a fragmented layout:
    A-shape from its definition; vertical-slash (estimated from the region's own last queries) against
    its index's token mask mapped to original positions and against the gathered-copy launch."""
    ids = layout_ids(SMALL)
    n = ids.numel()
    q, k, v = qkv(n, dtype=dtype)
    a_params = ashape.AShapeParams(sink=5, local=19)
    vs_params = vertical_slash.VerticalSlashParams(vertical_size=9, slash_size=5, last_q=16, force_vertical=2, force_slash=2)
    for region in boundary.regions(kind, ids.to(DEVICE), NAMES):
        index = _static_region_index("ashape", a_params, region, batch=2)
        mask = original_mask(region, region_frame_mask(region, "ashape", a_params), n)
        ref, ref_lse = oracle_rows(q, k, v, region.q_idx, mask)
        low, _ = oracle_rows(q, k, v, region.q_idx, mask, upcast=False)
        out, lse = run_mapped(block_sparse_attention, q, k, v, index, region, full_out=True)
        assert relative_error(out, ref) <= tolerance(low, ref, dtype), region.name
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), region.name
        if kind != "2d":
            continue  # the dynamic pattern once per dtype: its region frames are the 2D ones
        q_r, k_r, v_r = region.gather(q, k, v)
        row_pos = None if region.row_pos is None else region.row_pos.to(DEVICE)
        vs = build_group_index(HeadGroup("vertical_slash", vs_params, (0, 1), 16, 16), q_r, k_r, "kv", row_pos)
        frame = index_mask_fn(vs, q_r.shape[2], k_r.shape[2], group=2, row_pos=row_pos)(torch.arange(q_r.shape[2], device=DEVICE))
        full = torch.zeros(*frame.shape[:3], n, dtype=torch.bool)
        full[..., region.k_idx.cpu()] = frame.cpu()
        ref, _ = oracle_rows(q, k, v, region.q_idx, full)
        low, _ = oracle_rows(q, k, v, region.q_idx, full, upcast=False)
        out, _ = run_mapped(block_sparse_attention, q, k, v, vs, region, full_out=False)
        gathered, _ = block_sparse_attention(q_r, k_r, v_r, vs, scale=SCALE, row_pos=row_pos)
        assert relative_error(out, ref) <= tolerance(low, ref, dtype), region.name
        # Every tile gathered through the map: same tiles, same order, so only addresses change.
        maps = dataclasses.replace(region.maps(q.device, n), increasing=False)
        tiles, _ = block_sparse_attention(q, k, v, vs, scale=SCALE, maps=maps)
        assert torch.equal(tiles, gathered), region.name
        # Runs folded into plain slabs: blocks that straddle a gap move to the partial list (another
        # summation order), so equal within the kernel's own rounding.
        assert relative_error(out, gathered) <= tolerance(low, ref, dtype), region.name


def test_regions_at_128_rows_per_program_take_narrow_partial_tiles():
    """64 x 64 blocks of a kv-space index with a GQA group of 2: two heads stacked, 128 rows per program, so a
    region's partial blocks go in half-width tiles (PART_TILE; 64-wide ones spilled registers on an H200). The
    regions of a long fragmented layout, in place and on gathered copies (row_pos), against the definition."""
    ids = layout_ids([(0, 70), (2, 150), (0, 45), (2, 130), (0, 60)])
    n = ids.numel()
    q, k, v = qkv(n, batch=1)
    params = ashape.AShapeParams(sink=20, local=90)
    for region in boundary.regions("2d", ids.to(DEVICE), NAMES):
        index = ashape.build_index(params, region.q_idx.numel(), region.k_idx.numel(), heads=2, block_m=64, block_n=64,
                                   head_space="kv", device=DEVICE, row_pos=region.row_pos)
        assert int(index.partial_count.sum()) > 0
        ref, _ = oracle_rows(q, k, v, region.q_idx, original_mask(region, region_frame_mask(region, "ashape", params), n))
        low, _ = oracle_rows(q, k, v, region.q_idx, original_mask(region, region_frame_mask(region, "ashape", params), n), upcast=False)
        out, _ = run_mapped(block_sparse_attention, q, k, v, index, region, full_out=False)
        assert relative_error(out, ref) <= tolerance(low, ref, torch.float32), region.name
        row_pos = None if region.row_pos is None else region.row_pos.to(DEVICE)
        copies, _ = block_sparse_attention(*region.gather(q, k, v), index, scale=SCALE, row_pos=row_pos)
        assert relative_error(copies, ref) <= tolerance(low, ref, torch.float32), region.name


# ------------------------------------------------------------------------------------------- executor


def _groups(pattern, params, heads=(0, 1)):
    return lambda scope: (HeadGroup(pattern, params, heads, 16, 16),)


@pytest.mark.parametrize("kind", ["q", "k", "2d"])
def test_attend_boundary_in_place_equals_the_gathered_composition(kind):
    """The runtime's boundary path (no gathered copies; Q-boundary writing out directly) against regions
    run on gathered copies and composed by lse — and against the definition for a dense pattern."""
    ids = layout_ids()
    n = ids.numel()
    q, k, v = (t[:1] for t in qkv(n))
    params = ashape.AShapeParams(sink=5, local=19)
    out = torch.full_like(q, float("nan"))
    done = attend_boundary(((0, kind), (1, kind)), _groups("ashape", params), q, k, v, ids, "kv", SCALE, out)
    assert done == {0, 1}
    parts = []
    for region in boundary.regions(kind, ids.to(DEVICE), NAMES):
        q_r, k_r, v_r = region.gather(q, k, v)
        index = build_group_index(HeadGroup("ashape", params, (0, 1), 16, 16), q_r, k_r, "kv", region.row_pos)
        o, l = block_sparse_attention_torch(q_r, k_r, v_r, index, scale=SCALE, row_pos=region.row_pos)
        parts.append((region, o, l))
    composed, _ = boundary.compose(parts, n)
    floor = error_floor(torch.float32, DEVICE)  # the runtime's path is the Triton kernel on a GPU (TF32 dots)
    assert relative_error(out, composed) < floor
    dense_out = torch.full_like(q, float("nan"))
    attend_boundary(((0, kind), (1, kind)), _groups("dense", dense.DenseParams()), q, k, v, ids, "kv", SCALE, dense_out)
    ref, _ = masked_attention(q, k, v, scale=SCALE)  # dense regions compose to causal attention
    assert relative_error(dense_out, ref) < floor


def test_run_region_leaves_the_inputs_alone_and_returns_region_rows():
    ids = layout_ids()
    q, k, v = (t[:1] for t in qkv(ids.numel()))
    before = [t.clone() for t in (q, k, v)]
    region = boundary.make_region("video", "text", boundary.positions(ids, NAMES))
    out, lse = run_region(q, k, v, region, [HeadGroup("dense", dense.DenseParams(), (1,), 16, 16)], "kv", SCALE)
    assert out.shape == (1, 4, region.q_idx.numel(), 64) and lse.shape == (1, 4, region.q_idx.numel())
    assert bool(torch.isinf(lse[:, :2]).all()) and not bool(torch.isinf(lse[:, 2:]).all())  # head 0 unserved
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


# ----------------------------------------------------------------------------------------------- grid

GRIDS = [
    (150, 150, grid.GridParams(stride=7, phase=3, local=20)),
    (97, 131, grid.GridParams(stride=5, phase=0, use_slash=True, local=9)),
    (203, 203, grid.GridParams(stride=16, phase=5, use_hline=False, local=16)),
    (120, 160, grid.GridParams(stride=24, phase=11, use_vline=False, local=30)),
]
GRID_IDS = ["hv", "hvs-offset", "v-only", "h-only-offset"]


@pytest.mark.parametrize("q_len, kv_len, params", GRIDS, ids=GRID_IDS)
def test_lines_cover_holds_the_predicate_and_computes_less_than_the_plain_cover(q_len, kv_len, params):
    """Attention-gym style: predicate -> dense mask; the tokens the grid read in place computes (listed
    blocks, line columns, line rows) hold every admitted token; full blocks need no mask; and without slash
    lines it computes fewer tokens than the plain block cover (the point of reading the lines apart)."""
    bm = bn = 16
    pred = predicate_mask_fn(grid.predicate(params), 1, 1, q_len, kv_len)(torch.arange(q_len))[0, 0]
    tokens = grid.lines_mask(params, q_len, kv_len, block_m=bm, block_n=bn)
    assert not bool((pred & ~tokens).any())
    hit, is_full, line_cols, lines = grid.lines_cover(params, q_len, kv_len, bm, bn)
    p0 = torch.arange(hit.shape[0]) * bm + kv_len - q_len
    for qb, kb in is_full.nonzero().tolist():
        assert (kb + 1) * bn - 1 <= int(p0[qb]) and (kb + 1) * bn <= kv_len
        # no full block below the band holds a line key the columns also read
        assert int(line_cols[qb]) == 0 or kb * bn > params.phase + params.stride * (int(line_cols[qb]) - 1)
    # line columns stop below every row of their block: causal with no mask
    assert bool((params.phase + params.stride * (line_cols - 1) < p0).all() | (line_cols == 0).all())
    assert lines.row_lines == (int(((torch.arange(q_len) + kv_len - q_len) % params.stride == params.phase).sum()) if params.use_hline else 0)
    plain = grid.build_index(params, q_len, kv_len, block_m=bm, block_n=bn)
    plain_tokens = index_mask_fn(plain, q_len, kv_len)(torch.arange(q_len))[0, 0]
    if not params.use_slash:
        assert int(tokens.sum()) < int(plain_tokens.sum())


@pytest.mark.parametrize("q_len, kv_len, params", GRIDS, ids=GRID_IDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grid_lines_in_kernel_equal_their_definition(q_len, kv_len, params, backend):
    """Batch 2, GQA 4:2, outputs in original positions, against the oracle on the grid's token mask; the
    same launch for one KV head of two writes that head's query heads and nothing else."""
    q, k, v = (t[..., :q_len, :] if i == 0 else t for i, t in enumerate(qkv(kv_len)))
    q = q.contiguous()
    index, lines = grid.build_lines_index(params, q_len, kv_len, batch=2, heads=2, block_m=16, block_n=16,
                                          head_space="kv", device=DEVICE)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    BACKENDS[backend](q, k, v, index, scale=SCALE, lines=lines, out=out, lse=lse)
    mask = grid.lines_mask(params, q_len, kv_len, block_m=16, block_n=16).to(DEVICE)
    ref, ref_lse = masked_attention(q, k, v, lambda r: mask[r][None, None], scale=SCALE)
    # fp32 dots run as TF32 in the Triton kernel on a GPU; the torch twin and the interpreter stay fp32.
    tol = 1e-5 if backend == "torch" else error_floor(torch.float32, DEVICE)
    assert relative_error(out, ref) < tol and float((lse - ref_lse).abs().max()) < 10 * tol
    one = grid.build_lines_index(params, q_len, kv_len, batch=2, heads=1, block_m=16, block_n=16, head_space="kv", device=DEVICE)[0]
    out = torch.full_like(q, float("nan"))
    BACKENDS[backend](q, k, v, one, scale=SCALE, lines=lines, heads=torch.tensor([1], dtype=torch.int32, device=DEVICE),
                      out=out, lse=torch.empty_like(lse))
    assert bool(out[:, :2].isnan().all()) and relative_error(out[:, 2:], ref[:, 2:]) < tol


def test_grid_lines_at_128_rows_per_program():
    """64-row blocks over a GQA group of 2: two heads per program (128 rows), so the strided line columns go in
    half-width tiles; a ragged count of line keys per block still equals the oracle."""
    params = grid.GridParams(stride=3, phase=1, local=40)
    q, k, v = qkv(400)
    index, lines = grid.build_lines_index(params, 400, 400, batch=2, heads=2, block_m=64, block_n=64, head_space="kv", device=DEVICE)
    assert int(lines.line_cols.max()) > 64  # more than two 32-wide tiles of line columns in some block
    out, lse = block_sparse_attention(q, k, v, index, scale=SCALE, lines=lines)
    mask = grid.lines_mask(params, 400, 400, block_m=64, block_n=64).to(DEVICE)
    ref, ref_lse = masked_attention(q, k, v, lambda r: mask[r][None, None], scale=SCALE)
    tol = error_floor(torch.float32, DEVICE)
    assert relative_error(out, ref) < tol and float((lse - ref_lse).abs().max()) < 10 * tol


def test_grid_lines_bf16_in_the_interpreter_and_the_explicit_columns_agree():
    """bf16 against the oracle; and the same index with its line columns as explicit gathered ids
    (index.explicit_lines, the plain kernel's column path) gives the same rows but the line rows."""
    params = GRIDS[0][2]
    q, k, v = qkv(150, dtype=torch.bfloat16)
    index, lines = grid.build_lines_index(params, 150, 150, batch=2, heads=2, block_m=16, block_n=16, head_space="kv", device=DEVICE)
    out, _ = block_sparse_attention(q, k, v, index, scale=SCALE, lines=lines)
    mask = grid.lines_mask(params, 150, 150, block_m=16, block_n=16).to(DEVICE)
    ref, _ = masked_attention(q, k, v, lambda r: mask[r][None, None], scale=SCALE)
    low, _ = masked_attention(q, k, v, lambda r: mask[r][None, None], scale=SCALE, upcast=False)
    assert relative_error(out, ref) <= tolerance(low, ref, torch.bfloat16)
    explicit, _ = block_sparse_attention(q, k, v, explicit_lines(index, lines), scale=SCALE)
    keep = ~lines.is_line_row(torch.arange(150, device=DEVICE))
    assert torch.equal(out[:, :, keep], explicit[:, :, keep])


def planted_grid(n: int, stride: int, phase: int, dim: int = 64, seed: int = 0):
    """q/k/v [1, 2, n, dim] / [1, 1, n, dim] whose keys on the line (j % stride == phase) share a direction
    every query points at: a vertical grid line the last queries see."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n, dim, generator=gen) * 0.1
    k = torch.randn(1, 1, n, dim, generator=gen) * 0.1
    v = torch.randn(1, 1, n, dim, generator=gen)
    q[..., 0] = 8.0  # logit 8 at scale 1/8 on every line key: the lines hold nearly all the mass
    k[:, :, phase::stride, 0] = 8.0
    return q, k, v


def test_planted_grid_search_recovers_stride_phase_and_the_lines_run_matches_the_gathered_one():
    n, stride, phase = 240, 12, 5
    q, k, v = planted_grid(n, stride, phase)
    found, ph, _ = grid.estimate_stride_phase(q, k, [6, 8, 12, 16, 24], last_q=32, head_space="kv")
    assert int(found.item()) == stride and int(ph.item()) == phase
    params = grid.GridParams(stride=stride, phase=phase, use_hline=False, local=16)
    index, lines = grid.build_lines_index(params, n, n, heads=1, block_m=16, block_n=16, head_space="kv")
    out, _ = block_sparse_attention_torch(q, k, v, index, scale=SCALE, lines=lines)
    # The gathered path: the line keys copied to the front (a permuted copy of K/V) through the oracle.
    mask = grid.lines_mask(params, n, n, block_m=16, block_n=16)
    on = torch.arange(n) % stride == phase
    order = torch.cat([torch.arange(n)[on], torch.arange(n)[~on]])
    gathered, _ = masked_attention(q, k[:, :, order], v[:, :, order], lambda r: mask[r][:, order][None, None], scale=SCALE)
    assert relative_error(out, gathered) < 1e-5
    # The planted lines are what the heads attend: the grid is near-exact against dense.
    ref, _ = masked_attention(q, k, v, scale=SCALE)
    assert relative_error(out, ref) < 2e-2


def test_runner_runs_grid_heads_permuted_by_default():
    n = 256
    q, k, v = (t[:1] for t in qkv(n))
    params = grid.GridParams(stride=16, phase=2, local=16)  # a line key in every plain key block
    layer = LayerPlan(0, "sparse", (HeadGroup("grid", params, (0, 1), 16, 16),))
    runner = Runner(Plan("kv", (layer,), min_tokens=1))
    permuted = runner.attend(layer, q, k, v, scale=SCALE)
    runner.permute_grid = False
    plain = runner.attend(layer, q, k, v, scale=SCALE)
    mask = grid.lines_mask(params, n, n, block_m=16, block_n=16).to(DEVICE)
    ref, _ = masked_attention(q, k, v, lambda r: mask[r][None, None], scale=SCALE)
    assert relative_error(permuted, ref) < error_floor(torch.float32, DEVICE)
    assert relative_error(plain, ref) > 1e-4  # the plain cover computes other extra tokens


def test_search_scores_grid_heads_in_the_form_the_runtime_runs():
    """A grid candidate is scored as the runner runs it (execute.grid_form): its error is the runner's
    output error, and its density counts the index, the line columns and the line rows."""
    from sparsesearch.patterns import index_entries
    from sparsesearch.patterns._common import causal_entries
    from sparsesearch.search.cost import AnalyticCost
    from sparsesearch.search.layer import Timings, dense_reference, output_error, score_candidate
    from sparsesearch.search.space import Candidate

    n, bm = 256, 16
    q, k, v = (t[:1] for t in qkv(n))
    params = grid.GridParams(stride=16, phase=2, local=16)
    ref_out, ref_lse = dense_reference(q, k, v, "kv", bm, SCALE)
    scored = score_candidate(Candidate("grid", dataclasses.asdict(params)), params, q, k, v, ref_out, ref_lse, "kv", bm, bm,
                             SCALE, AnalyticCost(), Timings())
    layer = LayerPlan(0, "sparse", (HeadGroup("grid", params, (0, 1), bm, bm),))
    ran = Runner(Plan("kv", (layer,), min_tokens=1)).attend(layer, q, k, v, scale=SCALE)
    error, _ = output_error(ran, ref_lse, ref_out, ref_lse, "kv", 2)
    assert torch.allclose(scored.error, error, rtol=1e-4, atol=1e-6)
    index, lines = grid.build_lines_index(params, n, n, block_m=bm, block_n=bm)
    rows = torch.arange(n)
    line_col_entries = int(lines.line_cols.long()[rows // bm].sum())
    line_row_entries = int((rows[lines.is_line_row(rows)] + 1).sum())
    want = (index_entries(index, n, n) + line_col_entries + line_row_entries) / causal_entries(n, n)
    assert torch.allclose(scored.density, torch.full((2,), want, dtype=torch.float64))
    assert want < grid.density(params, n, block_m=bm, block_n=bm)  # the plain cover computes more here


def test_runner_keeps_the_plain_cover_where_the_lines_compute_more():
    """Slash lines stay spread when the lines are read apart: with them on (and a short stride) the lines
    form computes more tiles than the plain cover, so the runner keeps the plain one."""
    n = 160
    q, k, v = (t[:1] for t in qkv(n))
    params = grid.GridParams(stride=5, phase=0, use_slash=True, local=9)
    g = HeadGroup("grid", params, (0, 1), 16, 16)
    layer = LayerPlan(0, "sparse", (g,))
    runner = Runner(Plan("kv", (layer,), min_tokens=1))
    _, lines = runner._static.permuted(g, q, k, "kv")
    assert lines is None
    chosen = runner.attend(layer, q, k, v, scale=SCALE)
    runner.permute_grid = False
    assert torch.equal(runner.attend(layer, q, k, v, scale=SCALE), chosen)


# ------------------------------------------------------------------------------------------ bad input


def _maps_case():
    q, k, v = qkv(40, batch=1)
    index = dense.build_index(None, 24, 30, heads=2, block_m=16, block_n=16, head_space="kv", device=DEVICE,
                              row_pos=torch.arange(24, device=DEVICE))
    return q, k, v, index


@pytest.mark.parametrize("row_map, col_map, message", [
    (torch.arange(24, dtype=torch.int64), torch.arange(30, dtype=torch.int32), "row_map must be a non-empty 1-D int32"),
    (torch.arange(24, dtype=torch.int32) + 20, torch.arange(30, dtype=torch.int32), r"row_map values must lie in \[0, 39\], got \[20, 43\]"),
    (torch.arange(24, dtype=torch.int32), torch.zeros(30, dtype=torch.int32), "col_map must not repeat a position"),
    (torch.arange(24, dtype=torch.int32), torch.arange(30, dtype=torch.int32) - 1, r"col_map values must lie in \[0, 39\], got \[-1, 28\]"),
    (torch.arange(24, dtype=torch.int32), None, r"row_pos values must lie in \[-1, 39\], got \[17, 40\]"),
])
def test_bad_maps_are_refused_when_made(row_map, col_map, message):
    """region_maps checks every value once; the launches then check only shapes (no device sync)."""
    row_pos = torch.arange(24, device=DEVICE) + (17 if col_map is None else 0)
    with pytest.raises(ValueError, match=message):
        region_maps(row_map.to(DEVICE), None if col_map is None else col_map.to(DEVICE), row_pos, 40, 40)


def test_region_maps_know_an_increasing_column_map():
    cm = torch.tensor([1, 2, 3, 7, 9], dtype=torch.int32, device=DEVICE)
    assert region_maps(None, cm, None, 10, 10).increasing
    assert not region_maps(None, cm.flip(0), None, 10, 10).increasing
    assert not region_maps(cm, None, None, 10, 10).increasing  # no column map: nothing to run


def _listed(count, idx, b, h, m) -> list[int]:
    return idx[b, h, m, : int(count[b, h, m])].tolist()


def test_folded_runs_keep_every_key_and_move_only_the_blocks_that_straddle_a_gap():
    """fold_runs on a dense region index over a long fragmented layout: each full block that is one run of
    the column map becomes its first original row, each that straddles a gap (or reaches past the keys)
    moves to the partial list after the index's own, and the keys each row reads are unchanged."""
    ids = layout_ids([(0, 40), (2, 100), (0, 3), (2, 70), (0, 20), (2, 33)])
    region = next(r for r in boundary.regions("2d", ids, NAMES) if r.name == "video>video")
    col_map = region.maps(DEVICE, ids.numel()).col_map
    index = _static_region_index("dense", dense.DenseParams(), region, batch=2)
    folded = fold_runs(index, col_map)
    cm, bn = col_map.cpu().long(), index.block_n
    moved = 0
    for b, h, m in itertools.product(*map(range, index.full_count.shape)):
        full, part = _listed(index.full_count, index.full_idx, b, h, m), _listed(index.partial_count, index.partial_idx, b, h, m)
        starts = _listed(folded.full_count, folded.full_start, b, h, m)
        now_part = _listed(folded.partial_count, folded.partial_idx, b, h, m)
        runs = [kb for kb in full if int(cm[kb * bn + bn - 1] - cm[kb * bn]) == bn - 1]
        assert starts == [int(cm[kb * bn]) for kb in runs]
        assert now_part == part + [kb for kb in full if kb not in runs]
        moved += len(full) - len(runs)
    assert moved > 0  # the layout's gaps fall inside full blocks, so both paths run
    # A full block listed past the region's keys is never addressed as a run.
    bad = dataclasses.replace(index, full_idx=index.full_idx.clone())
    bad.full_idx[0, 0, -1, 0] = cm.numel() // bn + 1
    out = fold_runs(bad, col_map)
    assert bad.full_idx[0, 0, -1, 0].item() in _listed(out.partial_count, out.partial_idx, 0, 0, bad.q_blocks - 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_maps_of_another_shape_or_with_a_second_frame_are_refused_before_any_launch(backend):
    q, k, v, index = _maps_case()
    rm, cm = torch.arange(24, dtype=torch.int32, device=DEVICE), torch.arange(30, dtype=torch.int32, device=DEVICE)
    maps = region_maps(rm, cm, torch.arange(24, device=DEVICE), 40, 40)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="region maps index 40 queries x 40 keys, inputs have 36 x 40"):
        BACKENDS[backend](q[:, :, :36].contiguous(), k, v, index, maps=maps)
    with pytest.raises(ValueError, match="row_pos comes with the region maps"):
        BACKENDS[backend](q, k, v, index, maps=maps, row_pos=torch.arange(24, device=DEVICE), out=out)
    with pytest.raises(ValueError, match=r"row_pos must be an int tensor \[24\]"):
        region_maps(rm, cm, torch.arange(30, device=DEVICE), 40, 40)
    with pytest.raises(ValueError, match="dense"):
        block_sparse_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), index,
                               cu_seqlens_q=torch.tensor([0, 40], dtype=torch.int32, device=DEVICE),
                               cu_seqlens_k=torch.tensor([0, 40], dtype=torch.int32, device=DEVICE),
                               maps=region_maps(rm, None, None, 40, 40))
    assert bool(out.isnan().all())


def test_grid_strides_out_of_range_are_refused():
    with pytest.raises(ValueError, match="stride must be >= 1, got 0"):
        grid.GridParams(stride=0)
    with pytest.raises(ValueError, match="stride must be >= 1, got -3"):
        grid.GridParams(stride=-3)
    with pytest.raises(ValueError, match="grid stride 300 is longer than the sequence"):
        grid.build_lines_index(grid.GridParams(stride=300), 200, 200)


def test_bad_modality_ids_and_names_are_refused_before_any_launch():
    ids = layout_ids()
    q, k, v = (t[:1] for t in qkv(ids.numel()))
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match=f"modality ids hold {ids.numel() - 1} tokens, the sequence {ids.numel()}"):
        attend_boundary(((0, "2d"),), _groups("dense", dense.DenseParams()), q, k, v, ids[:-1], "kv", SCALE, out)
    bad = ids.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match="modality id 7 names no modality"):
        attend_boundary(((0, "2d"),), _groups("dense", dense.DenseParams()), q, k, v, bad, "kv", SCALE, out)
    assert bool(out.isnan().all())
    pos = boundary.positions(ids, NAMES)
    with pytest.raises(ValueError, match="modality 'audio' is unknown or absent"):
        boundary.make_region("audio", "text", pos)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_identity_maps_are_the_plain_path(backend):
    """Identity maps (default scale 1/sqrt(D)) reproduce the launch without maps: the Triton kernel bit for
    bit (same tiles, same order), the torch twin within rounding (it takes its block-gather branch)."""
    q, k, v = qkv(48, batch=1)
    idx = ashape.build_index(ashape.AShapeParams(sink=4, local=20), 48, 48, heads=2, block_m=16, block_n=16, head_space="kv",
                             device=DEVICE)
    rm = torch.arange(48, dtype=torch.int32, device=DEVICE)
    a, la = BACKENDS[backend](q, k, v, idx, maps=region_maps(rm, rm, None, 48, 48))
    b, lb = BACKENDS[backend](q, k, v, idx, scale=1 / math.sqrt(64))
    if backend == "triton":
        assert torch.equal(a, b) and torch.equal(la, lb)
    else:
        assert relative_error(a, b) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_column_map_out_of_order_is_gathered_and_causal_by_original_position(backend):
    """A key permutation that is not increasing (no runs: every tile gathered, no TMA) over an index of
    partial blocks only: causality by original position makes it plain causal attention."""
    q, k, v = qkv(48, batch=1)
    cm = torch.randperm(48, generator=torch.Generator().manual_seed(3)).to(device=DEVICE, dtype=torch.int32)
    maps = region_maps(torch.arange(48, dtype=torch.int32, device=DEVICE), cm, None, 48, 48)
    assert not maps.increasing
    shape = (1, 2, 3)
    every = torch.arange(3, dtype=torch.int32, device=DEVICE).expand(*shape, 3).contiguous()
    none = torch.zeros(shape, dtype=torch.int32, device=DEVICE)
    index = BlockIndex(none, none[..., None].contiguous(), torch.full(shape, 3, dtype=torch.int32, device=DEVICE), every, 16, 16, "kv")
    out, lse = BACKENDS[backend](q, k, v, index, scale=SCALE, maps=maps)
    ref, ref_lse = masked_attention(q, k, v, scale=SCALE)
    assert relative_error(out, ref) < error_floor(torch.float32, DEVICE)
    assert relative_error(lse, ref_lse) < error_floor(torch.float32, DEVICE)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grid_lines_of_another_shape_or_with_maps_are_refused_before_any_launch(backend):
    q, k, v = qkv(64, batch=1)
    params = grid.GridParams(stride=8, phase=1, local=16)
    index, lines = grid.build_lines_index(params, 64, 64, heads=2, block_m=16, block_n=16, head_space="kv", device=DEVICE)
    with pytest.raises(ValueError, match="built for 64 queries x 64 keys, inputs have 48 x 64"):
        BACKENDS[backend](q[:, :, :48].contiguous(), k, v, index, lines=lines)
    maps = region_maps(torch.arange(64, dtype=torch.int32, device=DEVICE), None, None, 64, 64)
    with pytest.raises(ValueError, match="grid lines take the dense"):
        BACKENDS[backend](q, k, v, index, lines=lines, maps=maps)
