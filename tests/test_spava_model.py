"""SPAVA inside transformers models on gloo: each rank runs the layers on its local tokens with global
RoPE positions; the query logits are compared with the dense single-process model on every rank."""

from __future__ import annotations

import pytest
import torch

from sparsesearch.reference import relative_error
from sparsesearch.spava.group import spawn
from sparsesearch.spava.layout import Layout
from sparsesearch.spava.model import RankContext, tail_logits
from tiny_model import make_tiny_gemma, make_tiny_model

TOL = 1e-4


def _model_worker(rank, world, path, n_ctx, q, l_a, l_p, covering):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    lay = Layout(n_ctx, q, world, l_a, l_p)
    ids = torch.randint(0, 1000, (2, lay.n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(input_ids=ids).logits[:, -q:].float()
    spava = tail_logits(model, ids, RankContext.spava(lay, rank), q, owner=rank == 0)
    ring = tail_logits(model, ids, RankContext.ring(lay.n, rank, world), q, owner=True)
    assert relative_error(ring, dense) < TOL, f"rank {rank}: ring vs dense {relative_error(ring, dense):.2e}"
    err = relative_error(spava, dense)
    if covering:
        assert err < TOL, f"rank {rank}: SPAVA with covering l_p vs dense {err:.2e}"
    elif world > 1:
        assert err > TOL, f"rank {rank}: SPAVA dropped no key? {err:.2e}"
    same = [torch.empty_like(spava) for _ in range(world)]
    dist.all_gather(same, spava)
    assert all(torch.equal(s, spava) for s in same), f"rank {rank}: query logits differ between ranks"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    return make_tiny_gemma(tmp_path_factory.mktemp("tiny-gemma"))


def _llama_cases(rank, world, path):
    _model_worker(rank, world, path, 16 + 4 * 40, 9, 16, 40, True)  # l_p covers every block: dense
    _model_worker(rank, world, path, 201, 7, 13, 5, False)  # odd lengths, approximate


def test_llama_two_processes(tiny_llama):
    spawn(_llama_cases, 2, tiny_llama, timeout_s=120)


@pytest.mark.slow
def test_gemma_hybrid_two_processes(tiny_gemma):
    # window 48 > block 30: a sliding row's window spans earlier blocks on the other rank (the halo)
    spawn(_model_worker, 2, tiny_gemma, 8 + 4 * 30, 5, 8, 30, True, timeout_s=90)


@pytest.mark.slow
def test_llama_and_gemma_four_processes(tiny_llama, tiny_gemma):
    spawn(_model_worker, 4, tiny_llama, 16 + 8 * 20, 9, 16, 20, True, timeout_s=120)
    spawn(_model_worker, 4, tiny_gemma, 8 + 8 * 16, 5, 8, 16, True, timeout_s=120)
