"""Decode throughput (P6 §5): offloaded NOSA (runtime/nosa_device.py) vs dense GPU decode of the same synthetic
layer stack, under the same GPU KV-memory budget (paper 004 App. E "equivalent batch" EB: NOSA runs EB
sequences, dense runs EB · M_nosa / M_dense of them, M = GPU KV bytes per sequence).

Each decode step runs the whole stack: RMSNorm, QKV projection, attention, O projection, SwiGLU MLP, final
norm and LM head, with random bf16 weights of the named shape. Dense attention is SDPA over a GPU KV cache
of ``context`` tokens (the new token written into it each step); NOSA attention is SlotDecoder.step: append
to pinned host memory through UVA, selection and slot map, then the Triton slot attention that reads the
missed blocks from pinned memory itself (``--attention sdpa``: UVA gathers, then masked SDPA over the slots;
``--torch-select``: the torch selection path).
Both steps are captured in CUDA graphs (NOSA: one graph for a step inside a block, one for a step that
starts a block), so the times are the GPU's, not Python's; ``--eager`` times the same code uncaptured.

The query stream decides how many query-aware blocks change per step. Random weights make consecutive
queries of a layer independent, the worst case the locality bound allows (k_q new blocks per step); a
trained model's queries are correlated. ``--query-locality rho`` mixes each layer's attention query as
q_t = rho · q_{t-1} + sqrt(1 - rho²) · q_new (rho = 0: independent). Each row reports the measured hit rate.

Host memory: the store of every layer is B × Hkv × (context + steps) × D × 2 × 2 bytes; when 32 layers of
them exceed ``--host-gib``, layers share stores cyclically (the bytes each step moves are unchanged; the row
says how many distinct stores there were).

    PYTHONPATH=. python benchmarks/nosa_decode.py --shape 8b --contexts 16384 32768 --eb 4 8 16 32 64 128

Needs a CUDA GPU. Rows: one JSON line each (--out), a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.rows import emit, write_jsonl
from sparsesearch.nosa.config import make_config
from sparsesearch.kernels._common import group_rows
from sparsesearch.kernels.nosa_attend import default_splits
from sparsesearch.runtime.nosa_device import SlotDecoder


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    dim: int
    mlp: int
    vocab: int
    window: int = 0  # sliding-window layers keep this many tokens (0: every layer is global)
    global_every: int = 1  # layer i is global when (i + 1) % global_every == 0

    def is_global(self, i: int) -> bool:
        return self.window == 0 or (i + 1) % self.global_every == 0


SHAPES = {
    "8b": Shape(32, 4096, 32, 8, 128, 14336, 128256),
    "gemma3-270m": Shape(18, 640, 4, 1, 256, 2048, 262144, window=512, global_every=6),
    "smollm2-135m": Shape(30, 576, 9, 3, 64, 1536, 49152),
}


class Stack:
    """Random bf16 weights of one shape; ``step(x, attend)`` runs one decode token through every layer.
    attend(i, q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D]) -> [B, Hq, D] is the only part that differs."""

    def __init__(self, shape: Shape, device: str, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        s = shape
        qkv = (s.heads + 2 * s.kv_heads) * s.dim

        def w(*size):
            return (torch.randn(*size, generator=g, device=device) / math.sqrt(size[0])).to(torch.bfloat16)

        self.shape = s
        self.layers = [dict(qkv=w(s.hidden, qkv), o=w(s.heads * s.dim, s.hidden), up=w(s.hidden, 2 * s.mlp), down=w(s.mlp, s.hidden))
                       for _ in range(s.layers)]
        self.head = w(s.hidden, s.vocab)

    def step(self, x: torch.Tensor, attend) -> torch.Tensor:
        """x [B, hidden] -> logits [B, vocab]."""
        s = self.shape
        batch = x.shape[0]
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,))
            q, k, v = (h @ w["qkv"]).split([s.heads * s.dim, s.kv_heads * s.dim, s.kv_heads * s.dim], -1)
            a = attend(i, q.view(batch, s.heads, s.dim), k.view(batch, s.kv_heads, s.dim), v.view(batch, s.kv_heads, s.dim))
            x = x + a.reshape(batch, -1) @ w["o"]
            gate, up = (F.rms_norm(x, (s.hidden,)) @ w["up"]).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return F.rms_norm(x, (s.hidden,)) @ self.head


def kv_bytes(shape: Shape, tokens: int) -> int:
    """GPU KV bytes per sequence when global layers hold ``tokens`` and sliding layers their window."""
    per_token = 2 * shape.kv_heads * shape.dim * 2
    return sum(per_token * (tokens if shape.is_global(i) else min(tokens, shape.window)) for i in range(shape.layers))


def nosa_bytes(shape: Shape, cfg, context: int, fused: bool = True, splits: int = 0) -> int:
    """GPU bytes per sequence of the NOSA cache: slots + tail, compressed keys, token scores, key ring and
    agnostic block scores on global layers (as SlotDecoder.memory counts them); sliding layers as dense;
    the fused kernels' scratch (shared by the layers) once, the slot attention's split partials when
    ``splits``."""
    cap = -(-(context + 64) // cfg.block) * cfg.block
    h, d = shape.kv_heads, shape.dim
    per_layer = h * (2 * (cfg.k + 1) * cfg.block * d * 2 + (cap // cfg.stride) * d * 2 + cap * 4 + cfg.kernel * d * 2 + (cap // cfg.block) * 4 + cfg.k * 8)
    sliding = 2 * h * d * 2 * min(context, shape.window)
    partials = h * splits * group_rows(shape.heads // shape.kv_heads) * (d + 2) * 4  # kernels/nosa_attend.py AttendScratch
    return sum(per_layer if shape.is_global(i) else sliding for i in range(shape.layers)) + (select_scratch_bytes(shape, cfg, cap) if fused else 0) + partials


def select_scratch_bytes(shape: Shape, cfg, cap: int) -> int:
    """The fused selection's scratch per sequence (kernels/nosa_select.py SelectScratch), shared by all
    layers: padded-group logits and unit probabilities (float32 per unit), two float32 keys and two int8
    flags per block, free slots, the mask and two fetch lists."""
    units, blocks = cap // cfg.stride, cap // cfg.block
    group_pad = group_rows(shape.heads // shape.kv_heads)
    return shape.kv_heads * ((group_pad + 1) * units * 4 + blocks * 10 + cfg.k * 4 + (cfg.k + 1) * cfg.block * 2 + 2 * 2 * cfg.k * 8)


class Dense:
    """Dense decode: a [B, Hkv, context, D] cache per global layer (window-sized on sliding layers); the new
    token overwrites the cache's last position each step (the context stays fixed over the timed steps)."""

    def __init__(self, shape: Shape, batch: int, context: int, device: str, sliding_only: bool = False):
        self.shape = shape
        self.caches = {}
        for i in range(shape.layers):
            if sliding_only and shape.is_global(i):
                continue
            n = context if shape.is_global(i) else min(context, shape.window)
            self.caches[i] = torch.randn(2, batch, shape.kv_heads, n, shape.dim, device=device, dtype=torch.bfloat16)
        probe = torch.randn(batch, shape.heads, shape.dim, device=device, dtype=torch.bfloat16)
        longest = max(self.caches.values(), key=lambda kv: kv.shape[3])
        self.form = fastest({name: (lambda f=f: f(longest, probe)) for name, f in DENSE_FORMS.items()})

    def attend(self, i, q, k, v):
        kv = self.caches[i]
        kv[0, :, :, -1] = k
        kv[1, :, :, -1] = v
        return DENSE_FORMS[self.form](kv, q)


ALL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _grouped(kv, q, backends=None):
    """The group's query heads as rows of one KV head: q [B, Hq, D] -> [B, Hkv, G, D], no K/V expansion."""
    b, hq, d = q.shape
    h = kv.shape[2]
    with sdpa_kernel(backends or ALL_BACKENDS):
        return F.scaled_dot_product_attention(q.view(b, h, hq // h, d), kv[0], kv[1]).reshape(b, hq, d)


def _gqa(kv, q, backends=None):
    """SDPA's own GQA decode: q [B, Hq, 1, D] with enable_gqa."""
    with sdpa_kernel(backends or ALL_BACKENDS):
        return F.scaled_dot_product_attention(q[:, :, None], kv[0], kv[1], enable_gqa=True)[:, :, 0]


DENSE_FORMS = {
    "grouped-auto": _grouped,
    "grouped-flash": lambda kv, q: _grouped(kv, q, [SDPBackend.FLASH_ATTENTION]),
    "gqa-auto": _gqa,
    "gqa-flash": lambda kv, q: _gqa(kv, q, [SDPBackend.FLASH_ATTENTION]),
    "gqa-efficient": lambda kv, q: _gqa(kv, q, [SDPBackend.EFFICIENT_ATTENTION]),
    "gqa-cudnn": lambda kv, q: _gqa(kv, q, [SDPBackend.CUDNN_ATTENTION]),
}


def fastest(fns: dict, reps: int = 5) -> str:
    """The name of the fastest callable (median of reps after a warm-up); ones that raise are skipped. The
    dense baseline takes its best SDPA form per shape so that NOSA is not compared with a slow backend
    (at batch 2 and 32K the default form ran 4x slower than SDPA's flash decode)."""
    best, name = float("inf"), None
    for key, fn in fns.items():
        try:
            fn()
        except RuntimeError:
            continue
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        t = sorted(times)[reps // 2]
        if t < best:
            best, name = t, key
    return name


class Nosa:
    """NOSA decode: a SlotDecoder per global layer over random prompts of ``context`` tokens; sliding layers
    as Dense (their window stays on the GPU in both systems)."""

    def __init__(self, shape: Shape, cfg, batch: int, context: int, steps: int, device: str, host_gib: float, rho: float, seed: int = 0,
                 fused: bool = True, attention: str = "triton"):
        self.shape, self.rho = shape, rho
        g = torch.Generator(device=device).manual_seed(seed)
        capacity = context + steps + cfg.block
        globals_ = [i for i in range(shape.layers) if shape.is_global(i)]
        store = batch * shape.kv_heads * (-(-capacity // cfg.block) * cfg.block) * shape.dim * 2 * 2
        self.stores = max(1, min(len(globals_), int(host_gib * 2**30 // store)))
        stores = []
        self.decoders, self.window = {}, Dense(shape, batch, context, device) if shape.window else None
        lengths = torch.full((batch,), context, dtype=torch.long, device=device)
        attention = attention if fused else "sdpa"
        for n, i in enumerate(globals_):
            evict = (torch.randn(shape.kv_heads, shape.dim, generator=g, device=device) / math.sqrt(shape.dim), torch.rand(shape.kv_heads, generator=g, device=device))
            host = stores[n % self.stores] if n >= self.stores else None
            first = next(iter(self.decoders.values()), None)  # layers share the fused kernels' scratch
            dec = SlotDecoder(cfg, batch=batch, kv_heads=shape.kv_heads, group=shape.heads // shape.kv_heads, dim=shape.dim, capacity=capacity,
                              dtype=torch.bfloat16, device=device, eviction=evict, seed=seed, host=host, fused=fused, attention=attention,
                              scratch=first.scratch if fused and first else None,
                              attend_scratch=first.attend_scratch if attention == "triton" and first else None)
            if host is None:
                stores.append((dec.keys_host, dec.values_host))
            keys = torch.randn(batch, shape.kv_heads, context, shape.dim, generator=g, device=device, dtype=torch.bfloat16)
            values = torch.randn(batch, shape.kv_heads, context, shape.dim, generator=g, device=device, dtype=torch.bfloat16)
            dec.prefill(keys, values, lengths)
            del keys, values
            self.decoders[i] = dec
        first = next(iter(self.decoders.values()))
        if attention == "triton":  # kernels/nosa_attend.py, the missed blocks fetched inside it
            self.form = f"triton-split{first.attend_scratch.splits}"
        else:
            self.form = self._fastest_sdpa(first, batch, shape, device)
            for dec in self.decoders.values():
                dec.backends = [getattr(SDPBackend, self.form)]
        self.q_state = {i: torch.zeros(batch, shape.heads, shape.dim, device=device, dtype=torch.bfloat16) for i in globals_}

    @staticmethod
    def _fastest_sdpa(first: SlotDecoder, batch: int, shape: Shape, device: str) -> str:
        """The faster masked SDPA backend for the slot attention at this shape."""
        probe = torch.randn(batch, shape.heads, shape.dim, device=device, dtype=torch.bfloat16)
        forms = {b.name: [b] for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)}

        def slot_attention(backends):
            first.backends = backends
            return first.attend(probe)

        return fastest({name: (lambda b=b: slot_attention(b)) for name, b in forms.items()})

    def attend(self, i, q, k, v):
        if i not in self.decoders:
            return self.window.attend(i, q, k, v)
        if self.rho:
            state = self.q_state[i]
            state.mul_(self.rho).add_(q, alpha=math.sqrt(1 - self.rho**2))
            q = state
        return self.decoders[i].step(q, k, v)

    def boundary_next(self) -> bool:
        return next(iter(self.decoders.values())).boundary_next()

    def counters(self) -> tuple[int, int]:
        return sum(int(d.fetched) for d in self.decoders.values()), sum(int(d.dropped) for d in self.decoders.values())

    def host_state(self):
        return [(list(d.host_lengths), d.cold) for d in self.decoders.values()]

    def restore(self, state) -> None:
        for d, (lengths, cold) in zip(self.decoders.values(), state):
            d.host_lengths, d.cold = list(lengths), cold


def run_steps(stack: Stack, system, x: torch.Tensor, steps: int, eager: bool, on_step=None) -> list[float]:
    """Decode ``steps`` tokens; returns per-step ms (CUDA events; each step synchronised, so on_step(i) may
    read counters). Graph mode captures one graph per kind of step (NOSA: inside a block / starting a
    block; dense: one) after an eager warm-up step."""
    kinds = {}
    boundary = getattr(system, "boundary_next", lambda: False)

    def body():
        return stack.step(x, system.attend)

    if not eager:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for kind in (False, True) if hasattr(system, "decoders") else (False,):
            saved = system.host_state() if hasattr(system, "decoders") else None
            if saved is not None:  # make the capture see the kind of step it records
                for d in system.decoders.values():
                    d.host_lengths = [d.cfg.block * 4 if kind else d.cfg.block * 4 + 1] * len(d.host_lengths)
                    d.cold = False
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                body()
            if saved is not None:
                system.restore(saved)
            kinds[kind] = graph
        torch.cuda.synchronize()
    times = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        kind = boundary()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if eager or (hasattr(system, "decoders") and any(d.cold for d in system.decoders.values())):
            body()
        else:
            kinds[kind].replay()
            if hasattr(system, "decoders"):
                for d in system.decoders.values():  # the replay advanced the GPU's lengths by one
                    d.host_lengths = [n + 1 for n in d.host_lengths]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def profile(stack: Stack, system, x: torch.Tensor, steps: int = 3) -> None:
    """GPU time per kernel over a few eager steps, largest first (stderr)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            stack.step(x, system.attend)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70), file=sys.stderr)


def measure(args, shape_name: str, context: int, eb: int, cfg) -> list[dict]:
    shape = SHAPES[shape_name]
    device = "cuda"
    fused = not args.torch_select
    attention = args.attention if fused else "sdpa"
    splits = default_splits(eb * shape.kv_heads, cfg.k + 1, torch.device(device)) if attention == "triton" else 0
    nosa_per_seq = nosa_bytes(shape, cfg, context, fused, splits)
    dense_batch = int(eb * nosa_per_seq / kv_bytes(shape, context))
    rows = []
    stack = Stack(shape, device)
    common = dict(device=torch.cuda.get_device_name(), shape=shape_name, context=context, eb=eb, block=cfg.block, k=cfg.k, k_q=cfg.k_q,
                  proxy=cfg.proxy, rho=args.query_locality, graph=not args.eager, gpu_kv_bytes_per_seq_dense=kv_bytes(shape, context),
                  gpu_kv_bytes_per_seq_nosa=nosa_per_seq, selection="fused" if fused else "torch", slot_attention=attention)
    for method, batch in (("dense", dense_batch), ("nosa", eb)):
        if batch < 1:
            rows.append(common | dict(method=method, batch=0, note="no feasible batch under this KV budget"))
            continue
        torch.cuda.empty_cache()
        x = torch.randn(batch, shape.hidden, device=device, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        system = Dense(shape, batch, context, device) if method == "dense" else Nosa(shape, cfg, batch, context, args.warmup + args.steps + 2, device, args.host_gib, args.query_locality,
                                                                               fused=fused, attention=attention)
        setup = time.perf_counter() - t0
        before = [(0, 0)]

        def snapshot(i, system=system, method=method):
            if i == args.warmup and method == "nosa":
                before[0] = system.counters()

        times = run_steps(stack, system, x, args.warmup + args.steps, args.eager, snapshot)[args.warmup:]
        before = before[0]
        if args.profile and method == "nosa":
            profile(stack, system, x)
        ms = sorted(times)[len(times) // 2]
        mean = sum(times) / len(times)
        row = common | dict(method=method, batch=batch, attention_form=system.form, step_ms_median=round(ms, 3), step_ms_mean=round(mean, 3), tokens_per_s=round(batch * 1000 / mean, 1), setup_s=round(setup, 1))
        if method == "nosa":
            fetched, dropped = system.counters()
            fetched -= before[0]
            pairs = batch * shape.kv_heads * len(system.decoders)
            block_bytes = cfg.block * shape.dim * 2 * 2
            row |= dict(hit_rate=round(1 - fetched / (pairs * cfg.k * args.steps), 5), h2d_mb_per_step=round(fetched * block_bytes / args.steps / 2**20, 2),
                        dropped=dropped, distinct_host_stores=system.stores, gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
        rows.append(row)
        del system
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if all(r.get("tokens_per_s") for r in rows):
        rows[1]["speedup_vs_dense"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--eb", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128], help="equivalent batch sizes (NOSA's batch)")
    ap.add_argument("--budget", type=int, default=4096, help="NOSA budget in tokens (k = budget / block)")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--kq-ratio", type=float, nargs="+", default=[0.25])
    ap.add_argument("--proxy", default="trained", choices=["trained", "vnorm", "random"])
    ap.add_argument("--query-locality", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--host-gib", type=float, default=40.0, help="pinned host memory for distinct layer stores")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count (profiling)")
    ap.add_argument("--torch-select", action="store_true", help="the torch selection path instead of the fused kernel (the before row)")
    ap.add_argument("--attention", default="triton", choices=["triton", "sdpa"],
                    help="slot attention with the fused step: the Triton kernel that fetches missed blocks itself, or UVA gathers + masked SDPA")
    ap.add_argument("--profile", action="store_true", help="print the GPU kernels of a few eager NOSA steps (torch.profiler)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.layers:
        SHAPES[args.shape] = replace(SHAPES[args.shape], layers=args.layers)
    if not torch.cuda.is_available():
        print("nosa_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    command = "PYTHONPATH=. python benchmarks/nosa_decode.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = []
    for ratio in args.kq_ratio:
        cfg = make_config(args.budget, ratio, args.block, args.proxy)
        for context in args.contexts:
            for eb in args.eb:
                try:
                    got = measure(args, args.shape, context, eb, cfg)
                except torch.OutOfMemoryError as err:
                    got = [dict(shape=args.shape, context=context, eb=eb, k_q=cfg.k_q, note=f"OOM: {str(err).splitlines()[0][:120]}")]
                    torch.cuda.empty_cache()
                rows += emit(got, command)
    write_jsonl(args.out, rows)
    print("\n| shape | context | EB | k_q/k | method | batch | step ms | tok/s | × dense | hit rate | H2D MB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "method" in r:
            print(f"| {r['shape']} | {r['context']} | {r['eb']} | {r['k_q']}/{r['k']} | {r['method']} | {r['batch']} | {r.get('step_ms_mean', '-')} | "
                  f"{r.get('tokens_per_s', '-')} | {r.get('speedup_vs_dense', '')} | {r.get('hit_rate', '')} | {r.get('h2d_mb_per_step', '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
