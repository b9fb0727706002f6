"""SPAVA against torch's own context parallelism, whole-model prefill on W ranks (issue P15 §1).

One torchrun launch, one rank per GPU (NCCL), a random-weight model stack in bf16 (the same weights on every
rank: built on rank 0's seed and broadcast). Per prompt length, on random token ids, four prefills:

* ``dense`` — the whole prompt on rank 0's GPU alone, the model's own SDPA attention: the reference;
* the exact baseline ``exact.exact_engine`` picks — ``torch-cp`` (torch's ``context_parallel``: ring attention
  over its load-balanced head-tail shards) or, for a hybrid stack, ``torch-cp+sliding-ring`` (global layers
  through torch's ring, sliding-window layers through our zigzag ring on the same shards, as ``spava run`` runs
  them), or ``zigzag-ring`` with the reason torch CP did not run;
* ``zigzag-ring`` — our exact ring over the zigzag shards (all layers);
* ``spava`` — the approximate prefill at the paper's default l_a / l_p (or --anchor / --passing).

The distributed prefills are the same functions ``sparsesearch spava run`` times (``run.exact_logits``,
``model.tail_logits``). Each is run once untimed, then --reps times; a row gives the slowest rank's wall time
per rep (GPU synchronized on both ends) and its median, each rank's attention time (CUDA events around every
attention call: waits for peers included) and bytes sent in the last rep, and the query logits' KL, relative
error and top-1 agreement vs dense. SPAVA rows name the exact engines their speed-ups are against.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/spava_cp.py --shape 8b --tokens 32768,131072 \\
        --out benchmarks/results/spava_cp_h200x2.jsonl
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/spava_cp.py --shape gemma3-270m --tokens 32768
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/spava_cp.py --quick      # CPU smoke run (gloo; torch CP refused)

``--save DIR --tokenizer TOKDIR`` writes the stack (random weights, TOKDIR's tokenizer) as an HF directory and
exits, so that ``sparsesearch spava run --model DIR`` can take it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Gemma 3 270M's text stack (its config, read from the GGUF): 18 layers, every 6th global, window 512.
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])
# --quick: CPU-sized stacks (every code path, none of the work)
TINY = {"tiny-llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
        "tiny-gemma": dict(GEMMA3_270M, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=32,
                           query_pre_attn_scalar=32, sliding_window=48, layer_types=["sliding_attention"] * 5 + ["full_attention"])}


def stack_config(shape: str, max_tokens: int):
    """The transformers config of a stack: 8b / 7b / smollm2 (benchmarks/ttft.py's Llama shapes), gemma3-270m
    (hybrid), or a --quick tiny one. max_tokens: the positions it must hold."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from benchmarks.ttft import SHAPES

    if "gemma" in shape:
        kwargs = GEMMA3_270M if shape == "gemma3-270m" else TINY[shape]
        return Gemma3TextConfig(**kwargs, max_position_embeddings=max_tokens, attn_implementation="sdpa")
    kwargs = SHAPES[shape] if shape in SHAPES else TINY[shape]
    return LlamaConfig(**kwargs, max_position_embeddings=max_tokens, attn_implementation="sdpa", tie_word_embeddings=False)


SHAPE_NAMES = ("8b", "7b", "smollm2", "gemma3-270m", *TINY)


def build_stack(shape: str, max_tokens: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight stack in eval mode on `device`, initialised in `dtype` (an 8B stack never exists in fp32);
    with a process group, every rank gets rank 0's weights."""
    torch.manual_seed(seed)
    config = stack_config(shape, max_tokens)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = causal_lm(config).eval()
    finally:
        torch.set_default_dtype(previous)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:  # bit-identical weights whatever each GPU's init did
            dist.broadcast(t.data, src=0)
    return model


def causal_lm(config):
    """The causal-LM class of a stack config built directly (from_config may build on another device first)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

    return (Gemma3ForCausalLM if isinstance(config, Gemma3TextConfig) else LlamaForCausalLM)(config)


def save_stack(shape: str, tokenizer_dir: str, out: str, max_tokens: int) -> None:
    """Write a random-weight stack with the tokenizer in `tokenizer_dir` as an HF directory (bf16)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = stack_config(shape, max_tokens)
    config.vocab_size = len(tok)  # the tokenizer's ids must all exist
    torch.manual_seed(0)
    # built on a GPU when there is one: an 8B stack's random init takes minutes on host cores
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = causal_lm(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _per_rank(x: float, device: torch.device) -> list[float]:
    """x of every rank, in rank order (the group's device carries it: NCCL has no CPU tensors)."""
    mine = torch.tensor([float(x)], dtype=torch.float64, device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    return [float(t) for t in got]


def dense_logits(model, ids: torch.Tensor, query: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """The whole prompt on rank 0's GPU alone -> (query logits fp32 [B, query, V] on every rank, seconds).
    The other ranks wait at the broadcast; a warm-up at 1/8 of the length keeps first-call costs out."""
    from sparsesearch.spava.run import _sync

    seconds = 0.0
    logits = torch.empty(ids.shape[0], query, model.config.vocab_size, device=device)
    if dist.get_rank() == 0:
        with torch.no_grad():
            model(input_ids=ids[:, : max(query, ids.shape[1] // 8)], logits_to_keep=1, use_cache=False)
            _sync()
            start = time.perf_counter()
            logits = model(input_ids=ids, logits_to_keep=query, use_cache=False).logits.float()
            _sync()
            seconds = time.perf_counter() - start
    dist.broadcast(logits, src=0)
    return logits, seconds


def prefill(method: str, model, ids: torch.Tensor, query: int, layout, device: torch.device):
    """One distributed prefill -> (query logits fp32 [B, query, V], its RankContext, slowest rank's seconds).
    method: an exact engine name (run.exact_logits) or "spava" (layout: the SPAVA Layout)."""
    from sparsesearch.spava.model import RankContext, tail_logits
    from sparsesearch.spava.run import _timed, exact_logits

    rank, world = dist.get_rank(), dist.get_world_size()
    if method != "spava":
        return exact_logits(model, ids, method, query, rank, world, device)
    ctx = RankContext.spava(layout, rank)
    logits, _, seconds = _timed(lambda: tail_logits(model, ids, ctx, query, owner=rank == 0), None)
    return logits, ctx, seconds


def measure(method: str, model, ids: torch.Tensor, query: int, layout, reps: int, device: torch.device, dense: torch.Tensor) -> dict:
    """One untimed prefill, then `reps` timed; the row fields of the method (times in ms)."""
    from sparsesearch.spava.model import attention_seconds
    from sparsesearch.spava.run import quality

    prefill(method, model, ids, query, layout, device)
    walls = []
    for _ in range(reps):
        logits, ctx, seconds = prefill(method, model, ids, query, layout, device)
        walls.append(seconds * 1e3)
    q = quality(logits, dense, ids, 0)
    return {"wall_ms": round(sorted(walls)[len(walls) // 2], 2), "wall_ms_reps": [round(w, 2) for w in walls],
            "attention_ms_per_rank": [round(s * 1e3, 2) for s in _per_rank(attention_seconds(ctx.stats), device)],
            "bytes_per_rank": [int(b) for b in _per_rank(ctx.stats.get("bytes_sent", 0), device)],
            "kl_vs_dense": q["kl"], "logit_rel_error_vs_dense": q["logit_rel_error"], "top1_vs_dense": q["top1_agreement"]}


def methods_for(cp_reason: str | None, n: int, world: int, hybrid: bool) -> tuple[list[str], str | None]:
    """The distributed prefills of one length, in run order, and why torch CP is not among them (None if it is):
    the exact engine exact_engine picks, our ring (when that was not it already), then SPAVA."""
    from sparsesearch.spava.exact import ZIGZAG_RING, exact_engine

    engine, why = exact_engine(cp_reason, n, world, hybrid)
    return list(dict.fromkeys([engine, ZIGZAG_RING, "spava"])), why


def speedups(rows: list[dict]) -> None:
    """Each SPAVA row of one length gets wall-time speed-ups over every exact row beside it, the reference named."""
    spava = [r for r in rows if r["method"] == "spava" and "wall_ms" in r]
    for row in spava:
        for ref in rows:
            if ref["method"] not in ("spava", "dense") and "wall_ms" in ref:
                row[f"speedup_vs_{ref['method']}"] = round(ref["wall_ms"] / row["wall_ms"], 3)
        dense = [r for r in rows if r["method"] == "dense"]
        if dense and dense[0]["wall_ms"]:
            row["speedup_vs_dense_1gpu"] = round(dense[0]["wall_ms"] / row["wall_ms"], 3)


def length_rows(a, model, n: int, base: dict, cp_reason: str | None, hybrid: bool, device: torch.device, emit) -> list[dict]:
    """Every method's row at prompt length n, each passed to emit(row) as soon as it is measured (a run cut
    short keeps what it had). A method that raises gets a row with its error line; so does torch CP where
    exact_engine did not pick it (the reason)."""
    from sparsesearch.spava.layout import Layout, check_lengths, default_lengths

    world = dist.get_world_size()
    la0, lp0 = default_lengths(n)
    layout = Layout(n - a.query, a.query, world, a.anchor or la0, a.passing or lp0)
    check_lengths(layout)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    dense, dense_s = dense_logits(model, ids, a.query, device)
    rows = [{**base, "tokens": n, "method": "dense", "gpus": 1, "wall_ms": round(dense_s * 1e3, 2)}]
    methods, why_not_cp = methods_for(cp_reason, n, world, hybrid)
    if why_not_cp is not None:
        rows.append({**base, "tokens": n, "method": "torch-cp", "gpus": world, "error": why_not_cp})
    for row in rows:
        emit(row)
    for method in methods:
        row = {**base, "tokens": n, "method": method, "gpus": world, "torch_cp_note": why_not_cp}
        if method == "spava":
            row.update(l_a=layout.l_a, l_p=layout.l_p, passing_used=layout.passing)
        try:
            row.update(measure(method, model, ids, a.query, layout, a.reps, device, dense))
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # torch CP refusing a shape: the row says so
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        rows.append(row)
        speedups(rows)  # SPAVA runs last: its row is complete before it is emitted
        emit(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help=f"One of {', '.join(SHAPE_NAMES)} (default 8b; --quick: tiny-llama).")
    ap.add_argument("--tokens", default=None, help="Comma-separated prompt lengths, each divisible by 2W (default 32768,131072).")
    ap.add_argument("--query", type=int, default=128, help="Query block: the prompt's last N tokens, whose logits are compared.")
    ap.add_argument("--anchor", type=int, default=None, help="l_a (default: the paper's n/64 rounded up to 128).")
    ap.add_argument("--passing", type=int, default=None, help="l_p (default: n/128 rounded up to 128).")
    ap.add_argument("--reps", type=int, default=None, help="Timed prefills per method after one untimed (default 3; --quick 1).")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--timeout", type=float, default=600.0, help="Seconds any collective may wait.")
    ap.add_argument("--quick", action="store_true", help="CPU-sized: a tiny stack at 1024 tokens, query 64, 1 rep.")
    ap.add_argument("--out", default=None, help="Rows appended here as JSON lines (rank 0).")
    ap.add_argument("--save", default=None, help="Write the stack as an HF directory here (needs --tokenizer) and exit.")
    ap.add_argument("--tokenizer", default=None, help="With --save: a directory holding the tokenizer to save with it.")
    a = ap.parse_args(argv)
    defaults = {"shape": "tiny-llama", "tokens": "1024", "reps": 1} if a.quick else {"shape": "8b", "tokens": "32768,131072", "reps": 3}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.quick and a.query == 128:
        a.query = 64
    return a


def check_args(a, world: int) -> None:
    """ValueError (one line) for anything bad before a model is built."""
    if a.shape not in SHAPE_NAMES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPE_NAMES)}, got {a.shape!r}")
    if a.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {a.reps}")
    if a.save and not a.tokenizer:
        raise ValueError("--save needs --tokenizer (a directory holding the tokenizer)")
    for n in tokens_list(a.tokens):
        if n <= a.query or n % (2 * world):
            raise ValueError(f"--tokens {n}: must be longer than the query ({a.query}) and divisible by 2W = {2 * world}")


def tokens_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--tokens takes comma-separated integers, got {text!r}") from None


def run(a) -> list[dict]:
    """The launch on this rank (process group already up): rows from rank 0, [] elsewhere."""
    from sparsesearch.spava.exact import torch_cp_support
    from sparsesearch.spava.model import has_sliding_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = tokens_list(a.tokens)
    model = build_stack(a.shape, max(lengths), device, dtype)
    hybrid = has_sliding_layers(model)
    cp_reason = torch_cp_support(device)
    cfg = model.config
    base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "backend": dist.get_backend(), "world": world, "shape": a.shape, "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, "hybrid": hybrid,
            "dtype": str(dtype).removeprefix("torch."), "query": a.query, "reps": a.reps,
            "command": f"torchrun --nproc_per_node {world} {shlex.join(sys.argv)}"}
    rows = []
    for n in lengths:
        rows += length_rows(a, model, n, base, cp_reason, hybrid, device, lambda row: emit(row, a.out) if rank == 0 else None)
    return rows if rank == 0 else []


def emit(row: dict, out: str | None) -> None:
    """One row as soon as it exists: a JSON line on stderr and appended to `out`."""
    print(json.dumps(row), file=sys.stderr, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> None:
    import os

    from sparsesearch.spava.group import check_backend, init_group

    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_args(a, world)
        if a.save:
            return save_stack(a.shape, a.tokenizer, a.save, max(tokens_list(a.tokens)))
        backend = check_backend(a.backend, world)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    init_group(backend, a.timeout)
    try:
        rows = run(a)
        if rows:
            print(markdown(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    """One line per (shape, tokens, method): wall, attention per rank, MB per rank, KL, speed-ups."""
    head = ("| shape | tokens | method | GPUs | wall ms (median) | attention ms / rank | MB sent / rank | KL vs dense | top-1 vs dense | speed-ups |\n"
            "|---|---:|---|---:|---:|---|---|---:|---:|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['method']} | {r['gpus']} | failed: {r['error']} | | | | | |")
            continue
        att = " / ".join(f"{x:.1f}" for x in r.get("attention_ms_per_rank", [])) or "-"
        mb = " / ".join(f"{b / 1e6:.1f}" for b in r.get("bytes_per_rank", [])) or "-"
        kl = f"{r['kl_vs_dense']:.2e}" if "kl_vs_dense" in r else "(reference)"
        top1 = f"{r['top1_vs_dense']:.3f}" if "top1_vs_dense" in r else "-"
        ups = ", ".join(f"{k.removeprefix('speedup_vs_')} {v:.2f}x" for k, v in r.items() if k.startswith("speedup_vs_")) or "-"
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['method']} | {r['gpus']} | {r['wall_ms']:.1f} | {att} | {mb} | {kl} | {top1} | {ups} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
