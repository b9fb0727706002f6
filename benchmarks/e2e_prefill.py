"""End-to-end prefill of an 8B-shaped stack with a real calibrate + probe-layers pattern mix vs SDPA (issue 14 §2).

    python -m benchmarks.e2e_prefill --tokens 32768 131072   # as a module: a script run puts benchmarks/
    # first on sys.path, where transformers' optional `import kernels` would find benchmarks/kernels.py

The stack is `benchmarks/ttft.py`'s random-weight Llama-3.1-8B shape (32 layers, hidden 4096, GQA 32/8,
MLP 14336; `--shape 7b`: Qwen2-7B's, 28 layers, hidden 3584, GQA 28/4, MLP 18944), prefilled as generate's
first step does (`logits_to_keep=1`, no KV cache kept), bf16. The pattern mix is an artifact's (default: the
bundled SmolLM2-135M reference, a real `calibrate` + `probe-layers` run at 4K) mapped onto the stack: layer l
takes source layer round(l (L_src - 1) / (L - 1)),
KV head h takes source head h mod H_src, token counts (A-shape sink/local, vertical-slash lines, windows)
are scaled from the artifact's calibration length to min(N, 32K) as the search space scales them
(reference 32K, fixed beyond), and the TriangleMix start layer keeps its fraction of the depth.

Per length, each timed with CUDA events (median): the stack on SDPA, the stack through the sparsesearch
runtime, and the stack with attention free (an attention function that returns zeros) — so attention's
share of each is total minus that "rest" — and, separately, every dynamic index the sparse prefill builds
(each layer's head groups on q/k of the prefill's shape, through the runtime's StaticIndexCache), and the
runtime's attention alone per layer kind (each layer's ``Runner.attend`` on random q/k/v of the prefill's
shape, summed by kind), with the computed density of each pattern's indexes.

``--indexes`` picks where the vertical-slash heads' indexes come from:
- ``estimated``: the runtime's own estimate on the stack's q/k, as in deployment. Random weights carry no
  attention structure, so the estimate spreads each head's slash budget over scattered offsets, and the
  block cover of that many scattered diagonals lists nearly every block: those heads run almost dense,
  which no calibrated head of a real model does (their densities are in the artifact).
- ``planted``: each group's index comes from planted lines instead: its ``slash_size`` nearest diagonals
  (the local band where real heads put most of their slash mass, and where the forced ones lie) and
  ``vertical_size`` columns (the forced first ones plus a seeded random rest), built once per shape. The
  prefill then builds no vertical-slash index, so its total adds the estimate's measured cost
  (``index_ms``, the same builds on the same shapes).
Times are CUDA-event medians of repeated calls (benchmarks/timing.py ``call_ms``); a call that takes over
a second (a prefill at 512K+) is timed once, after one warm call. From ``--compose-dense-from`` tokens (default
512K) the SDPA stack is not run whole: at 1M one dense pass is ~9 minutes on an H200, past a device
command's limit. Its time is composed as the attention-free pass plus layers x one layer's SDPA attention
(transformers' own sdpa attention function on q/k/v of the prefill's shape) — every layer has the same
shape, so that is the stack's attention. Below that length the row carries both, the measured and the
composed, so the composition is checked where both fit (``prefill_dense_composed_ms``).
Needs a CUDA GPU with room for the 8B weights (16 GB) and the activations (~110 GB at 1M tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

# Before torch: at 1M tokens the MLP asks for 28 GiB blocks, and with fixed segments the caching allocator
# fragments past them (an H200 run died with 22 GiB reserved but unusable).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
import triton
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from benchmarks.timing import call_ms, cuda_clock
from benchmarks.ttft import SHAPES, prefill_fn
from sparsesearch.artifacts import load_artifact
from benchmarks.kernels import computed_density
from sparsesearch.execute import HeadGroup, StaticIndexCache
from sparsesearch.patterns._common import expand_heads
from sparsesearch.index import BlockIndex
from sparsesearch.patterns import vertical_slash
from sparsesearch.patterns.registry import REGISTRY
from sparsesearch.runtime import apply, remove, runner_of
from sparsesearch.search.space import ROUND

SCALED = ("sink", "local", "window", "vertical_size", "slash_size")  # the bundled spaces' scaled_params
REFERENCE_TOKENS = 32768  # the bundled spaces' reference length: token counts stop growing there


def mapped_artifact(src, layers: int, kv_heads: int, tokens: int) -> SimpleNamespace:
    """The source artifact's global head rows on a (layers x kv_heads) stack at ``tokens`` (module doc)."""
    manifest = src.manifest
    if manifest.get("head_index_space") != "kv":
        raise ValueError("the mapping takes a kv-head-space artifact")
    src_tokens = int(manifest["methods"]["mminference"]["max_tokens"])
    factor = min(tokens, REFERENCE_TOKENS) / src_tokens
    heads = src.heads[src.heads["boundary"] == "none"]
    src_layers, src_heads = int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1
    rows = []
    for layer in range(layers):
        s = round(layer * (src_layers - 1) / max(1, layers - 1))
        for head in range(kv_heads):
            row = heads[(heads["layer"] == s) & (heads["head"] == head % src_heads)].iloc[0].to_dict()
            for name in SCALED:
                if row.get(name) is not None and not (isinstance(row[name], float) and math.isnan(row[name])):
                    row[name] = max(ROUND, int(round(row[name] * factor / ROUND)) * ROUND)
            rows.append(row | {"layer": layer, "head": head})
    tri = dict((manifest.get("methods") or {}).get("trianglemix") or {})
    if tri.get("start_layer") is not None:
        tri["start_layer"] = round(int(tri["start_layer"]) * layers / src_layers)
    methods = {"mminference": manifest["methods"]["mminference"], "trianglemix": tri or None}
    return SimpleNamespace(manifest={"head_index_space": "kv", "methods": methods}, heads=pd.DataFrame(rows))


def zero_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention for free: zeros in transformers' output layout [B, N, H, D]."""
    return torch.zeros_like(query).transpose(1, 2), None


def planted_vs_index(g: HeadGroup, batch: int, q_len: int, kv_len: int, space: str, device, seed: int) -> BlockIndex:
    """The index of planted lines for a vertical-slash group (module doc): the ``slash_size`` nearest
    diagonals and ``vertical_size`` columns, the first ``forced`` ones plus a seeded random rest."""
    p = g.params
    n_vert, n_slash = min(p.vertical_size, kv_len), min(p.slash_size, kv_len)
    fixed = vertical_slash.forced(p.force_vertical, n_vert)
    gen = torch.Generator().manual_seed(seed)
    vert = torch.cat([torch.arange(fixed), fixed + torch.randperm(kv_len - fixed, generator=gen)[: n_vert - fixed]]).sort().values
    lines = vertical_slash.VSLines(
        vertical=vert.to(device)[None, None].contiguous(), slash=torch.arange(n_slash, device=device)[None, None].contiguous(),
        q_len=q_len, kv_len=kv_len, head_space=space,
    )
    # Every head of the group has the same lines: one head's index, broadcast (the torch build from lines
    # holds [QB, KB] per head; at 1M tokens and 64-blocks that is 24 GiB for a group, past the free memory).
    one = vertical_slash.index_from_lines(lines, block_m=g.block_m, block_n=g.block_n)
    return expand_heads(one, batch, len(g.heads))


class PlantedIndexCache(StaticIndexCache):
    """The runtime's index cache with planted vertical-slash indexes (``planted_vs_index``), one per group and
    shape, kept for the whole run; every other group as the runtime builds it."""

    def __init__(self):
        super().__init__()
        self._planted: dict[tuple, BlockIndex] = {}

    def index(self, g: HeadGroup, q: torch.Tensor, k: torch.Tensor, space: str) -> BlockIndex:
        if g.pattern != "vertical_slash":
            return super().index(g, q, k, space)
        key = (g.params, g.heads, g.block_m, g.block_n, q.shape[0], q.shape[2], k.shape[2], space)
        if key not in self._planted:
            self._planted[key] = planted_vs_index(g, q.shape[0], q.shape[2], k.shape[2], space, q.device, seed=len(self._planted))
        return self._planted[key]


def attention_split(plan, runner, batch: int, n: int, q_heads: int, kv_heads: int, dim: int) -> tuple[dict, dict]:
    """The runtime's attention alone on random q/k/v of the prefill's shape: ms per layer kind (each
    layer's ``Runner.attend``, median, summed by kind) and the mean computed density per pattern (over the
    sparse layers' groups, as the kernel pays: partial blocks whole, gathered columns per query block)."""
    q = torch.randn(batch, q_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms: dict[str, float] = {}
    for layer in plan.layers:
        ms[layer.kind] = ms.get(layer.kind, 0.0) + timed_ms(lambda: runner.attend(layer, q, k, v))
    dens: dict[str, list[float]] = {}
    for layer in plan.layers:
        for g in layer.groups if layer.kind == "sparse" else ():
            dens.setdefault(g.pattern, []).append(computed_density(runner._static.index(g, q, k, plan.head_space), n))
    return {kind: round(t, 1) for kind, t in ms.items()}, {p: round(sum(d) / len(d), 4) for p, d in dens.items()}


def timed_ms(fn) -> float:
    """ms of one fn call on the GPU (benchmarks/timing.py call_ms: one timed call past a second)."""
    return call_ms(fn, cuda_clock())


def sdpa_layer_ms(model, batch: int, n: int, q_heads: int, kv_heads: int, dim: int) -> float:
    """One layer's dense attention as the SDPA stack runs it: transformers' sdpa attention function of
    layer 0's module on random q [B, Hq, N, D], k/v [B, Hkv, N, D] (causal, no mask)."""
    attn = model.model.layers[0].self_attn
    q = torch.randn(batch, q_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        return timed_ms(lambda: ALL_ATTENTION_FUNCTIONS["sdpa"](attn, q, k, v, None, dropout=0.0, scaling=attn.scaling))


def index_ms(plan, batch: int, n: int, q_heads: int, kv_heads: int, dim: int) -> float:
    """Every dynamic index one sparse prefill builds (the plan's sparse layers' dynamic groups), timed."""
    cache = StaticIndexCache()
    q = torch.randn(batch, q_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    groups = [g for layer in plan.layers if layer.kind == "sparse" for g in layer.groups if REGISTRY[g.pattern].DYNAMIC]

    def build():
        for g in groups:
            cache.index(g, q, k, plan.head_space)

    return timed_ms(build) if groups else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                        help="the stack (benchmarks/ttft.py's SHAPES; 7b: GQA 28/4, groups of 7)")
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/reference/smollm2-135m-4k"))
    parser.add_argument("--indexes", nargs="+", choices=("estimated", "planted"), default=["estimated", "planted"],
                        help="where the vertical-slash heads' indexes come from (module doc)")
    parser.add_argument("--compose-dense-from", type=int, default=524288,
                        help="from this many tokens the SDPA stack's time is composed, not run (module doc)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_prefill.jsonl"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/e2e_prefill.py needs a CUDA GPU")
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    config = LlamaConfig(**shape, max_position_embeddings=max(args.tokens), attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    AttentionInterface.register("zero_attention", zero_attention)
    src = load_artifact(args.artifact)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    layers, q_heads, kv_heads = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // q_heads
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in args.tokens:
        prefill = prefill_fn(model, n)
        bench = lambda: timed_ms(prefill)  # noqa: E731
        composed = n >= args.compose_dense_from
        t_dense_run = None if composed else bench()
        model.set_attn_implementation("zero_attention")
        t_rest = bench()
        model.set_attn_implementation("sdpa")
        t_layer = sdpa_layer_ms(model, 1, n, q_heads, kv_heads, dim)
        torch.cuda.empty_cache()  # its q/k/v: the 1M passes need the room
        t_composed = t_rest + layers * t_layer
        t_dense = t_composed if composed else t_dense_run
        print(f"{n} tokens: dense {'composed' if composed else 'run'} {t_dense:.1f} ms (composed {t_composed:.1f}), "
              f"attention-free {t_rest:.1f} ms", flush=True)
        art = mapped_artifact(src, layers, kv_heads, n)
        for mode in args.indexes:
            plan = apply(model, art, min_tokens=1024)
            runner = runner_of(model)
            if mode == "planted":
                runner._static = PlantedIndexCache()  # the runtime's cache, vertical-slash groups planted
            try:
                t_sparse = bench()
                split, density = attention_split(plan, runner, 1, n, q_heads, kv_heads, dim)
            finally:
                remove(model)
            t_index = index_ms(plan, 1, n, q_heads, kv_heads, dim)
            # Planted: the prefill built no vertical-slash index, so the estimate's cost is added back.
            t_total = t_sparse + (t_index if mode == "planted" else 0.0)
            kinds = pd.Series([layer.kind for layer in plan.layers]).value_counts().to_dict()
            patterns = art.heads["pattern"].value_counts().to_dict()
            row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "shape": args.shape, "tokens": n, "artifact": str(args.artifact), "indexes": mode, "layer_kinds": kinds,
                   "head_patterns": patterns, "triangle_start_layer": (art.manifest["methods"]["trianglemix"] or {}).get("start_layer"),
                   "prefill_dense_ms": round(t_dense, 1), "prefill_dense_method": "composed" if composed else "run",
                   "prefill_dense_composed_ms": round(t_composed, 1), "sdpa_layer_ms": round(t_layer, 2),
                   "prefill_sparse_ms": round(t_total, 1), "prefill_sparse_run_ms": round(t_sparse, 1),
                   "rest_ms": round(t_rest, 1),
                   "attention_dense_ms": round(t_dense - t_rest, 1), "attention_sparse_ms": round(t_total - t_rest, 1),
                   "index_ms": round(t_index, 1), "attention_by_kind_ms": split, "density_by_pattern": density,
                   "speedup": round(t_dense / t_total, 3), "speedup_attention_free_limit": round(t_dense / t_rest, 3),
                   "command": command}
            print(json.dumps(row), flush=True)
            # One row at a time: a 1M run takes minutes per length, and a later length may not finish.
            with args.out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
