"""The per-rank program of `sparsesearch spava run` / `sweep-spava` (started by torchrun, launch.py).

One launch: every rank loads the model, builds the same prompts, runs the exact baseline once per prompt
and SPAVA once per (l_a, l_p) of the grid, all on the same process group. Rank 0 writes the rows (JSON)
that the launcher turns into a table, Parquet, an artifact section and a plot.

Prompt = [context ; query]; the query block is the last `query` tokens. Quality is measured on the query
tokens — the ones whose outputs SPAVA's prefill produces for decoding: logits relative error and
next-token KL vs exact, perplexity of the prompt's own next tokens there (natural text), and, on
retrieval prompts, whether the answer comes out (teacher-forced: the answer's tokens are appended to the
query and each must be the argmax at the position before it).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..files import write_json_atomic
from ..workdir import WorkDir
from .layout import Layout, check_lengths
from .model import RankContext, attention_seconds, tail_logits


PROGRESS = "spava-progress"  # rank 0's stdout marker: "spava-progress <done> <total>"


@dataclass
class SpavaConfig:
    """One launch. anchors/passings: the grid (None entries: the paper defaults for the prompt length)."""

    model: str = "smollm2-135m"
    nproc: int = 2
    tokens: list[int] = field(default_factory=lambda: [2048])
    anchors: list[int | None] = field(default_factory=lambda: [None])
    passings: list[int | None] = field(default_factory=lambda: [None])
    query: int = 64
    data: str = "text"
    backend: str = "auto"
    dtype: str = "auto"
    timeout_s: float = 300.0
    seed: int = 0
    samples: int = 1  # prompts per length (seeds seed, seed + 1, ...): retrieval is a count, not one prompt
    bandwidth_gbs: float = 100.0  # link bandwidth for the modelled latency (GB/s; NVLink-class default)
    generate: int = 0  # greedy tokens decoded after each SPAVA prefill (decode.py), compared with dense generation
    decode: str = "distributed"  # how: "distributed" (the paper's, each rank attends its own K/V) or "gather" (decode.py)
    workdir: str | None = None  # sweep-spava's work directory (rank_main, sweep.py); None: nothing saved per configuration


def layouts(cfg: SpavaConfig, n: int) -> list[Layout]:
    """The grid at prompt length n, checked (bad input raises ValueError before anything runs)."""
    from .layout import default_lengths

    la0, lp0 = default_lengths(n)
    out = []
    for la in cfg.anchors:
        for lp in cfg.passings:
            lay = Layout(n - cfg.query, cfg.query, cfg.nproc, la0 if la is None else la, lp0 if lp is None else lp)
            check_lengths(lay)
            out.append(lay)
    return list(dict.fromkeys(out))


def natural_text_ids(tokenizer, n: int, seed: int) -> torch.Tensor:
    """n tokens of natural English prose: the standard library's pydoc topics, from a seeded offset."""
    import random

    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"natural text has {len(ids)} tokens, fewer than {n}")
    start = random.Random(seed).randrange(0, len(ids) - n + 1)
    return torch.tensor(ids[start : start + n])


def build_prompt(cfg: SpavaConfig, tokenizer, n: int, seed: int | None = None) -> tuple[torch.Tensor, int]:
    """-> (ids long [1, n'], answer tokens at the end of ids, 0 for natural text). seed: the prompt's (default
    cfg.seed); the sweep's samples are seeds cfg.seed, cfg.seed + 1, ... (another text offset, another key
    and depth)."""
    seed = cfg.seed if seed is None else seed
    if cfg.data == "text":
        return natural_text_ids(tokenizer, n, seed)[None], 0
    from ..data import held_out

    sample = held_out(cfg.data, tokenizer, max_tokens=n - 8, seed=seed)
    if sample.answer_ids is None:
        return sample.input_ids[None], 0
    answer = sample.answer_ids
    return torch.cat([sample.input_ids, answer])[None], int(answer.numel())


def quality(logits: torch.Tensor, exact: torch.Tensor, ids: torch.Tensor, answer: int) -> dict:
    """logits, exact fp32 [B, q, V] over the query positions; ids long [B, n]."""
    q = logits.shape[1]
    from ..quality import log_probs, token_kl, token_nll

    lp, le = log_probs(logits), log_probs(exact)
    targets = ids[:, -q + 1 :]  # the next token of each query position but the last
    nll = lambda l: float(token_nll(l[:, :-1], targets).mean())
    row = {
        "logit_rel_error": float((logits - exact).norm() / exact.norm()),
        "kl": float(token_kl(le, lp).mean()),
        "ppl": math.exp(nll(lp)), "ppl_exact": math.exp(nll(le)),
        "top1_agreement": float((logits.argmax(-1) == exact.argmax(-1)).float().mean()),
    }
    if answer:
        want = ids[:, -answer:]
        got = lambda l: bool((l[:, -answer - 1 : -1].argmax(-1) == want).all())
        row.update(retrieved=got(logits), retrieved_exact=got(exact))
    return row


def generation(tokens: torch.Tensor, dense: torch.Tensor, tokenizer) -> dict:
    """Row fields comparing SPAVA-prefill generation with dense generation: tokens, dense long [B, N] (row 0 shown)."""
    same = (tokens == dense)[0]
    prefix = int(same.long().cumprod(0).sum())
    return {"generated": tokens[0].tolist(), "generated_dense": dense[0].tolist(),
            "generated_text": tokenizer.decode(tokens[0]), "generated_text_dense": tokenizer.decode(dense[0]),
            "first_token_agreement": bool(same[0]), "generated_agreement": float(same.float().mean()), "generated_prefix": prefix}


def _dense_tokens(model, ids: torch.Tensor, steps: int, rank: int) -> tuple[torch.Tensor, float | None]:
    """Dense greedy generation on rank 0 alone, the one-GPU reference the distributed decode is timed against
    (the others wait at the broadcast) -> (long [B, steps] on every rank, rank 0's seconds per decode step after
    the prefill's token, None when steps = 1)."""
    from .decode import dense_prefill, greedy

    per = None
    if rank == 0:
        cache, logits = dense_prefill(model, ids)
        _sync()
        start = time.perf_counter()
        tokens = greedy(model, cache, logits[:, -1].argmax(-1), ids.shape[1], steps)[0]
        _sync()
        per = (time.perf_counter() - start) / (steps - 1) if steps > 1 else None
    else:
        tokens = ids.new_empty((ids.shape[0], steps))
    dist.broadcast(tokens, src=0)
    return tokens, per


def decode_fields(stats: dict, how: str, steps: int, seconds: float) -> dict:
    """Row fields of one decode from every rank's ctx.stats (decode.py): times of the slowest rank, bytes of the
    rank that sent most. Setup = before the first step (gather: the cache transfer); per token = the steps - 1
    decode steps after the prefill's token, averaged (None when steps = 1)."""
    per = steps - 1
    step_s = _max_over_ranks(stats["decode_steps_s"], None)
    step_bytes = _max_over_ranks(stats["decode_bytes_sent"], None)
    return {"decode": how, "decode_seconds": seconds, "decode_setup_seconds": _max_over_ranks(stats["decode_setup_s"], None),
            "decode_setup_bytes": int(_max_over_ranks(stats["decode_setup_bytes"], None)),
            "decode_s_per_token": step_s / per if per else None, "decode_bytes_per_token": int(step_bytes / per) if per else None,
            # distributed only: the part of a step spent in attention (local partial, all-gather, merge)
            "decode_attention_s_per_token": _max_over_ranks(stats.get("decode_attention_s", 0.0), None) / per if per else None}


def _sync() -> None:
    """Wait for this process's GPU work (nothing on CPU): host clocks around a GPU prefill see only launches."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def warm_on_gpu(fn, device: torch.device) -> None:
    """Call fn once, untimed, on a GPU: a method's first prefill there compiles its Triton kernels and builds its
    block indices (the first 2-GPU `spava run`, 8K tokens, timed SPAVA at 1.24 s against 0.14 s for the ring,
    the compile included). On CPU nothing compiles, and a run stays one prefill per method."""
    if device.type == "cuda":
        fn()


def _timed(fn, group):
    """(result, seconds on this rank, seconds of the slowest rank): the GPU's work finished on both ends."""
    dist.barrier(group)
    _sync()
    start = time.perf_counter()
    res = fn()
    _sync()
    mine = time.perf_counter() - start
    return res, mine, _max_over_ranks(mine, group)


def exact_logits(model, ids: torch.Tensor, engine: str, tail: int, rank: int, world: int, device):
    """The exact baseline's tail logits fp32 [B, tail, V] on every rank -> (logits, its RankContext, seconds of the slowest rank).

    engine ZIGZAG_RING: our ring over the zigzag sharding. TORCH_CP / TORCH_CP_SLIDING_RING: the forward runs
    inside torch's context_parallel on torch's own sharding; global layers are torch's ring, sliding layers (the
    hybrid) ours on the same shards. Timed the same way as SPAVA (barrier, then the slowest rank). The context's
    stats["bytes_sent"]: what this rank sent, torch's part counted from the shapes (cp_bytes_sent).
    """
    from .exact import ZIGZAG_RING, check_zigzag_shard, torch_context_parallel
    from .model import attention_windows

    n = ids.shape[1]
    if engine == ZIGZAG_RING:
        ctx = RankContext.ring(n, rank, world)
        logits, _, t = _timed(lambda: tail_logits(model, ids, ctx, tail, owner=True), None)
        return logits, ctx, t
    windows = attention_windows(model)

    def run():
        with torch_context_parallel(n, device) as pos:
            ctx = RankContext.torch_cp(n, pos)
            if any(w is not None for w in windows):
                check_zigzag_shard(pos, n, world, rank)
            return tail_logits(model, ids, ctx, tail, owner=True), ctx

    (logits, ctx), _, t = _timed(run, None)
    global_layers = sum(w is None for w in windows)
    torch_ring = cp_bytes_sent(model.config, ids.shape[0], len(ctx.pos), world, next(model.parameters()).element_size(), global_layers)
    ctx.stats["bytes_sent"] = ctx.stats.get("bytes_sent", 0) + torch_ring  # the sliding layers' ring counted its own
    return logits, ctx, t


def cp_bytes_sent(config, batch: int, local: int, world: int, elt: int, layers: int | None = None) -> int:
    """Bytes one rank sends over torch CP's causal ring for one prefill, counted from the shapes (torch's ring
    reports none): in each of `layers` layers (default: all; a hybrid's global layers only), this rank's K and V
    shards ([B, Hq, N_r, D], heads repeated for GQA by exact.cp_attention) go to each of the W-1 other ranks,
    whichever rotate method runs."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_layer = 2 * batch * config.num_attention_heads * local * head_dim * elt
    layers = config.num_hidden_layers if layers is None else layers
    return layers * (world - 1) * per_layer


def _max_over_ranks(x: float, group) -> float:
    """The largest x over the group's ranks. On NCCL the scalar travels on this rank's GPU (NCCL has no CPU tensors)."""
    on_gpu = dist.get_backend(group) == dist.Backend.NCCL
    t = torch.tensor([float(x)], dtype=torch.float64, device=torch.cuda.current_device() if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def rank_main(cfg: SpavaConfig, result_path: str | None) -> list[dict]:
    """Run the launch on this rank (the process group is initialised here). Rank 0 writes the rows.

    With ``cfg.workdir`` (sweep-spava's work directory, sweep.py) each configuration's row is a unit: rank 0
    saves it there as soon as it is measured, and units found there are read instead of run; a prompt whose
    configurations are all done skips its exact baseline too."""
    from ..models import load_model
    from .exact import torch_cp_support
    from .model import has_sliding_layers
    from .group import check_backend, init_group

    backend = check_backend(cfg.backend, cfg.nproc)
    rank, world, device = init_group(backend, cfg.timeout_s)
    try:
        work = WorkDir(cfg.workdir) if cfg.workdir else None
        # Read once, before any collective: rank 0 saves a unit only after every rank has passed that unit's
        # collectives, so all ranks read the same set and skip the same units (one rank skipping alone would
        # leave its peers waiting in a collective).
        done = work.names() if work else set()
        model, tok, info = load_model(cfg.model, dtype=cfg.dtype, device=device.type)
        # torch's context_parallel is the exact baseline where it runs (probed once: torch 2.13 has no
        # sharding rule for the CPU SDPA kernels); the zigzag ring on the same group where it does not
        cp_reason = torch_cp_support(device)
        sliding = has_sliding_layers(model)
        total = len(cfg.tokens) * cfg.samples * len(cfg.anchors) * len(cfg.passings)
        rows = []
        for n, sample in itertools.product(cfg.tokens, range(cfg.samples)):
            ids, answer = build_prompt(cfg, tok, n, cfg.seed + sample)
            ids = ids.to(device)
            names = {lay: unit_name(n, sample, lay) for lay in layouts(cfg, ids.shape[1])}
            base = None if set(names.values()) <= done else baseline(cfg, model, ids, cp_reason, sliding, rank, world, device)
            for lay, name in names.items():
                if name in done:
                    row = work.load(name)
                else:
                    row = config_row(cfg, model, tok, info, ids, answer, sample, base, lay, rank, world, backend)
                    if rank == 0 and work is not None:
                        work.save(name, row)
                rows.append(row)
                if rank == 0:  # the launcher reads these lines from the ranks' log for its progress bar
                    print(f"{PROGRESS} {len(rows)} {total}", flush=True)
        if rank == 0 and result_path:
            engines = ",".join(sorted({r["exact_engine"] for r in rows}))
            # whole or not at all: the launcher takes a result file that exists as the ranks' whole result
            write_json_atomic(result_path, {"rows": rows, "exact_engine": engines, "torch_cp": cp_reason or "supported", "model": asdict(info) if hasattr(info, "__dataclass_fields__") else str(info)}, default=str)
        dist.barrier()  # no rank tears the group down while a peer's last exchange is in flight (group._entry)
        return rows
    finally:
        dist.destroy_process_group()


def unit_name(n: int, sample: int, lay: Layout) -> str:
    """The work-directory unit of one configuration: requested length, prompt, l_a, l_p."""
    return f"n{n}-s{sample}-a{lay.l_a}-p{lay.l_p}"


@dataclass
class Baseline:
    """One prompt's exact run, shared by every configuration measured on it."""

    engine: str
    why_not_cp: str | None
    logits: torch.Tensor
    ctx: RankContext
    seconds: float
    dense_tokens: torch.Tensor | None
    dense_s_per_token: float | None = None  # one-GPU dense decode on rank 0, the decode's reference


def baseline(cfg: SpavaConfig, model, ids: torch.Tensor, cp_reason, sliding: bool, rank: int, world: int, device) -> Baseline:
    """Warm up, then the exact baseline (exact_logits) and, with --generate, dense generation on this prompt."""
    from .exact import exact_engine

    warm = ids[:, : min(ids.shape[1], 256)]  # first-call costs (allocator, thread pools) out of the timings
    tail_logits(model, warm, RankContext.ring(warm.shape[1], rank, world), 1, owner=True)
    engine, why_not_cp = exact_engine(cp_reason, ids.shape[1], world, sliding)
    warm_on_gpu(lambda: exact_logits(model, ids, engine, cfg.query, rank, world, device), device)
    exact, ctx, seconds = exact_logits(model, ids, engine, cfg.query, rank, world, device)
    dense, dense_step = _dense_tokens(model, ids, cfg.generate, rank) if cfg.generate else (None, None)
    return Baseline(engine, why_not_cp, exact, ctx, seconds, dense, dense_step)


def config_row(cfg: SpavaConfig, model, tok, info, ids: torch.Tensor, answer: int, sample: int, base: Baseline, lay: Layout,
               rank: int, world: int, backend: str) -> dict:
    """One configuration on prompt ``sample``, every rank taking part: SPAVA's prefill timed, its quality against the
    baseline, the modelled latency at W = 2/4/8 and, with --generate, the decode after it."""
    device = ids.device
    warm_on_gpu(lambda: tail_logits(model, ids, RankContext.spava(lay, rank), cfg.query, owner=rank == 0), device)
    ctx = RankContext.spava(lay, rank)
    ctx.kept = {} if cfg.generate else None  # the local KV the decode after this prefill needs
    logits, _, t = _timed(lambda: tail_logits(model, ids, ctx, cfg.query, owner=rank == 0), None)
    row = {"tokens": ids.shape[1], "sample": sample, "seed": cfg.seed + sample, "nproc": world, "anchor": lay.l_a, "passing": lay.l_p, "passing_used": lay.passing,
           "query": cfg.query, "data": cfg.data, "seconds": t, "seconds_exact": base.seconds,
           "attention_seconds": _max_over_ranks(attention_seconds(ctx.stats), None),
           "bytes_sent": int(_max_over_ranks(ctx.stats.get("bytes_sent", 0), None)),
           "bytes_passing": int(_max_over_ranks(ctx.stats.get("bytes_passing", 0), None)),
           "bytes_sent_exact": int(_max_over_ranks(base.ctx.stats.get("bytes_sent", 0), None)),
           "exact_engine": base.engine, "exact_engine_note": base.why_not_cp, "backend": backend, **quality(logits, base.logits, ids, answer)}
    row.update(modelled_latency(row, info, cfg.bandwidth_gbs))
    if cfg.generate:
        from .decode import decode

        (tokens, _, _), _, t_dec = _timed(lambda: decode(model, ctx, logits[:, -1], cfg.generate, cfg.decode), None)
        row.update(generation(tokens, base.dense_tokens, tok), **decode_fields(ctx.stats, cfg.decode, cfg.generate, t_dec),
                   decode_s_per_token_dense=base.dense_s_per_token)
    return row


def attention_flops(n_ctx: int, q: int, world: int, l_a: int, l_p: int, d: int, heads: int) -> float:
    """Per-rank attention FLOPs of one layer (paper 001 Eq. 7, plus the query partial over 1/W of the context)."""
    lb = max(1, (n_ctx - l_a) // (2 * world))
    ctx = 2 * l_a**2 * d + 4 * lb**2 * d + 4 * (2 * world - 1) * min(l_p, lb) * lb * d
    return heads * (ctx + 4 * q * (n_ctx / world + q) * d)


def modelled_latency(row: dict, info, bandwidth_gbs: float) -> dict:
    """Latency at W = 2/4/8 from this run's per-rank compute: attention time scaled by Eq. 7 FLOPs, the rest
    (projections, MLP) by local tokens; communication (per-rank bytes at W over the link, bf16 as on a GPU,
    batch 1) overlaps the attention, so a layer costs max(attention, communication). Every layer is counted
    as a SPAVA layer (a hybrid model's sliding layers send a halo instead). A W whose 2W virtual hosts do
    not fit the context gets None. -> {"modelled_s_w2": s | None, ..., "bandwidth_gbs": bandwidth_gbs}."""
    n, q, w, la, lp = row["tokens"], row["query"], row["nproc"], row["anchor"], row["passing"]
    n_ctx, d, hq, hkv = n - q, info.head_dim, info.num_heads, info.num_kv_heads
    local = lambda world: la + 2 * ((n_ctx - la) / (2 * world)) + q
    attn_rate = row["attention_seconds"] / attention_flops(n_ctx, q, w, la, lp, d, hq)
    rest_rate = max(0.0, row["seconds"] - row["attention_seconds"]) / local(w)
    out = {}
    for world in (2, 4, 8):
        if n_ctx - la < 2 * world:
            out[f"modelled_s_w{world}"] = None
            continue
        p = min(lp, (n_ctx - la) // (2 * world))
        sent = info.num_layers * (2 * p * hkv * 2 * d * 2 + q * hq * d * 2 + q * hq * 4) * (world - 1)
        comm = sent / (bandwidth_gbs * 1e9)
        attn = attn_rate * attention_flops(n_ctx, q, world, la, lp, d, hq)
        out[f"modelled_s_w{world}"] = rest_rate * local(world) + max(attn, comm)
    return out | {"bandwidth_gbs": bandwidth_gbs}
