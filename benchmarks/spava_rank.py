"""SPAVA per-rank attention benchmark (P7 §6): one layer of 8B-shaped attention (32 query / 8 KV heads,
head_dim 128, bf16 on GPUs), SPAVA (sparsesearch/spava/attention.py) against the exact zigzag ring
(exact.py). Two modes:

1. ``--simulate-world 2,4,8`` (no torchrun, one GPU): for each W and each rank r, the inputs r would hold
   and receive (sparsesearch/spava/simulate.py) and r's compute alone, timed with CUDA events, median of
   --reps, interleaved in one loop with causal SDPA over the whole sequence. Rows (JSON lines) per
   (tokens, W, rank, method, l_a, l_p): ms, bytes_sent (passing + query partials for SPAVA, K/V blocks for
   the ring), overlap_ms (SPAVA: the compute that hides the passing all-gather), sdpa_ms, command; and a
   markdown table (slowest rank per configuration) beside them. `sparsesearch sweep-spava --rank-times
   FILE` turns the rows into the W = 2/4/8 latency model.

       PYTHONPATH=. python benchmarks/spava_rank.py --simulate-world 2,4,8 --tokens 32768,131072
       PYTHONPATH=. python benchmarks/spava_rank.py --simulate-world 2,4 --quick     # small shapes (CPU too)

2. under torchrun: the same attention over a real process group, both methods alternating, the slowest
   rank's median wall time per configuration from rank 0.

       torchrun --nproc_per_node 8 benchmarks/spava_rank.py --tokens 32768,131072 --out benchmarks/results/spava_rank.jsonl
       torchrun --nproc_per_node 2 benchmarks/spava_rank.py --tokens 2048 --heads 4 --kv-heads 2 --dim 64   # CPU smoke run (gloo)

The pieces run through sparsesearch.spava.fused.Engine("auto"): the block-sparse Triton kernel (and SDPA
for the anchor rows) on CUDA, the plain-torch path (chunked rows, fp32 softmax) on CPU — CPU times say
nothing about a GPU kernel's speed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch
import torch.distributed as dist

from sparsesearch.spava.attention import query_partial, select_passing, spava_attention
from sparsesearch.spava.exact import ring_attention, zigzag_positions
from sparsesearch.spava.fused import Engine
from sparsesearch.spava.group import check_backend, init_group
from sparsesearch.spava.layout import Layout, check_lengths, default_lengths
from sparsesearch.spava.simulate import ring_world, spava_world

QUICK = {"tokens": "4096", "heads": 8, "kv_heads": 2, "dim": 64, "reps": 3}  # --quick: small shapes, CPU-sized


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, reps: int, device: torch.device) -> float:
    """The slowest rank's median wall time of fn (ms), barriers around every call."""
    times = []
    for _ in range(reps + 1):  # the first call warms up
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([sorted(times[1:])[len(times[1:]) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def lengths_grid(text: str, default: int) -> list[int]:
    """'default,2x,1024' -> [default, 2*default, 1024] (the paper default, multiples of it, or tokens)."""
    out = []
    for t in text.split(","):
        t = t.strip()
        out.append(default if t == "default" else default * int(t[:-1]) if t.endswith("x") else int(t))
    return list(dict.fromkeys(out))


def _sync_all(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Medians of named calls, each call timed alone: CUDA events on a GPU (read after each rep's
    synchronize, so the loop never waits per call), perf_counter with a sync elsewhere."""

    def __init__(self, device: torch.device):
        self.device, self.times, self._pending = device, {}, []

    def __call__(self, key, fn) -> None:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._pending.append((key, start, end))
            return
        t0 = time.perf_counter()
        fn()
        self.times.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)

    def flush(self, keep: bool) -> None:
        """End of a rep: read the events (kept unless it was the warm-up rep)."""
        _sync_all(self.device)
        for key, start, end in self._pending:
            if keep:
                self.times.setdefault(key, []).append(start.elapsed_time(end))
        self._pending = []
        if not keep:
            self.times = {}

    def median(self, key) -> float:
        ts = sorted(self.times[key])
        return ts[len(ts) // 2]


def _before_passing_needed(x, lay: Layout, scale: float, engine: Engine) -> None:
    """The compute a rank does between sending its selections and needing its peers' (steps 1, 3 and the
    anchor rows): what hides the passing all-gather in the latency model."""
    la = lay.l_a
    select_passing(x.q, x.k, x.v, lay, x.rank)
    query_partial(x.q, x.k, x.v, lay, x.rank, scale, engine)
    engine.attend(x.q[:, :, :la], x.k[:, :, :la], x.v[:, :, :la], scale, causal=True, need_lse=False)


def simulate(a, worlds: list[int]) -> list[dict]:
    """--simulate-world: rows per (tokens, W, rank, method, l_a, l_p) on this one device."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    engine, scale = Engine("auto"), a.dim**-0.5
    command = "PYTHONPATH=. python " + shlex.join(sys.argv)
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        la0, lp0 = default_lengths(n)
        grid = [(la, lp) for la in lengths_grid(a.anchor, la0) for lp in lengths_grid(a.passing, lp0)]
        g = torch.Generator(device=device).manual_seed(0)
        make = lambda h: torch.randn(1, h, n, a.dim, generator=g, device=device, dtype=dtype)
        q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
        group = a.heads // a.kv_heads
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # SDPA on expanded K/V, not timed
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=scale)
        for world in worlds:
            layouts = []
            for la, lp in grid:
                lay = Layout(n - a.query, a.query, world, la, lp)
                try:
                    check_lengths(lay)
                except ValueError as exc:
                    print(f"skip {n} tokens W={world} l_a={la} l_p={lp}: {exc}", file=sys.stderr)
                    continue
                layouts.append((lay, spava_world(q, k, v, lay, scale, engine)))
            ring = ring_world(q, k, v, world)
            timer = Timer(device)
            bytes_sent: dict = {}
            for rep in range(a.reps + 1):  # rep 0 warms up (kernel compiles, allocator)
                timer("sdpa", sdpa)
                for x in ring:
                    stats: dict = {}
                    timer(("ring", x.rank), lambda: ring_attention(x.q, x.k, x.v, x.pos, n, scale, engine=engine, exchange=x.replay, stats=stats))
                    bytes_sent[("ring", x.rank)] = (stats["bytes_sent"] if world > 1 else 0, 0)
                for lay, xs in layouts:
                    for x in xs:
                        before = dict(x.replay.sent_by)
                        timer(("spava", lay, x.rank), lambda: spava_attention(x.q, x.k, x.v, lay, x.rank, scale, engine=engine, exchange=x.replay))
                        timer(("overlap", lay, x.rank), lambda: _before_passing_needed(x, lay, scale, engine))
                        sent = {kk: x.replay.sent_by[kk] - before.get(kk, 0) for kk in x.replay.sent_by}
                        passing = sent.get("passing_a", 0) + sent.get("passing_b", 0)
                        bytes_sent[("spava", lay, x.rank)] = (sum(sent.values()), passing)
                timer.flush(keep=rep > 0)
            sdpa_ms = timer.median("sdpa")
            base = {"device": name, "dtype": str(dtype).removeprefix("torch."), "engine": engine.resolve(device), "tokens": n,
                    "query": a.query, "heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim, "W": world, "reps": a.reps,
                    "sdpa_ms": round(sdpa_ms, 4), "command": command}
            for x in ring:
                sent, _ = bytes_sent[("ring", x.rank)]
                rows.append({**base, "rank": x.rank, "method": "zigzag-ring", "l_a": None, "l_p": None,
                             "ms": round(timer.median(("ring", x.rank)), 4), "bytes_sent": sent, "bytes_passing": 0, "overlap_ms": None})
            for lay, xs in layouts:
                for x in xs:
                    sent, passing = bytes_sent[("spava", lay, x.rank)]
                    rows.append({**base, "rank": x.rank, "method": "spava", "l_a": lay.l_a, "l_p": lay.l_p, "passing_used": lay.passing,
                                 "ms": round(timer.median(("spava", lay, x.rank)), 4), "bytes_sent": sent, "bytes_passing": passing,
                                 "overlap_ms": round(timer.median(("overlap", lay, x.rank)), 4)})
            print(f"{n} tokens, W={world}: SDPA {sdpa_ms:.2f} ms; slowest rank ring "
                  f"{max(r['ms'] for r in rows if r['W'] == world and r['tokens'] == n and r['method'] == 'zigzag-ring'):.2f} ms", file=sys.stderr, flush=True)
            del layouts, ring
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per (tokens, W, method, l_a, l_p): slowest and fastest rank, bytes, SDPA, speed-ups."""
    head = ("| tokens | W | method | l_a | l_p | slowest rank ms | fastest rank ms | MB sent / rank (max) | SDPA ms (whole seq.) "
            "| SDPA / slowest | ring / slowest |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = list(dict.fromkeys((r["tokens"], r["W"], r["method"], r["l_a"], r["l_p"]) for r in rows))
    lines = [head]
    for key in keys:
        at = [r for r in rows if (r["tokens"], r["W"], r["method"], r["l_a"], r["l_p"]) == key]
        ring = max(r["ms"] for r in rows if (r["tokens"], r["W"], r["method"]) == (key[0], key[1], "zigzag-ring"))
        slow, fast = max(r["ms"] for r in at), min(r["ms"] for r in at)
        mb = max(r["bytes_sent"] for r in at) / 1e6
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3] or '-'} | {key[4] or '-'} | {slow:.3f} | {fast:.3f} | {mb:.1f} "
                     f"| {at[0]['sdpa_ms']:.3f} | {at[0]['sdpa_ms'] / slow:.2f}x | {ring / slow:.2f}x |")
    r0 = rows[0]
    return (f"Device: {r0['device']} · {r0['dtype']} · engine {r0['engine']} · B=1 · {r0['heads']} query heads · {r0['kv_heads']} KV heads "
            f"· head_dim {r0['dim']} · query {r0['query']} · median of {r0['reps']} reps\n\nCommand: `{r0['command']}`\n\n" + "\n".join(lines) + "\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=None, help="Comma-separated prompt lengths (default 32768; --quick: 4096).")
    ap.add_argument("--query", type=int, default=128)
    ap.add_argument("--anchor", default=None, help="l_a values: 'default' (n/64), '2x' (twice it) or tokens.")
    ap.add_argument("--passing", default=None, help="l_p values: 'default' (n/128), '4x' or tokens.")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="Timed repetitions after one warm-up (default 5).")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--simulate-world", default=None, help="Comma-separated W: simulate each rank of a W-rank run on this one device.")
    ap.add_argument("--quick", action="store_true", help=f"Small shapes: {QUICK} unless given.")
    ap.add_argument("--out", default=None, help="JSON lines appended here (simulate default: benchmarks/results/spava_rank_sim.jsonl; .md beside).")
    a = ap.parse_args(argv)
    full = {"tokens": "32768", "heads": 32, "kv_heads": 8, "dim": 128, "reps": 5}
    for key, value in (QUICK if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    sim = a.simulate_world is not None
    a.anchor = a.anchor or ("default,2x" if sim else "default")
    a.passing = a.passing or ("default,4x" if sim else "default")
    return a


def main() -> None:
    a = parse_args()
    if a.simulate_world is not None:
        from pathlib import Path

        rows = simulate(a, [int(w) for w in a.simulate_world.split(",")])
        out = Path(a.out or "benchmarks/results/spava_rank_sim.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        table = markdown(rows)
        out.with_suffix(".md").write_text(table)
        print(table)
        print(f"rows: {out} · table: {out.with_suffix('.md')}", file=sys.stderr)
        return
    import os

    backend = check_backend(a.backend, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world, device = init_group(backend, 600)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        la0, lp0 = default_lengths(n)
        anchors = [la0 if t == "default" else int(t) for t in a.anchor.split(",")]
        passings = [lp0 if t == "default" else int(t) for t in a.passing.split(",")]
        g = torch.Generator(device="cpu").manual_seed(0)
        make = lambda h: torch.randn(1, h, n, a.dim, generator=g).to(device, dtype)
        q, k, v = make(a.heads), make(a.kv_heads), make(a.kv_heads)
        zz = torch.tensor(zigzag_positions(n, world, rank), device=device)
        ring_stats: dict = {}
        ring_ms = median_ms(lambda: ring_attention(q[:, :, zz], k[:, :, zz], v[:, :, zz], zz, n, a.dim**-0.5, stats=ring_stats), a.reps, device)
        base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": world, "backend": backend,
                "tokens": n, "query": a.query, "heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim, "dtype": str(dtype).removeprefix("torch."),
                "command": "torchrun --nproc_per_node {} {}".format(world, shlex.join(sys.argv))}
        rows.append({**base, "method": "zigzag-ring", "ms": ring_ms, "bytes_sent": ring_stats.get("bytes_sent", 0) // (a.reps + 1)})
        for la in anchors:
            for lp in passings:
                lay = Layout(n - a.query, a.query, world, la, lp)
                pos = torch.tensor(lay.local_positions(rank), device=device)
                stats: dict = {}
                ms = median_ms(lambda: spava_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], lay, rank, a.dim**-0.5, stats=stats), a.reps, device)
                rows.append({**base, "method": "spava", "anchor": la, "passing": lp, "ms": ms,
                             "bytes_sent": stats.get("bytes_sent", 0) // (a.reps + 1), "speedup_vs_ring": ring_ms / ms})
    if rank == 0:
        for row in rows:
            print(json.dumps(row))
        if a.out:
            with open(a.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
