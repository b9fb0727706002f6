"""TriangleMix probe sections: torch path and Triton kernel against autograd on an explicit θ.

The oracle is a plain torch attention layer whose causal softmax probabilities are multiplied by θ (ones,
requires_grad); y = (O · W).sum() so ∂y/∂O = W is the dO the section-sum paths are fed with. Low-precision
tolerance follows flash-attention's tests: within twice the error of the same oracle run in the inputs'
precision, plus a floor.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICE
from sparsesearch.probe.sections import (
    LAST, MIDDLE, STREAM, SectionSpec, SectionSums, section_counts, section_of, section_sums, section_sums_auto, section_sums_torch,
)
from sparsesearch.reference import masked_attention


def inputs(batch, q_heads, kv_heads, n, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, h, n, dim, generator=gen).to(dtype)
    return make(q_heads), make(kv_heads), make(kv_heads), make(q_heads)


def brute_force(q, k, v, w, spec, compute=torch.float64):
    """Autograd through θ ⊙ causal softmax; section sums of θ.grad, |θ.grad| and P (float64) and counts."""
    batch, q_heads, n, dim = q.shape
    group = q_heads // k.shape[1]
    qc, kc, vc, wc = (t.to(compute) for t in (q, k, v, w))
    kc, vc = kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = (qc @ kc.transpose(-1, -2) / math.sqrt(dim)).masked_fill(~causal, float("-inf"))
    probs = scores.softmax(-1)
    theta = torch.ones(batch, q_heads, n, n, dtype=compute, requires_grad=True)
    out = (theta * probs) @ vc
    (out * wc).sum().backward()
    sec = section_of(torch.arange(n)[:, None], torch.arange(n)[None, :], n, spec)
    grad = theta.grad.double()
    pick = lambda t, s: (t.double() * (sec == s)).sum((-1, -2))
    stack = lambda t: torch.stack([pick(t, s) for s in (STREAM, MIDDLE, LAST)], -1)
    counts = torch.stack([(sec == s).sum() for s in (STREAM, MIDDLE, LAST)])
    return SectionSums(stack(grad), stack(grad.abs()), stack(probs.detach()), counts)


def errors(got: SectionSums, ref: SectionSums) -> torch.Tensor:
    """Per-quantity max error: signed grad relative to Σ|grad| (cancellation), |grad| and P relative to themselves."""
    tiny = 1e-30
    return torch.stack([
        ((got.grad_sum.cpu() - ref.grad_sum) / ref.abs_grad_sum.clamp_min(tiny)).abs().max(),
        ((got.abs_grad_sum.cpu() - ref.abs_grad_sum) / ref.abs_grad_sum.clamp_min(tiny)).abs().max(),
        ((got.prob_sum.cpu() - ref.prob_sum) / ref.prob_sum.clamp_min(tiny)).abs().max(),
    ])


def run_both(q, k, v, do, spec, config=None):
    """(torch path, kernel) fed with lse of the fp32 dense pass."""
    _, lse = masked_attention(q, k, v)
    torch_sums = section_sums_torch(q, k, v, do, lse, spec)
    dev = lambda t: t.to(DEVICE)
    kernel_sums = section_sums(dev(q), dev(k), dev(v), dev(do), dev(lse), spec, config=config)
    return torch_sums, kernel_sums


CASES = [
    # batch, q_heads, kv_heads, n, dim, spec
    (2, 2, 2, 77, 64, SectionSpec(sink=4, window=8, last=5)),
    (2, 6, 2, 130, 80, SectionSpec(sink=3, window=16, last=20)),
    (2, 3, 1, 130, 64, SectionSpec(sink=0, window=1, last=1)),
    (2, 3, 1, 77, 80, SectionSpec(sink=5, window=500, last=3)),
    (2, 2, 2, 77, 64, SectionSpec(sink=2, window=4, last=77)),
    (1, 3, 1, 50, 64, SectionSpec(sink=100, window=3, last=200)),
]
CASE_IDS = ["b{}_hq{}_hk{}_n{}_d{}".format(*c[:5]) + f"_s{c[5].sink}w{c[5].window}l{c[5].last}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_matches_autograd(case):
    batch, q_heads, kv_heads, n, dim, spec = case
    q, k, v, w = inputs(batch, q_heads, kv_heads, n, dim, torch.float32)
    ref = brute_force(q, k, v, w, spec)
    for got in run_both(q, k, v, w, spec):
        assert torch.equal(got.count.cpu(), ref.count)
        assert not any(torch.isnan(t).any() for t in (got.grad_sum, got.abs_grad_sum, got.prob_sum))
        assert bool((errors(got, ref) <= 1e-4).all()), errors(got, ref)
        torch.testing.assert_close(got.prob_sum.sum(-1).cpu(), torch.full((batch, q_heads), float(n), dtype=torch.float64), rtol=1e-5, atol=0)
        torch.testing.assert_close(got.means().grad.cpu(), ref.means().grad, rtol=0, atol=1e-4 * float(ref.means().abs_grad.max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[CASE_IDS[1], CASE_IDS[3]])
def test_low_precision_within_reference_error(case, dtype):
    batch, q_heads, kv_heads, n, dim, spec = case
    q, k, v, w = inputs(batch, q_heads, kv_heads, n, dim, dtype, seed=1)
    ref = brute_force(q, k, v, w, spec)  # exact math on the rounded inputs
    low = brute_force(q, k, v, w, spec, compute=dtype)
    budget = 2 * errors(low, ref) + 1e-3
    for got in run_both(q, k, v, w, spec):
        assert bool((errors(got, ref) <= budget).all()), (errors(got, ref), budget)


def test_window_and_sink_at_tile_edges():
    """Sink/window values around the 16-wide tiles: the kernel's interior (unmasked) tiles must start and
    stop exactly where the STREAM mask does."""
    q, k, v, w = inputs(1, 1, 1, 70, 64, torch.float32, seed=4)
    _, lse = masked_attention(q, k, v)
    dev = [t.to(DEVICE) for t in (q, k, v, w, lse)]
    for sink in (0, 1, 16, 17):
        for window in (1, 2, 15, 16, 17, 18, 33):
            spec = SectionSpec(sink=sink, window=window, last=3)
            want = section_sums_torch(q, k, v, w, lse, spec)
            got = section_sums(*dev, spec, config={"BLOCK_M": 16, "BLOCK_N": 16})
            assert bool((errors(got, want) <= 1e-5).all()), (spec, errors(got, want))


def test_strided_inputs_and_fp32_do():
    """[B, N, H, D] storage viewed as [B, H, N, D]; dO in fp32 next to bf16 q/k/v."""
    spec = SectionSpec(sink=2, window=8, last=10)
    gen = torch.Generator().manual_seed(3)
    make = lambda h: torch.randn(2, 70, h, 64, generator=gen).transpose(1, 2)
    q, k, v, w = make(4), make(2), make(2), make(4)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    ref = brute_force(qb, kb, vb, w, spec)
    _, lse = masked_attention(qb, kb, vb)
    got = section_sums(*(t.to(DEVICE) for t in (qb, kb, vb, w, lse)), spec)
    assert bool((errors(got, ref) <= 1e-4).all()), errors(got, ref)


def test_counts_match_brute_force():
    for n in (1, 2, 7, 33, 100):
        for spec in (SectionSpec(0, 1, 1), SectionSpec(3, 5, 4), SectionSpec(50, 2, 1), SectionSpec(1, 200, 300), SectionSpec(4, 4, n)):
            sec = section_of(torch.arange(n)[:, None], torch.arange(n)[None, :], n, spec)
            brute = torch.stack([(sec == s).sum() for s in (STREAM, MIDDLE, LAST)])
            assert torch.equal(section_counts(n, spec), brute), (n, spec)
            assert int(brute.sum()) == n * (n + 1) // 2


def test_last_rows_only_gradient_leaves_stream_and_middle_zero():
    """y depending on the last output row only (the last layer's case): STREAM and MIDDLE grads are exactly 0."""
    spec = SectionSpec(sink=2, window=4, last=1)
    q, k, v, w = inputs(1, 4, 2, 45, 64, torch.float32, seed=2)
    w[:, :, :-1] = 0
    for got in run_both(q, k, v, w, spec, config={"BLOCK_M": 16, "BLOCK_N": 16}):
        assert bool((got.grad_sum[..., [STREAM, MIDDLE]] == 0).all())
        assert bool((got.abs_grad_sum[..., [STREAM, MIDDLE]] == 0).all())
        assert bool((got.abs_grad_sum[..., LAST] > 0).all())


def test_single_row_middle_is_empty_and_mean_is_zero():
    q, k, v, w = inputs(1, 2, 1, 1, 64, torch.float32)
    for got in run_both(q, k, v, w, SectionSpec(sink=0, window=1, last=1)):
        assert got.count.tolist() == [0, 0, 1]
        means = got.means()
        for t in (means.grad, means.abs_grad, means.prob):
            assert not torch.isnan(t).any()
            assert bool((t[..., [STREAM, MIDDLE]] == 0).all())
        torch.testing.assert_close(means.prob[..., LAST].cpu(), torch.ones(1, 2, dtype=torch.float64), rtol=1e-6, atol=0)


def test_auto_dispatch_on_cpu_uses_torch():
    spec = SectionSpec(sink=1, window=3, last=4)
    q, k, v, w = inputs(1, 2, 2, 20, 64, torch.float32)
    _, lse = masked_attention(q, k, v)
    got = section_sums_auto(q, k, v, w, lse, spec)
    want = section_sums_torch(q, k, v, w, lse, spec, chunk=7)
    assert bool((errors(got, want) <= 1e-5).all()), errors(got, want)


@pytest.mark.parametrize("kwargs", [dict(sink=-1, window=1, last=1), dict(sink=0, window=0, last=1), dict(sink=0, window=1, last=0), dict(sink=0.5, window=1, last=1)])
def test_bad_spec_raises(kwargs):
    with pytest.raises(ValueError, match="SectionSpec"):
        SectionSpec(**kwargs)


def _good():
    q, k, v, w = (t.to(DEVICE) for t in inputs(1, 4, 2, 40, 64, torch.float16))
    return q, k, v, w, torch.zeros(1, 4, 40, device=DEVICE)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v, w, l: (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), w[..., :48].contiguous(), l), "head_dim must be one of"),
        (lambda q, k, v, w, l: (q, k.float(), v, w, l), "dtype"),
        (lambda q, k, v, w, l: (q.int(), k, v, w, l), "dtype must be floating"),
        (lambda q, k, v, w, l: (q[:, :3], k, v, w[:, :3], l[:, :3]), "multiple of KV heads"),
        (lambda q, k, v, w, l: (q, k, v[:, :, :10], w, l), "shapes differ"),
        (lambda q, k, v, w, l: (q[:, :, :20], k, v, w[:, :, :20], l[:, :, :20]), "prefill"),
        (lambda q, k, v, w, l: (q, k, v, w[:, :, :20], l), "do must have"),
        (lambda q, k, v, w, l: (q, k, v, w, l[:, :, :20]), "lse must be"),
        (lambda q, k, v, w, l: (q, k, v, w, l.fill_(float("-inf"))), "non-finite"),
        (lambda q, k, v, w, l: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, w, l), "contiguous in head_dim"),
        (lambda q, k, v, w, l: (q, k, v, w.transpose(-1, -2).contiguous().transpose(-1, -2), l), "contiguous head_dim"),
        (lambda q, k, v, w, l: (q, k, v, w.double(), l), "do must be float16"),
    ],
)
def test_bad_input_raises(mutate, message):
    args = mutate(*_good())
    with pytest.raises(ValueError, match=message):
        section_sums(*args, SectionSpec(1, 2, 3))


def test_bad_spec_type_raises():
    with pytest.raises(ValueError, match="SectionSpec"):
        section_sums(*_good(), (1, 2, 3))
