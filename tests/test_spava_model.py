"""SPAVA inside transformers models on gloo: each rank runs the layers on its local tokens with global
RoPE positions; the query logits are compared with the dense single-process model on every rank."""

from __future__ import annotations

import pytest
import torch

from sparsesearch.reference import relative_error
from sparsesearch.spava.group import spawn
from sparsesearch.spava.layout import Layout
from sparsesearch.spava.model import RankContext, tail_logits
from test_spava import one_process_group  # noqa: F401  (fixture: a gloo group of one in this process)
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
    _model_worker(rank, world, path, 16 + 2 * world * 40, 9, 16, 40, True)  # l_p covers every block: dense
    _model_worker(rank, world, path, 201, 7, 13, 5, False)  # odd lengths, approximate


def test_llama_one_process_in_process(tiny_llama, one_process_group):
    _llama_cases(0, 1, tiny_llama)


@pytest.mark.slow
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


def _vlm_worker(rank, world, path):
    from transformers import LlavaForConditionalGeneration

    from sparsesearch.spava.vision import frame_counts, frame_parallel_embeds

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(2)
    frames, per_frame, image = 5, 16, model.config.image_token_id
    pieces = []
    for _ in range(frames):  # text, frame, text, frame, ... then the question
        pieces += [torch.randint(7, 100, (11,), generator=g), torch.full((per_frame,), image)]
    ids = torch.cat([*pieces, torch.randint(7, 100, (9,), generator=g)])[None]
    pixels = torch.randn(frames, 3, 16, 16, generator=g)
    with torch.no_grad():
        dense = model(input_ids=ids, pixel_values=pixels).logits[:, -9:].float()
        embeds = frame_parallel_embeds(model, ids, pixels)
        assert relative_error(model(inputs_embeds=embeds).logits[:, -9:].float(), dense) < 1e-5, f"rank {rank}: frame-parallel embeddings"
    assert sum(frame_counts(frames, world)) == frames
    n_ctx = ids.shape[1] - 9
    assert (n_ctx - 3) % (2 * world) == 0
    lay = Layout(n_ctx, 9, world, 3, (n_ctx - 3) // (2 * world))  # l_p = the block: SPAVA covers every key
    spava = tail_logits(model, ids, RankContext.spava(lay, rank), 9, owner=rank == 0, embeds=embeds)
    assert relative_error(spava, dense) < TOL, f"rank {rank}: VLM SPAVA vs dense {relative_error(spava, dense):.2e}"


def test_vlm_frame_parallel_one_process_in_process(tmp_path, one_process_group):
    from tiny_vlm import make_tiny_llava

    _vlm_worker(0, 1, make_tiny_llava(tmp_path / "llava"))


@pytest.mark.slow
def test_vlm_frame_parallel_two_processes(tmp_path):
    from tiny_vlm import make_tiny_llava

    spawn(_vlm_worker, 2, make_tiny_llava(tmp_path / "llava"), timeout_s=120)


def _torch_cp_worker(rank, world, path):
    """The exact baseline through torch's context_parallel equals the dense model and our zigzag ring."""
    from transformers import AutoModelForCausalLM

    from sparsesearch.spava.exact import exact_engine, torch_cp_support
    from sparsesearch.spava.run import exact_logits

    device = torch.device("cuda", torch.cuda.current_device())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    reason = torch_cp_support(device)
    assert reason is None, f"rank {rank}: torch context_parallel unusable on {device}: {reason}"
    n, q = 64 * 2 * world, 9
    assert exact_engine(reason, n, world, sliding=False) == ("torch-cp", None)
    ids = torch.randint(0, 1000, (2, n), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        dense = model(input_ids=ids).logits[:, -q:].float()
    cp, ctx, _ = exact_logits(model, ids, "torch-cp", q, rank, world, device)
    ring, _, _ = exact_logits(model, ids, "zigzag-ring", q, rank, world, device)
    assert len(ctx.pos) == ctx.pos.unique().numel() == n // world  # torch's own shard of the positions
    assert relative_error(cp, dense) < 2e-3, f"rank {rank}: torch CP vs dense {relative_error(cp, dense):.2e}"
    assert relative_error(cp, ring) < 2e-3, f"rank {rank}: torch CP vs ring {relative_error(cp, ring):.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch context_parallel runs on CUDA (no CPU sharding rule)")
def test_torch_cp_exact_baseline_on_gpu(tiny_llama):
    spawn(_torch_cp_worker, min(torch.cuda.device_count(), 2), tiny_llama, backend="nccl")


def test_exact_engine_falls_back_with_the_reason(one_process_group):
    import torch.nn.functional as F

    from sparsesearch.spava.exact import exact_engine, torch_cp_support

    sdpa = F.scaled_dot_product_attention
    reason = torch_cp_support(torch.device("cpu"))
    assert reason is not None  # no sharding rule for the CPU SDPA kernels in this torch
    assert F.scaled_dot_product_attention is sdpa  # a failed probe leaves SDPA as it was (torch 2.11 did not)
    assert exact_engine(reason, 256, 1, sliding=False) == ("zigzag-ring", reason)
    assert exact_engine(None, 256, 2, sliding=True)[0] == "torch-cp+sliding-ring"  # sliding layers ride our ring (test_spava_cp.py)
    engine, why = exact_engine(None, 250, 2, sliding=False)
    assert engine == "zigzag-ring" and "divisible by 2W = 4" in why
    assert exact_engine(None, 256, 2, sliding=False) == ("torch-cp", None)
