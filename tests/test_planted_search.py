"""The search finds what is there (issue 13): heads planted with a known pattern (tests/planted.py) must come
back as that kind, with its parameters (grid stride and phase exactly) and a small output error.

Fast subset: one length and seed per case (CPU, ~1 min together). The sweep over seeds, lengths that are
not block multiples and GQA groups 1/2/4 is marked slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import planted as P
import planted_boundary as PB
from sparsesearch.kernels.torch_sparse import block_sparse_attention_torch
from sparsesearch.patterns import block_topk, grid, triangle
from sparsesearch.patterns import boundary as bd
from sparsesearch.patterns import vertical_slash as vs
from sparsesearch.reference import masked_attention, predicate_mask_fn
from sparsesearch.execute import HeadGroup, run_region
from sparsesearch.search.boundary import choose_boundary, run_picks, search_modal_layer
from sparsesearch.search.cost import AnalyticCost
from sparsesearch.search.layer import (
    KIND_ORDER, MAX_ERROR, TIE_ABS, Scored, choose, head_rows, output_error, score_layer, space_reference,
)
from sparsesearch.search.space import Candidate, load_space, parse_space

STRIDES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # search/layer.py's candidate strides
# Output error a recovered head may keep: the planted lines' blocks hold their mass, the rest of a
# vertical-slash head's softmax (a few percent, spread) falls outside a 16 + 16 line budget.
ERROR_BOUND = {"vertical_slash": 0.1}


def space(slack: float = 0.5, candidates: list | None = None) -> object:
    """Blocks of 64, no scaling; target A-shape(64, 256) so dense never fits, slack 0.5 admits the planted kinds."""
    return parse_space({
        "name": "planted", "format": 1, "reference_tokens": 1024, "block_m": 64, "block_n": 64,
        "target": {"pattern": "ashape", "params": {"sink": 64, "local": 256}}, "budget_slack": slack,
        "candidates": candidates or [
            {"pattern": "ashape", "params": {"sink": 16, "local": 64}},
            {"pattern": "ashape", "params": {"sink": 16, "local": 128}},
            {"pattern": "vertical_slash", "params": {"vertical_size": 16, "slash_size": 16, "last_q": 64}},
            {"pattern": "block_topk", "params": {"k_blocks": 2, "sink_blocks": 1}},
            {"pattern": "triangle", "params": {"sink": 16, "window": 64, "last": 64}},
            {"pattern": "grid", "params": {"stride": "estimate", "use_hline": True, "use_vline": True, "use_slash": False,
                                           "local": 32}, "modalities": ["video"]},
        ],
    }, "planted")


# ------------------------------------------------------------------------------------------- grid


def _grid_case(n: int, stride: int, seed: int, group: int, hline: bool):
    phase = int(torch.randint(0, stride, (1,), generator=torch.Generator().manual_seed(seed * 31 + stride)))
    head = P.grid(n, stride, phase, hline=hline)
    q, k, _ = P.layer([[head] * group, [head] * group], seed)
    strides = [s for s in STRIDES if s < n // 2]
    found, found_phase, _ = grid.estimate_stride_phase(q, k, strides, head_space="kv" if group > 1 else "query")
    return phase, found.flatten().tolist(), found_phase.flatten().tolist()


@pytest.mark.parametrize("n,stride,group", [(1000, 64, 1), (1300, 256, 2), (700, 16, 4)])
def test_grid_estimate_returns_the_true_stride_and_phase(n, stride, group):
    phase, found, found_phase = _grid_case(n, stride, seed=0, group=group, hline=True)
    assert found == [stride] * 2 and found_phase == [phase] * 2, (found, found_phase, phase)


@pytest.mark.slow
@pytest.mark.parametrize("n", [700, 1000, 1300, 2100])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_grid_estimate_sweep(n, group):
    """Before issue 13 the estimate returned the true stride and phase in 29 of 100 such cases (a multiple,
    256, with the phase right only modulo the stride, in the rest)."""
    misses = []
    for seed in range(4):
        for stride in (16, 32, 64, 128, 256):
            for hline in (True, False):
                phase, found, found_phase = _grid_case(n, stride, seed, group, hline)
                if found != [stride] * 2 or found_phase != [phase] * 2:
                    misses.append((seed, stride, phase, hline, found, found_phase))
    assert not misses


# -------------------------------------------------------------------------------- vertical-slash


def _far_slash_found(n: int, seed: int) -> list:
    """Per vertical-slash candidate of the bundled space (scaled to n): (slash budget, far slash kept)."""
    far = int(torch.randint(n // 3, n - 200, (1,), generator=torch.Generator().manual_seed(seed)))
    q, k, _ = P.layer([[P.vertical_slash(n, [3, n // 4, n // 2], [0, far])]])
    bundled = load_space(None)
    out = []
    for cand in bundled.candidates:
        if cand.pattern == "vertical_slash":
            params = bundled.resolve(cand, n)
            out.append((params.slash_size, far in vs.estimate(params, q, k).slash.flatten().tolist()))
    return out


@pytest.mark.parametrize("n", [1000])
def test_far_slashes_are_found_at_short_lengths(n):
    """The bundled space at 1000 tokens: slash budgets of 32-128; the forced offsets used to fill them
    (0..99) and the planted slash at n/3..n-200 was never kept."""
    found = _far_slash_found(n, seed=1)
    assert all(ok for size, ok in found if size >= 16), found


@pytest.mark.slow
@pytest.mark.parametrize("n", [700, 1500, 3000])
def test_far_slashes_sweep(n):
    for seed in range(5):
        found = _far_slash_found(n, seed)
        assert all(ok for size, ok in found if size >= 16), (seed, found)


def _exact_vs_case(n: int, seed: int) -> tuple[list[int], int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An exactly vertical-slash head at n tokens: 8 verticals (key 3 and 7 spread over the sequence), the
    diagonal and one far slash at a seeded offset in [n/3, n - 200). Returns (verticals, far, q, k, v)."""
    far = int(torch.randint(n // 3, n - 200, (1,), generator=torch.Generator().manual_seed(seed)))
    verticals = [3] + [n * i // 8 for i in range(1, 8)]
    q, k, v = P.layer([[P.exact_vertical_slash(n, verticals, [0, far])]], seed)
    return verticals, far, q, k, v


@pytest.mark.parametrize("n", [2048, 4000])
def test_exact_vertical_slash_head_keeps_its_lines_and_buys_no_shadows(n):
    """Every vertical-slash candidate of the bundled space keeps the planted lines, and its slashes are a
    band of the nearest offsets plus the far slash (and at most one weak alias of the planted cosines,
    which the data does show as a line), none of them an offset a vertical crosses in the estimate rows.
    Plain line sums filled the data-chosen half with those shadows (up to 30 far slashes at 2K tokens,
    two key blocks per query block each, holding what the vertical columns hold already)."""
    verticals, far, q, k, _ = _exact_vs_case(n, seed=0)
    bundled = load_space(None)
    rows = torch.arange(n - 64, n)  # the estimate's last_q rows
    shadows = {int(r - j) for j in verticals for r in rows if r > j}
    for cand in bundled.candidates:
        if cand.pattern != "vertical_slash":
            continue
        params = bundled.resolve(cand, n)
        lines = vs.estimate(params, q, k)
        slashes = lines.slash.flatten().tolist()
        band = next(i for i, d in enumerate(slashes + [-1]) if d != i)  # the leading run 0, 1, ...
        rest = slashes[band:]
        assert set(verticals) <= set(lines.vertical.flatten().tolist()), params
        assert far in rest and len(rest) <= 2 and not shadows & (set(rest) - {far}), (params, rest)


@pytest.mark.parametrize("n", [2048, 4000])
def test_exact_vertical_slash_head_is_served_within_the_bundled_budget(n):
    """The bundled space at 2K-4K tokens serves an exactly vertical-slash head by vertical-slash, within
    budget, with the planted lines' error (~3e-4). Before the line scores' discount and floor every
    vertical-slash candidate came out over budget (1.72-1.98x at 2048 tokens, block density 0.56-0.66;
    1.07-2.54x at 4000, 0.35-0.85) and the head went dense; now the pick's density is 0.20 and 0.13."""
    _, _, q, k, v = _exact_vs_case(n, seed=0)
    scored, budget, _ = score_layer(q, k, v, load_space(None), AnalyticCost(), head_space="query", modality="text")
    row = head_rows(scored, budget, "output_error")[0]
    assert row["pattern"] == "vertical_slash" and row["admissible"] and row["reason"] is None, row
    assert row["output_error"] < 0.002 and row["density"] < 0.25, row


@pytest.mark.slow
@pytest.mark.parametrize("n", [2100, 3000, 4096])
def test_exact_vertical_slash_sweep(n):
    """Other seeds and lengths. The bound is looser than the fast test's: at some seeds the cosines of the
    other slash push a slash's logit down in the last rows (3000 tokens, seed 3: 3e-4 of each row's mass,
    below the floor), so the estimate cannot see it and the rows that do attend it cost 0.004."""
    for seed in range(1, 4):
        _, _, q, k, v = _exact_vs_case(n, seed)
        scored, budget, _ = score_layer(q, k, v, load_space(None), AnalyticCost(), head_space="query", modality="text")
        row = head_rows(scored, budget, "output_error")[0]
        assert row["pattern"] == "vertical_slash" and row["admissible"] and row["output_error"] < 0.005, (seed, row)


# ------------------------------------------------------------------------------ one planted layer


def _layer_heads(n: int, seed: int) -> list[P.Head]:
    gen = torch.Generator().manual_seed(seed)
    far = int(torch.randint(n // 3, n - 128, (1,), generator=gen))
    return [
        P.ashape(n, 16, 8),
        P.vertical_slash(n, [3, n // 4, n // 2], [0, far]),
        P.block_topk(n, 64, P.block_targets(n, 64, gen)),
        P.triangle(n, 16, 8, 64),
        P.dense_like(n, gen),
    ]


def _check_layer(n: int, seed: int, slack: float = 0.5) -> None:
    heads = _layer_heads(n, seed)
    q, k, v = P.layer([[h] for h in heads], seed)
    scored, budget, _ = score_layer(q, k, v, space(slack), AnalyticCost(), head_space="query", modality="video")
    rows = head_rows(scored, budget, "output_error")
    got = [r["pattern"] for r in rows]
    assert got == [h.kind for h in heads], (n, seed, got)
    for head, row in zip(heads, rows):
        if head.kind == "dense":
            assert not row["admissible"] and f"> max_error {MAX_ERROR:g}" in row["reason"], row
            continue
        assert row["admissible"] and row["reason"] is None and row["output_error"] < ERROR_BOUND.get(head.kind, 0.05), row


def test_planted_layer_every_kind_is_recovered():
    """A-shape, vertical-slash (near + far slash), block top-k, triangle and dense-like heads in one layer
    of 1000 tokens (not a block multiple), grid candidates in the space too (video modality). Near-equal
    errors go to the cheaper candidate: the A-shape head is A-shape, not the triangle that also holds it."""
    _check_layer(1000, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1000, 1300, 1700])
@pytest.mark.parametrize("seed", [1, 2])
def test_planted_layer_sweep(n, seed):
    """The space's target is a fixed A-shape(64, 256), not scaled with n, while the vertical-slash head's block
    cover grows faster than it: at 1300-1700 tokens its candidate costs 1.2-1.3x the slack-0.5 budget, so the
    rule (least error within budget) rightly takes block top-k at error 0.15-0.44 (seeds 1, 2; found on an
    H200 run of the slow suite). Past 1000 tokens the budget gets slack 1.0, which admits it; at 1000 it
    stays 0.5, where slack 1.0 would admit vertical-slash at error 0.35 for the dense-like head of seed 2."""
    _check_layer(n, seed, slack=0.5 if n <= 1000 else 1.0)


def _check_grid(n: int, stride: int, seed: int, group: int = 1) -> None:
    """A grid head (vertical + horizontal lines, local band) in a space of blocks of 16, where the grid's
    block cover is cheap at stride 64 (a quarter of the key blocks and query blocks) and vertical-slash
    cannot hold n / stride lines: the grid wins, with the planted stride and phase."""
    phase = int(torch.randint(0, stride, (1,), generator=torch.Generator().manual_seed(seed)))
    head = P.grid(n, stride, phase)
    q, k, v = P.layer([[head] * group], seed)
    sp = parse_space({
        "name": "planted-grid", "format": 1, "reference_tokens": 1024, "block_m": 16, "block_n": 16,
        "target": {"pattern": "ashape", "params": {"sink": 64, "local": 256}}, "budget_slack": 0.5,
        "candidates": [
            {"pattern": "ashape", "params": {"sink": 16, "local": 64}},
            {"pattern": "vertical_slash", "params": {"vertical_size": 16, "slash_size": 16, "last_q": 64}},
            {"pattern": "grid", "params": {"stride": "estimate", "use_hline": True, "use_vline": True, "use_slash": False,
                                           "local": 32}, "modalities": ["video"]},
        ],
    }, "planted-grid")
    space_kind = "kv" if group > 1 else "query"
    scored, budget, _ = score_layer(q, k, v, sp, AnalyticCost(), head_space=space_kind, modality="video")
    row = head_rows(scored, budget, "output_error")[0]
    assert row["pattern"] == "grid" and row["admissible"] and row["output_error"] < 0.02, row
    assert (row["params"].stride, row["params"].phase) == (stride, phase)


def test_planted_grid_head_is_chosen_with_its_stride_and_phase():
    _check_grid(1000, 64, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("n,stride", [(1000, 128), (1300, 64), (1700, 128)])
@pytest.mark.parametrize("group", [1, 2])
def test_planted_grid_sweep(n, stride, group):
    for seed in range(2):
        _check_grid(n, stride, seed, group)


# ----------------------------------------------------------------------------------------- triangle


def test_triangle_is_scored_with_its_dense_tail():
    """The triangle candidate's density, recall and error are those of streaming + dense last rows (the
    runtime's split): density exactly triangle.density, and the output the masked oracle's."""
    n, params = 1000, triangle.TriangleParams(sink=16, window=64, last=64)
    q, k, v = P.layer([[P.triangle(n, 16, 8, 64)], [P.ashape(n, 16, 8)]])
    sp = space(candidates=[{"pattern": "triangle", "params": {"sink": 16, "window": 64, "last": 64}}])
    scored, _, _ = score_layer(q, k, v, sp, AnalyticCost(), head_space="query")
    tri = scored[0]
    want = triangle.density(params, n, block_m=64, block_n=64)
    assert torch.allclose(tri.density, torch.full((2,), want, dtype=torch.float64))
    assert bool((tri.recall > 0.99).all()), tri.recall  # the last rows keep their mass (lse finite)
    out, _ = masked_attention(q, k, v, predicate_mask_fn(triangle.predicate(params, n), 1, 2, n, n))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    oracle = ((out - ref).pow(2).sum((0, 2, 3)) / ref.pow(2).sum((0, 2, 3))).sqrt().double()
    assert torch.allclose(tri.error, oracle, atol=1e-4), (tri.error, oracle)


def test_a_head_no_candidate_serves_gets_the_cheapest_measured():
    """Budget 0 (as timed costs give tiny GPU regions): nothing is admissible, every head falls back to
    the cheapest candidate, which pruning left unrun; the row must carry its measured error, not inf."""
    n = 600
    q, k, v = P.layer([[P.ashape(n, 16, 8)], [P.triangle(n, 16, 8, 64)]])
    sp = space(candidates=[{"pattern": "ashape", "params": {"sink": 16, "local": 64}},
                           {"pattern": "ashape", "params": {"sink": 16, "local": 256}}])
    zero = torch.zeros(2, dtype=torch.float64)
    rows = head_rows(*score_layer(q, k, v, sp, AnalyticCost(), head_space="query", budget=zero, dense_fallback=False)[:2],
                     "output_error")
    free, _, _ = score_layer(q, k, v, sp, AnalyticCost(), head_space="query", dense_fallback=False)
    for h, row in enumerate(rows):
        assert (row["params"].sink, row["params"].local) == (16, 64), row  # the cheaper one
        assert row["output_error"] == pytest.approx(float(free[0].error[h]), abs=1e-6), row


@pytest.mark.parametrize("dense_fallback", [True, False])
def test_a_space_that_lists_dense_reports_dense_exactly(dense_fallback):
    """A space listing dense itself, over a budget dense does not fit (2000 tokens, target A-shape(64, 256),
    slack 0.1): the dense-like head keeps dense with error 0 and recall 1, from one dense entry. The listed
    entry used to be pruned unrun (error inf, recall 0) and was the first dense entry the chooser found."""
    n = 2000
    q, k, v = P.layer([[P.dense_like(n, torch.Generator().manual_seed(0))], [P.ashape(n, 16, 8)]])
    sp = space(slack=0.1, candidates=[{"pattern": "dense"}, {"pattern": "ashape", "params": {"sink": 16, "local": 64}}])
    scored, budget, _ = score_layer(q, k, v, sp, AnalyticCost(), head_space="query", dense_fallback=dense_fallback)
    assert [s.candidate.pattern for s in scored].count("dense") == 1
    dense_row, ashape_row = head_rows(scored, budget, "output_error")
    assert dense_row["pattern"] == "dense" and not dense_row["admissible"], dense_row
    assert (dense_row["output_error"], dense_row["recall"], dense_row["density"]) == (0.0, 1.0, 1.0), dense_row
    assert ashape_row["pattern"] == "ashape" and ashape_row["output_error"] < 0.05, ashape_row


# -------------------------------------------------------------------------------------- GQA top-k


@pytest.mark.parametrize("group", [2, 4])
def test_kv_space_block_topk_serves_every_query_head(group):
    """A GQA group whose query heads want different blocks (and avoid each other's): the KV head's index
    must hold every head's blocks. Raw score sums gave a per-query-head error of 0.75 mean (0.90 max)."""
    n = 900
    heads = P.block_topk_group(n, 64, group, torch.Generator().manual_seed(group))
    q, k, v = P.layer([heads], seed=group)
    index = block_topk.build_index(block_topk.BlockTopKParams(k_blocks=group, sink_blocks=0), q, k, head_space="kv")
    out, _ = block_sparse_attention_torch(q, k, v, index)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
    error = ((out - ref).pow(2).sum((0, 2, 3)) / ref.pow(2).sum((0, 2, 3))).sqrt()
    assert bool((error < 0.05).all()), error
    # And through the search in the KV head space: block top-k chosen for the group.
    sp = space(candidates=[{"pattern": "ashape", "params": {"sink": 16, "local": 128}},
                           {"pattern": "block_topk", "params": {"k_blocks": group, "sink_blocks": 1}}])
    rows = head_rows(*score_layer(q, k, v, sp, AnalyticCost(), head_space="kv")[:2], "output_error")
    assert rows[0]["pattern"] == "block_topk" and rows[0]["output_error"] < 0.05, rows[0]


# -------------------------------------------------------------------------------------------- ties


def _scored(pattern: str, error: float, cost: float) -> Scored:
    one = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    return Scored(Candidate(pattern, {}), [None], one(error), one(1.0 - error), one(0.1), one(cost))


def test_ties_go_to_the_cheaper_candidate_then_a_fixed_kind_order():
    budget = torch.tensor([1.0], dtype=torch.float64)
    pick = lambda scored: choose(scored, budget, "output_error")[0][0].candidate.pattern  # noqa: E731
    # Equal (zero) errors: the cheaper wins, whatever the search-space order.
    assert pick([_scored("vertical_slash", 0.0, 0.5), _scored("ashape", 0.0, 0.3)]) == "ashape"
    assert pick([_scored("ashape", 0.0, 0.5), _scored("vertical_slash", 0.0, 0.3)]) == "vertical_slash"
    # Equal errors and costs: KIND_ORDER, in either space order.
    for order in (["block_topk", "grid", "triangle"], ["triangle", "grid", "block_topk"]):
        assert pick([_scored(p, 0.0, 0.4) for p in order]) == min(order, key=KIND_ORDER.index)
    # A clearly better error still wins over a cheaper candidate.
    assert pick([_scored("ashape", 0.2, 0.1), _scored("vertical_slash", 0.01, 0.5)]) == "vertical_slash"


def test_a_tie_between_kinds_is_recorded_and_a_real_preference_is_not():
    """Two exact line heads. One attends keys 0-3 and offsets 0 and 5 only: A-shape(16, 64) holds it as
    exactly as the vertical-slash candidate (forced verticals 0-7, slashes 0-7), both err ~1e-4, the
    cheaper one wins and the row records the other kind as its tie. The other head has a far slash that
    no A-shape holds: vertical-slash is a real preference, no tie."""
    n = 1000
    near = P.exact_vertical_slash(n, [0, 1, 2, 3], [0, 5])
    far = P.exact_vertical_slash(n, [3, n // 4, n // 2], [0, 700])
    q, k, v = P.layer([[near], [far]])
    sp = space(candidates=[{"pattern": "ashape", "params": {"sink": 16, "local": 64}},
                           {"pattern": "vertical_slash", "params": {"vertical_size": 16, "slash_size": 16, "last_q": 64}}])
    scored, budget, _ = score_layer(q, k, v, sp, AnalyticCost(), head_space="query")
    near_row, far_row = head_rows(scored, budget, "output_error")
    sparse = [s for s in scored if s.candidate.pattern != "dense"]
    assert max(float(s.error[0]) for s in sparse) < TIE_ABS, sparse  # both ~0: the definition's absolute part decides
    cheap, other = sorted(sparse, key=lambda s: float(s.cost_ms[0]))
    assert near_row["pattern"] == cheap.candidate.pattern and near_row["reason"] is None, near_row
    assert near_row["tie"] == other.candidate.pattern, near_row
    assert far_row["pattern"] == "vertical_slash" and far_row["tie"] is None, far_row


# ------------------------------------------------------------------------------------------ 2D boundary


def _boundary_case(layout, seed: int, slack: float):
    names = ("text", "image", "video")
    raw = PB.space_json()
    raw["budget_slack"] = slack
    sp = parse_space(raw, "planted-boundary")
    mod = P.modality(layout)
    q, k, v = P.plant_targets([P.boundary_targets("2d", layout)], seed)
    results, scores = search_modal_layer(q, k, v, mod, names, sp, AnalyticCost(), head_space="query",
                                         objective="output_error", scale=1.0)
    return sp, mod, names, results, scores


@pytest.mark.parametrize("layout_seed", [0, 1])
def test_planted_2d_head_is_chosen_as_2d_within_budget(layout_seed):
    """A 2D head (video rows: the last video tokens; text rows: video verticals) on two text/video layouts.
    Before issue 13 its 2D composition came out 6% over the budget at slack 0.1 and lost; the regions'
    budgets (the target's cost on each region) summed to 1.6x the global one."""
    layout = PB.SPANS if layout_seed == 0 else P.spans(layout_seed)
    sp, mod, names, results, scores = _boundary_case(layout, layout_seed, slack=0.5)
    budget = scores["budget_ms"]
    # Every type's regions share the global budget exactly.
    pos = bd.positions(mod, names)
    present = [m for m in names if m in pos]
    for kind in ("k", "q", "2d"):
        regions = [bd.scope_name(a, b) for a, b in bd.region_scopes(kind, present)]
        total = sum(float(results[r].budget[0]) for r in regions)
        assert total == pytest.approx(budget[0], rel=1e-9), (kind, total, budget[0])
    two_d = scores["types"]["2d"]
    assert two_d["cost_ms"][0] <= budget[0] and two_d["error"][0] < 0.01, two_d
    assert choose_boundary(scores["types"], budget, "output_error") == ["2d"]


# ------------------------------------------------------------------------------------- grid in regions


def test_boundary_regions_run_grid_picks_in_the_form_they_were_scored_in():
    """A planted grid head in a video span (its lines form errs by ~0.16, the block cover by ~0): every
    region pick of the none and 2D types, run as the boundary composition runs it (run_picks, i.e.
    execute.run_region, the runtime's path), errs exactly as the search scored it. The composition used to
    run grid picks as the plain cover: error 0.000 for the none type at a costed density of 0.17."""
    q, k, v, mod = P.grid_in_video(128, 1024, stride=64, phase=5)
    scale = 1 / P.DIM**0.5
    sp = parse_space({
        "name": "grid-regions", "format": 1, "reference_tokens": 4096, "block_m": 64, "block_n": 64, "scaled_params": [],
        "target": {"pattern": "ashape", "params": {"sink": 64, "local": 256}}, "budget_slack": 1.0, "boundaries": ["none", "2d"],
        "candidates": [
            {"pattern": "ashape", "params": {"sink": 64, "local": 128}},
            {"pattern": "grid", "params": {"stride": 64, "phase": 5, "use_hline": True, "use_vline": True, "use_slash": False,
                                           "local": 32}, "modalities": ["video"]},
        ],
    }, "grid-regions")
    names = ("text", "image", "video")
    results, scores = search_modal_layer(q, k, v, mod, names, sp, AnalyticCost(), head_space="query", objective="output_error",
                                         scale=scale)
    pos = bd.positions(mod, names)
    grid_picks = 0
    for name, res in results.items():
        region = bd.make_region(*bd.split_scope(name), pos)
        (pick, _), = choose(res.scored, res.budget, "output_error")
        out, lse = run_picks(q, k, v, region, [(pick, 0)], "query", 64, 64, scale)
        ref_out, ref_lse = space_reference(*region.gather(q, k, v), sp, "query", scale, region.row_pos)
        error, _ = output_error(out, lse, ref_out, ref_lse, "query", 1)
        assert float(error[0]) == pytest.approx(float(pick.error[0]), abs=1e-4), (name, pick.candidate.pattern)
        grid_picks += pick.candidate.pattern == "grid"
        if name == "video>video":  # writing into the whole sequence's rows gives the same rows
            whole = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))
            groups = [HeadGroup("grid", pick.params[0], (0,), 64, 64)]
            run_region(q, k, v, region, groups, "query", scale, *whole)
            assert torch.allclose(whole[0][:, :, region.q_idx], out, atol=1e-6)
    assert grid_picks == 2  # the global region and the video span's own
    assert scores["types"]["none"]["error"][0] > 0.1 and scores["types"]["none"]["density"][0] < 0.25, scores["types"]["none"]
