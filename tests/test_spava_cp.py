"""torch context_parallel as SPAVA's exact engine (issue P15 §1): the hybrid engine (global layers through
torch CP, sliding layers through our ring on torch's shards), the shard check, the bytes it reports, GPU
attention timing by CUDA events, the launcher's Triton mode, and benchmarks/spava_cp.py's logic.

torch has no CPU sharding rule for SDPA, so on CPU the global layers' ``cp_attention`` is replaced by an exact
attention over the all-gathered shards (``_exact_over_shards``); everything else — torch's own
``context_parallel`` sharding the positions, the dispatch per layer, our ring for the sliding layers, the byte
count — is the real code. The real torch CP path is checked on GPUs (test_spava_model.py, benchmarks/spava_cp.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sparsesearch.reference import masked_attention, relative_error
from sparsesearch.spava.exact import (TORCH_CP, TORCH_CP_SLIDING_RING, ZIGZAG_RING, check_zigzag_shard, exact_engine,
                                      position_mask, zigzag_positions)
from sparsesearch.spava.group import spawn
from test_spava import one_process_group  # noqa: F401  (fixture: a gloo group of one in this process)
from tiny_model import GEMMA_LAYER_TYPES, tiny_gemma_config

TOL = 1e-4


def _exact_over_shards(pos: torch.Tensor, calls: list):
    """A stand-in for exact.cp_attention on CPU: this rank's rows (global positions pos) over every rank's keys,
    all-gathered, under the causal mask by position. Records each call's local length in `calls`."""

    def attend(q, k, v, scale):
        calls.append(q.shape[2])
        world = dist.get_world_size()
        gather = lambda t: torch.cat(_all_gather(t.contiguous(), world), dim=-2 if t.dim() > 1 else 0)
        k_all, v_all, k_pos = gather(k), gather(v), gather(pos)
        return masked_attention(q, k_all, v_all, position_mask(pos, k_pos), scale=scale)[0].to(q.dtype)

    return attend


def _all_gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    got = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(got, t)
    return got


def _hybrid_cp_worker(rank, world):
    """The tiny hybrid Gemma 3 through TORCH_CP_SLIDING_RING equals the dense model; torch CP's stand-in ran on
    the global layers only, and the bytes are torch's ring (global layers) plus ours (sliding layers)."""
    from transformers import Gemma3ForCausalLM

    import sparsesearch.spava.model as spava_model
    from sparsesearch.spava.run import cp_bytes_sent, exact_logits

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_gemma_config()).eval()
    n, q = 2 * world * 40, 7  # chunks of 40 < window 48: a sliding row's window reaches the other rank's chunk
    ids = torch.randint(0, 128, (2, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = model(input_ids=ids).logits[:, -q:].float()
    calls: list = []
    pos = torch.tensor(zigzag_positions(n, world, rank))
    spava_model.cp_attention = _exact_over_shards(pos, calls)  # this spawned process only
    logits, ctx, _ = exact_logits(model, ids, TORCH_CP_SLIDING_RING, q, rank, world, torch.device("cpu"))
    assert torch.equal(ctx.pos, pos), f"rank {rank}: torch's shard {ctx.pos[:4].tolist()} is not the zigzag layout"
    err = relative_error(logits, dense)
    assert err < TOL, f"rank {rank}: torch CP + sliding ring vs dense {err:.2e}"
    globals_ = GEMMA_LAYER_TYPES.count("full_attention")
    assert calls == [n // world] * globals_, f"rank {rank}: cp_attention calls {calls}, want {globals_} global layers"
    cfg = model.config
    ring = (GEMMA_LAYER_TYPES.count("sliding_attention") * (world - 1) * 2 * cfg.num_key_value_heads * (n // world)
            * 2 * cfg.head_dim * 4)  # our ring: each sliding layer's K‖V shard [B, Hkv, N_r, 2D] fp32, W - 1 hops
    want = cp_bytes_sent(cfg, 2, n // world, world, 4, globals_) + ring
    assert ctx.stats["bytes_sent"] == want, f"rank {rank}: bytes {ctx.stats['bytes_sent']} != {want}"


def test_hybrid_torch_cp_one_process(one_process_group):
    _hybrid_cp_worker(0, 1)


def test_hybrid_torch_cp_two_processes():
    spawn(_hybrid_cp_worker, 2, timeout_s=120)


def test_cp_bytes_count_the_layers_asked_for():
    cfg = tiny_gemma_config()
    per_layer = 2 * 1 * cfg.num_attention_heads * 100 * cfg.head_dim * 2  # K and V, heads repeated for GQA, bf16
    from sparsesearch.spava.run import cp_bytes_sent

    assert cp_bytes_sent(cfg, 1, 100, 2, 2) == len(GEMMA_LAYER_TYPES) * per_layer
    assert cp_bytes_sent(cfg, 1, 100, 4, 2, layers=2) == 2 * 3 * per_layer


def test_exact_engine_names_the_hybrid():
    assert exact_engine(None, 256, 2, sliding=True) == (TORCH_CP_SLIDING_RING, None)
    assert exact_engine(None, 256, 2, sliding=False) == (TORCH_CP, None)
    engine, why = exact_engine(None, 250, 2, sliding=True)
    assert engine == ZIGZAG_RING and "divisible by 2W = 4" in why
    assert exact_engine("no rule here", 256, 2, sliding=True) == (ZIGZAG_RING, "no rule here")


def test_check_zigzag_shard_refuses_another_layout():
    n, world = 64, 2
    for rank in range(world):
        check_zigzag_shard(torch.tensor(zigzag_positions(n, world, rank)), n, world, rank)
    contiguous = torch.arange(n // world)  # rank 0 of a plain split: [0, 32) instead of [0, 16) + [48, 64)
    with pytest.raises(ValueError, match="not the zigzag layout"):
        check_zigzag_shard(contiguous, n, world, 0)


class _Event:
    """A CUDA event stand-in: elapsed_time in ms from recorded host numbers."""

    def __init__(self, t: float):
        self.t, self.synced = t, False

    def elapsed_time(self, end: "_Event") -> float:
        return end.t - self.t

    def synchronize(self) -> None:
        self.synced = True


def test_attention_seconds_folds_event_pairs_once():
    from sparsesearch.spava.model import attention_seconds

    last = _Event(40.0)
    stats = {"attention_s": 0.5, "attention_events": [(_Event(0.0), _Event(10.0)), (_Event(20.0), last)]}
    assert attention_seconds(stats) == pytest.approx(0.5 + 0.030)
    assert last.synced and "attention_events" not in stats
    assert attention_seconds(stats) == pytest.approx(0.530)  # a second read counts nothing twice


def test_host_clock_on_cpu_tensors():
    from sparsesearch.spava.model import _start_clock, _stop_clock

    stats: dict = {}
    _stop_clock(stats, _start_clock(torch.zeros(1)))
    assert stats["attention_s"] >= 0 and "attention_events" not in stats


def test_ranks_compile_triton_on_gpus_and_interpret_on_cpu(monkeypatch):
    from sparsesearch.spava.launch import triton_mode

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_mode("gloo") == {"TRITON_INTERPRET": "1"}
    assert triton_mode("nccl") == {"TRITON_INTERPRET": "0"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_mode("nccl") == {"TRITON_INTERPRET": "1"}  # the caller's choice stands


def test_benchmark_methods_and_speedups():
    from benchmarks.spava_cp import methods_for, speedups

    assert methods_for(None, 256, 2, hybrid=True) == ([TORCH_CP_SLIDING_RING, ZIGZAG_RING, "spava"], None)
    assert methods_for("no CPU rule", 256, 2, hybrid=False) == ([ZIGZAG_RING, "spava"], "no CPU rule")
    rows = [{"method": "dense", "wall_ms": 300.0}, {"method": TORCH_CP, "wall_ms": 200.0}, {"method": ZIGZAG_RING, "wall_ms": 150.0},
            {"method": TORCH_CP, "error": "failed"}, {"method": "spava", "wall_ms": 50.0}]
    speedups(rows)
    assert rows[-1] == {"method": "spava", "wall_ms": 50.0, f"speedup_vs_{TORCH_CP}": 4.0, f"speedup_vs_{ZIGZAG_RING}": 3.0,
                        "speedup_vs_dense_1gpu": 6.0}


@pytest.mark.parametrize("args,message", [
    (["--shape", "9b"], "--shape must be one of"),
    (["--tokens", "1001"], "divisible by 2W = 2"),
    (["--tokens", "64"], "longer than the query"),
    (["--tokens", "2k"], "comma-separated integers"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--save", "/tmp/x"], "--save needs --tokenizer"),
    (["--backend", "mpi"], "backend must be auto, gloo or nccl"),
])
def test_benchmark_bad_input_is_one_line_exit_2(args, message, capsys, monkeypatch):
    from benchmarks.spava_cp import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--quick", *args])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not dist.is_initialized()  # refused before any process group


def test_probe_inputs_do_not_depend_on_the_rank_rng():
    """torch_cp_support compares every rank's shard against its own dense SDPA: the inputs must be the same on
    every rank. Two 'ranks' with different global RNG states get the same tensors."""
    from sparsesearch.spava.exact import probe_inputs

    torch.manual_seed(1)
    a = probe_inputs(32, torch.device("cpu"))
    torch.manual_seed(2)
    b = probe_inputs(32, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # q, k, v are three draws, not one tensor thrice


def test_untimed_first_prefill_on_gpus_only():
    from sparsesearch.spava.run import warm_on_gpu

    calls: list = []
    warm_on_gpu(lambda: calls.append("cpu"), torch.device("cpu"))
    warm_on_gpu(lambda: calls.append("cuda"), torch.device("cuda", 0))
    assert calls == ["cuda"]


@pytest.mark.parametrize("changes,message", [
    ({"backend": "nccl", "nproc": 2}, "nproc 2 is more than the 1 GPUs here"),  # one GPU faked below
    ({"backend": "mpi"}, "backend must be auto, gloo or nccl"),
    ({"nproc": 600, "tokens": [1024]}, "larger than this context allows"),  # more ranks than the prompt splits into
    ({"anchors": [100]}, "multiple of 128"),
])
def test_refused_launch_starts_no_process(monkeypatch, changes, message):
    """Issue P15 §5: a launch refused for its input raises one line before any process starts (torchrun is
    never called) and leaves no child process behind."""
    import psutil

    import sparsesearch.spava.launch as launch_mod
    from sparsesearch.spava.run import SpavaConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started: list = []
    monkeypatch.setattr(launch_mod.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("torchrun started"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = SpavaConfig(**{"backend": "gloo", **changes})
    with pytest.raises(ValueError, match=message) as refused:
        launch_mod.launch(cfg)
    assert "\n" not in str(refused.value) and not started
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
