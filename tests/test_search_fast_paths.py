"""The CPU search's fast paths give what the slow ones gave: the fused masked attention of the torch backend
(torch's CPU flash op with an additive mask) against the unfused fallback and a naive softmax, rows with no
key included; and a candidate whose index lists every causal block is scored from the dense reference, with
the error the kernel run would have (0 up to rounding)."""

from __future__ import annotations

import pytest
import torch

import sparsesearch.kernels.torch_sparse as ts
from sparsesearch.search.cost import AnalyticCost
from sparsesearch.search.layer import Timings, score_candidate, space_reference
from sparsesearch.search.space import parse_space


def _naive(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, lse


@pytest.mark.parametrize("fused", [True, False])
def test_masked_attention_matches_a_naive_softmax(monkeypatch, fused):
    if not fused:
        monkeypatch.setattr(ts, "_CPU_FLASH", None)
    elif ts._CPU_FLASH is None:
        pytest.skip("this torch has no fused CPU attention op")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, n, 16, generator=gen) for n in (32, 48, 48))
    allowed = torch.rand(2, 3, 4, 32, 48, generator=gen) < 0.3
    allowed[0, 1, 2, 5] = False  # a row with no key
    out, lse = ts.masked_attention(q, k, v, allowed, 0.25)
    ref_out, ref_lse = _naive(q, k, v, allowed, 0.25)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
    assert lse[0, 1, 2, 5] == float("-inf") and bool((out[0, 1, 2, 5] == 0).all())
    ok = allowed.any(-1)
    torch.testing.assert_close(lse[ok], ref_lse[ok], atol=2e-6, rtol=1e-5)


def _space(candidates):
    return parse_space({"name": "t", "format": 1, "reference_tokens": 512, "block_m": 64, "block_n": 64, "scaled_params": [],
                        "target": {"pattern": "ashape", "params": {"sink": 64, "local": 128}}, "budget_slack": 10.0,
                        "candidates": candidates}, "t")


@pytest.mark.parametrize("pattern, params, covers", [
    ("vertical_slash", {"vertical_size": 1024, "slash_size": 1024, "last_q": 64}, True),  # every block: from the reference
    ("vertical_slash", {"vertical_size": 64, "slash_size": 64, "last_q": 64}, True),  # forced lines cover every block here
    ("block_topk", {"k_blocks": 4, "sink_blocks": 1}, False),  # some blocks: run
    ("ashape", {"sink": 1, "local": 1000}, False),  # every block listed, tokens masked in the partial ones: run
])
def test_a_candidate_covering_every_block_scores_as_its_kernel_runs(monkeypatch, pattern, params, covers):
    import sparsesearch.search.layer as layer

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 1024, 64, generator=gen) for h in (4, 2, 2))
    sp = _space([{"pattern": pattern, "params": params}])
    cand, scale = sp.candidates[0], 64**-0.5
    ref = space_reference(q, k, v, sp, "kv", scale)
    score = lambda: score_candidate(cand, sp.resolve(cand, 1024), q, k, v, *ref, "kv", 64, 64, scale, AnalyticCost(), Timings())  # noqa: E731
    fast = score()
    monkeypatch.setattr(layer, "_DENSE_COVER", False)
    slow = score()
    # block density counts an A-shape's partial blocks whole, so it reads 1.0 although tokens are masked
    assert bool((fast.density == 1.0).all()) == (covers or pattern == "ashape")
    assert bool((fast.error == 0).all()) == covers  # taken: exactly the reference; a run differs by rounding at least
    torch.testing.assert_close(fast.error, slow.error, atol=1e-5, rtol=0)
    assert bool((slow.error < 1e-5).all()) == covers
