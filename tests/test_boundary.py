"""Boundary heads (paper 000 §3.2, Alg. 2-4): permuted modality regions, their patterns and reference
path, the lse composition of none/K/Q/2D, the inter-modality choice, and the runtime that runs it.

Planted inputs (tests/planted_boundary.py) have one-hot keys, so each query's targets are exact; each
boundary type is planted on text/video spans of unequal lengths and must be the one the search picks.
"""

from __future__ import annotations

import pytest
import torch

import planted_boundary as pb
from conftest import DEVICE
from sparsesearch.index import to_block_masks
from sparsesearch.patterns import ashape, block_topk, boundary, dense, vertical_slash
from sparsesearch.patterns._common import index_entries, last_q_sums, region_causal_entries
from sparsesearch.reference import error_floor, index_mask_fn, masked_attention, relative_error
from sparsesearch.execute import HeadGroup, build_group_index, sparse_attend
from sparsesearch.runtime.plan import LayerPlan, Plan
from sparsesearch.runtime.run import Runner
from sparsesearch.search.boundary import choose_boundary, run_picks, search_modal_layer
from sparsesearch.search.cost import AnalyticCost
from sparsesearch.search.layer import choose
from sparsesearch.search.space import parse_space

NAMES = ("text", "image", "video")
# Error floor over the low-precision oracle's error (fp32 dots run as TF32 on a GPU), as in test_kernels.
FLOOR = {dtype: error_floor(dtype, DEVICE) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
# Three modalities in interleaved spans of unequal lengths; text first, so every row sees a key.
LAYOUT = [(0, 20), (2, 37), (0, 11), (1, 29), (2, 45), (0, 26), (1, 18), (0, 14)]
PATTERNS = [
    ("dense", dense.DenseParams()),
    ("ashape", ashape.AShapeParams(sink=8, local=24)),
    ("block_topk", block_topk.BlockTopKParams(k_blocks=2, sink_blocks=1)),
    ("vertical_slash", vertical_slash.VerticalSlashParams(vertical_size=10, slash_size=5, last_q=16, force_vertical=2, force_slash=2)),
]


def layout_ids(layout=LAYOUT) -> torch.Tensor:
    return torch.cat([torch.full((n,), m, dtype=torch.long) for m, n in layout])


def qkv(n: int, q_heads: int = 4, kv_heads: int = 2, dim: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, dim, generator=gen) for h in (q_heads, kv_heads, kv_heads))


def region_attend(q, k, v, region, pattern, params, space="kv", block=16):
    heads = k.shape[1] if space == "kv" else q.shape[1]
    q_r, k_r, v_r = region.gather(q, k, v)
    index = build_group_index(HeadGroup(pattern, params, tuple(range(heads)), block, block), q_r, k_r, space, region.row_pos)
    out = torch.empty_like(q_r)
    lse = torch.empty(q_r.shape[:3])
    sparse_attend(q_r, k_r, v_r, index, 0.125, torch.arange(heads, dtype=torch.int32), out, lse, region.row_pos)
    return index, (q_r, k_r, v_r), out, lse


# ------------------------------------------------------------------------------------------- regions


def test_row_pos_is_the_frontier_in_key_order():
    ids = layout_ids()
    pos = boundary.positions(ids, NAMES)
    region = boundary.make_region("video", "text", pos)
    for i, p in zip(region.q_idx.tolist(), region.row_pos.tolist()):
        visible = [j for j in pos["text"].tolist() if j <= i]
        assert p == len(visible) - 1
    assert boundary.make_region("text", "text", pos).row_pos is None  # intra: identity frame
    # A region whose rows all precede its keys holds nothing.
    early = boundary.positions(torch.tensor([0, 0, 2, 2]), NAMES)
    assert boundary.make_region("text", "video", early) is None


@pytest.mark.parametrize("kind", boundary.BOUNDARIES)
def test_dense_regions_compose_to_dense_attention(kind):
    """Every boundary type's regions partition each row's causal keys: dense patterns in all of them,
    merged by lse, are exactly dense causal attention (GQA, kv head space, three modalities)."""
    ids = layout_ids()
    q, k, v = qkv(ids.numel())
    ref, ref_lse = masked_attention(q, k, v, scale=0.125)
    parts = []
    for region in boundary.regions(kind, ids, NAMES):
        _, _, out, lse = region_attend(q, k, v, region, "dense", dense.DenseParams())
        parts.append((region, out, lse))
    out, lse = boundary.compose(parts, ids.numel())
    assert relative_error(out, ref) < 1e-5
    assert torch.allclose(lse, ref_lse.float(), atol=1e-4)
    expected = {"none": 1, "k": 3, "q": 3, "2d": 9}[kind]
    assert len(parts) == expected


@pytest.mark.parametrize("pattern, params", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_region_index_reference_path_and_entries(pattern, params):
    """On every 2D region: the torch reference path equals the oracle on the index's token mask, that mask
    is causal by original position, and index_entries counts exactly the causal entries of listed blocks."""
    ids = layout_ids()
    q, k, v = qkv(ids.numel())
    for region in boundary.regions("2d", ids, NAMES):
        index, (q_r, k_r, v_r), out, lse = region_attend(q, k, v, region, pattern, params)
        nq, nk = q_r.shape[2], k_r.shape[2]
        mask_fn = index_mask_fn(index, nq, nk, group=2, row_pos=region.row_pos)
        ref, ref_lse = masked_attention(q_r, k_r, v_r, mask_fn, scale=0.125)
        assert relative_error(out, ref) < 1e-5, region.name
        mask = mask_fn(torch.arange(nq))  # [1, Hq, nq, nk]
        causal = region.k_idx[None, :] <= region.q_idx[:, None]
        assert not bool((mask & ~causal).any()), f"{region.name}: a key after its row"
        # Brute-force entries: causal keys of every listed block, plus gathered columns.
        row_pos = region.row_pos if region.row_pos is not None else torch.arange(nq)
        full, partial = to_block_masks(index, (nk + 15) // 16)
        blocks = (full | partial)[..., torch.arange(nq) // 16, :][..., torch.arange(nk) // 16]
        listed = blocks & (torch.arange(nk)[None, :] <= row_pos[:, None])
        if index.col_count is not None:
            from sparsesearch.index import to_column_mask

            cols = to_column_mask(index, nk)[..., torch.arange(nq) // 16, :] & (torch.arange(nk)[None, :] <= row_pos[:, None])
            listed = listed | cols
        assert index_entries(index, nq, nk, row_pos=region.row_pos) == int(listed.sum()), region.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern, params", PATTERNS[1:], ids=[p for p, _ in PATTERNS[1:]])
def test_triton_kernel_runs_region_frames(pattern, params, dtype):
    """The block-sparse Triton kernel with row_pos (interpreter on CPU, compiled on a GPU) against the
    oracle on the index's token mask, on every 2D region — rows before any key included."""
    from sparsesearch.kernels import block_sparse_attention

    ids = layout_ids()
    q, k, v = (t.to(DEVICE, dtype) for t in qkv(ids.numel()))
    for region in boundary.regions("2d", ids, NAMES):
        q_r, k_r, v_r = region.gather(q, k, v)
        row_pos = None if region.row_pos is None else region.row_pos.to(DEVICE)
        index = build_group_index(HeadGroup(pattern, params, (0, 1), 16, 16), q_r, k_r, "kv", row_pos)
        out, lse = block_sparse_attention(q_r, k_r, v_r, index, scale=0.125, row_pos=row_pos)
        mask_fn = index_mask_fn(index, q_r.shape[2], k_r.shape[2], group=2, row_pos=row_pos)
        ref, ref_lse = masked_attention(q_r, k_r, v_r, mask_fn, scale=0.125)
        low, _ = masked_attention(q_r, k_r, v_r, mask_fn, scale=0.125, upcast=False)
        tol = 2 * relative_error(low, ref) + FLOOR[dtype]
        assert relative_error(out, ref) <= tol, region.name
        empty = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(lse), empty) and not bool(out.isnan().any()), region.name


def test_region_kernel_refuses_bad_frames():
    from sparsesearch.kernels import block_sparse_attention

    q, k, v = qkv(40, q_heads=2, kv_heads=1)
    index = dense.build_index(None, 40, 40, heads=1, block_m=16, block_n=16, head_space="kv", row_pos=torch.arange(40))
    with pytest.raises(ValueError, match="nondecreasing"):
        block_sparse_attention(q, k, v, index, row_pos=torch.arange(40).flip(0))
    with pytest.raises(ValueError, match="dense"):
        block_sparse_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), index,
                               cu_seqlens_q=torch.tensor([0, 40], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 40], dtype=torch.int32),
                               row_pos=torch.arange(40))


def test_region_ashape_keeps_sink_and_the_keys_behind_the_frontier():
    ids = layout_ids()
    q, k, v = qkv(ids.numel())
    params = ashape.AShapeParams(sink=8, local=24)
    for region in boundary.regions("2d", ids, NAMES):
        index, (q_r, k_r, _), _, _ = region_attend(q, k, v, region, "ashape", params)
        nq, nk = q_r.shape[2], k_r.shape[2]
        mask = index_mask_fn(index, nq, nk, group=2, row_pos=region.row_pos)(torch.arange(nq))[0, 0]
        row_pos = region.row_pos if region.row_pos is not None else torch.arange(nq)
        j, p = torch.arange(nk)[None, :], row_pos[:, None]
        want = ((j < params.sink) | (p - j < params.local)) & (j <= p)
        assert torch.equal(mask, want), region.name


def test_last_q_sums_in_a_region_frame_match_brute_force():
    ids = layout_ids()
    q, k, _ = qkv(ids.numel(), q_heads=2, kv_heads=1)
    region = boundary.make_region("video", "text", boundary.positions(ids, NAMES))
    q_r, k_r = q[:, :, region.q_idx], k[:, :, region.k_idx]
    cols, diag = last_q_sums(q_r, k_r, 16, head_space="kv", scale=0.125, row_pos=region.row_pos)
    rows = region.row_pos[-16:]
    scores = (q_r[:, :, -16:] @ k_r.transpose(-1, -2)) * 0.125
    keep = torch.arange(k_r.shape[2])[None, :] <= rows[:, None]
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    assert torch.allclose(cols[0, 0], probs.sum((1, 2))[0], atol=1e-5)
    want = torch.zeros(k_r.shape[2])
    for r, p in enumerate(rows.tolist()):
        for j in range(p + 1):
            want[p - j] += probs[0, :, r, j].sum()
    assert torch.allclose(diag[0, 0], want, atol=1e-5)
    everything = region.k_idx[None, :] <= region.q_idx[:, None]
    assert region_causal_entries(region.row_pos) == region.causal_entries == int(everything.sum())


@pytest.mark.parametrize("row_pos, message", [
    (torch.tensor([0, 2, 1, 3]), "nondecreasing"),
    (torch.tensor([0, 1, 2, 9]), "must lie in"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "int tensor"),
])
def test_bad_row_pos_is_refused(row_pos, message):
    with pytest.raises(ValueError, match=message):
        dense.build_index(None, 4, 5, block_m=16, block_n=16, row_pos=row_pos)


# -------------------------------------------------------------------------------------------- search


@pytest.mark.parametrize("kind, targets", [
    ("none", pb.targets_none), ("k", pb.targets_k), ("q", pb.targets_q), ("2d", pb.targets_2d),
])
def test_planted_boundary_type_is_recovered(kind, targets):
    """Head 0 carries the planted type, head 1 a plain sink + local pattern (no boundary): the search
    must pick exactly [kind, none], and the winner's composition must be near-exact."""
    space = parse_space(pb.space_json(), "planted")
    q, k, v = pb.plant([targets(), pb.targets_none()])
    _, scores = search_modal_layer(q, k, v, pb.modality(), NAMES, space, AnalyticCost(), head_space="query",
                                   objective="output_error", scale=1.0)
    chosen = choose_boundary(scores["types"], scores["budget_ms"], "output_error")
    assert chosen == [kind, "none"], {t: d["error"] for t, d in scores["types"].items()}
    assert scores["types"][kind]["error"][0] < 1e-3
    if kind != "none":  # the planted structure defeats the global pattern
        assert scores["types"]["none"]["error"][0] > 0.1


def test_choose_boundary_rules():
    types = {
        "none": {"error": [0.30, 0.100, 0.2], "recall": [0.7, 0.9, 0.8], "cost_ms": [1.0, 1.0, 5.0]},
        "k": {"error": [0.10, 0.099, 0.1], "recall": [0.9, 0.9, 0.9], "cost_ms": [1.0, 1.0, 4.0]},
        "2d": {"error": [0.01, 0.098, 0.0], "recall": [0.99, 0.9, 1.0], "cost_ms": [1.5, 1.0, 3.0]},
    }
    budget = [2.0, 2.0, 2.0]
    # head 0: 2d is far better; head 1: none is within 5% of the best, so the simplest wins;
    # head 2: nothing within budget -> the cheapest.
    assert choose_boundary(types, budget, "output_error") == ["2d", "none", "2d"]
    assert choose_boundary(types, budget, "output_error", tolerance=0.0)[1] == "2d"
    assert choose_boundary(types, budget, "mass_recall")[0] == "2d"
    assert choose_boundary(types, [1.2, 2.0, 2.0], "output_error")[0] == "k"  # 2d over budget


def test_search_is_deterministic_and_resumes_from_cached_regions():
    space = parse_space(pb.space_json(), "planted")
    q, k, v = pb.plant([pb.targets_2d()])
    saved = {}
    first, scores_a = search_modal_layer(q, k, v, pb.modality(), NAMES, space, AnalyticCost(), head_space="query",
                                         objective="output_error", scale=1.0, on_scope=saved.__setitem__)
    assert set(saved) == set(first)
    assert {"all>all", "text>text", "video>video", "text>video", "video>text", "text>all", "video>all", "all>text", "all>video"} == set(saved)
    half = dict(list(saved.items())[:4])
    _, scores_b = search_modal_layer(q, k, v, pb.modality(), NAMES, space, AnalyticCost(), head_space="query",
                                     objective="output_error", scale=1.0, cached=half)
    assert scores_a == scores_b


# ------------------------------------------------------------------------------------------- runtime


def _planted_plan():
    """A one-layer plan from the search's own picks on the planted 2D input (head 0: 2d, head 1: none)."""
    space = parse_space(pb.space_json(), "planted")
    q, k, v = pb.plant([pb.targets_2d(), pb.targets_none()])
    results, _ = search_modal_layer(q, k, v, pb.modality(), NAMES, space, AnalyticCost(), head_space="query",
                                    objective="output_error", scale=1.0)

    def groups(scope, heads):
        res = results[scope]
        picks = [p for p in choose(res.scored, res.budget, "output_error") if p[1] in heads]
        return tuple(HeadGroup(s.candidate.pattern, s.params[h], (h,), 16, 16) for s, h in picks)

    regions = tuple((scope, groups(scope, (0,))) for scope in ("text>text", "text>video", "video>text", "video>video"))
    layer = LayerPlan(0, "sparse", groups("all>all", (0, 1)), boundary=((0, "2d"),), regions=regions)
    return Plan("query", (layer,), min_tokens=1), (q, k, v), results, space


def test_runtime_runs_boundary_heads_like_the_search_composed_them():
    plan, (q, k, v), results, space = _planted_plan()
    runner = Runner(plan)
    runner.modality = pb.modality()
    out = runner.attend(plan.layers[0], q, k, v, scale=1.0)
    ref, _ = masked_attention(q, k, v, scale=1.0)
    # The composed 2D approximation of head 0, rebuilt from the search's picks.
    pos = boundary.positions(pb.modality(), NAMES)
    parts = []
    for scope in ("text>text", "text>video", "video>text", "video>video"):
        region = boundary.make_region(*boundary.split_scope(scope), pos)
        res = results[scope]
        parts.append((region, *run_picks(q, k, v, region, choose(res.scored, res.budget, "output_error"), "query", 16, 16, 1.0)))
    composed, _ = boundary.compose(parts, q.shape[2])
    assert relative_error(out[:, :1], composed[:, :1]) < 1e-5
    assert relative_error(out[:, :1], ref[:, :1]) < 1e-3  # the planted 2D head is near-exact
    # Without modality ids the boundary head falls back to its global pattern, which misses the plant.
    runner.modality = None
    fallback = runner.attend(plan.layers[0], q, k, v, scale=1.0)
    assert relative_error(fallback[:, :1], ref[:, :1]) > 0.1
    assert torch.equal(fallback[:, 1:], out[:, 1:])  # the none head is unaffected


def test_runtime_boundary_batch_rows_use_their_own_modality():
    plan, (q, k, v), _, _ = _planted_plan()
    runner = Runner(plan)
    runner.modality = pb.modality()
    one = runner.attend(plan.layers[0], q, k, v, scale=1.0)
    runner.modality = torch.stack([pb.modality(), torch.zeros_like(pb.modality())])
    two = runner.attend(plan.layers[0], *(t.expand(2, -1, -1, -1).contiguous() for t in (q, k, v)), scale=1.0)
    assert torch.allclose(two[:1], one, atol=1e-6)
    # Row 2 is all text: a single modality reduces every type to the global pattern.
    runner.modality = None
    glob = runner.attend(plan.layers[0], q, k, v, scale=1.0)
    assert torch.allclose(two[1:], glob, atol=1e-6)


def test_selfcheck_runs_a_region_case():
    from sparsesearch.selfcheck import check_patterns

    rows = check_patterns(tokens=256, block=16, device=DEVICE, patterns=["region_vertical_slash"], dtype="fp32")
    assert len(rows) == 1 and rows[0].ok and 0.0 < rows[0].density < 1.0, rows
