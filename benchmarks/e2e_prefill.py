"""End-to-end prefill of an 8B-shaped stack with a real calibrate + probe-layers pattern mix vs SDPA (issue 14 §2).

    PYTHONPATH=. python benchmarks/e2e_prefill.py --tokens 32768 131072

The stack is `benchmarks/ttft.py`'s random-weight Llama-3.1-8B shape (32 layers, hidden 4096, GQA 32/8,
MLP 14336), prefilled as generate's first step does (`logits_to_keep=1`, no KV cache kept), bf16. The
pattern mix is an artifact's (default: the bundled SmolLM2-135M reference, a real `calibrate` +
`probe-layers` run at 4K) mapped onto the stack: layer l takes source layer round(l (L_src - 1) / (L - 1)),
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
Needs a CUDA GPU with room for the 8B weights (16 GB) and the activations.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
import triton
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from benchmarks.ttft import SHAPES, prefill_fn
from sparsesearch.artifacts import load_artifact
from benchmarks.kernels import computed_density
from sparsesearch.execute import HeadGroup, StaticIndexCache
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
        vertical=vert.to(device).expand(batch, len(g.heads), -1).contiguous(),
        slash=torch.arange(n_slash, device=device).expand(batch, len(g.heads), -1).contiguous(),
        q_len=q_len, kv_len=kv_len, head_space=space,
    )
    return vertical_slash.index_from_lines(lines, block_m=g.block_m, block_n=g.block_n)


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
        t = float(triton.testing.do_bench(lambda: runner.attend(layer, q, k, v), warmup=25, rep=100, return_mode="median"))
        ms[layer.kind] = ms.get(layer.kind, 0.0) + t
    dens: dict[str, list[float]] = {}
    for layer in plan.layers:
        for g in layer.groups if layer.kind == "sparse" else ():
            dens.setdefault(g.pattern, []).append(computed_density(runner._static.index(g, q, k, plan.head_space), n))
    return {kind: round(t, 1) for kind, t in ms.items()}, {p: round(sum(d) / len(d), 4) for p, d in dens.items()}


def index_ms(plan, batch: int, n: int, q_heads: int, kv_heads: int, dim: int) -> float:
    """Every dynamic index one sparse prefill builds (the plan's sparse layers' dynamic groups), timed."""
    cache = StaticIndexCache()
    q = torch.randn(batch, q_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16)
    groups = [g for layer in plan.layers if layer.kind == "sparse" for g in layer.groups if REGISTRY[g.pattern].DYNAMIC]

    def build():
        for g in groups:
            cache.index(g, q, k, plan.head_space)

    return float(triton.testing.do_bench(build, warmup=100, rep=500, return_mode="median")) if groups else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--artifact", type=Path, default=Path("artifacts/reference/smollm2-135m-4k"))
    parser.add_argument("--indexes", nargs="+", choices=("estimated", "planted"), default=["estimated", "planted"],
                        help="where the vertical-slash heads' indexes come from (module doc)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_prefill.jsonl"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/e2e_prefill.py needs a CUDA GPU")
    torch.manual_seed(0)
    shape = SHAPES["8b"]
    config = LlamaConfig(**shape, max_position_embeddings=max(args.tokens), attn_implementation="sdpa", tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    AttentionInterface.register("zero_attention", zero_attention)
    src = load_artifact(args.artifact)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    layers, q_heads, kv_heads = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape["hidden_size"] // q_heads
    rows = []
    for n in args.tokens:
        prefill = prefill_fn(model, n)
        bench = lambda: float(triton.testing.do_bench(prefill, warmup=100, rep=500, return_mode="median"))  # noqa: E731
        t_dense = bench()
        model.set_attn_implementation("zero_attention")
        t_rest = bench()
        model.set_attn_implementation("sdpa")
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
                   "shape": "8b", "tokens": n, "artifact": str(args.artifact), "indexes": mode, "layer_kinds": kinds,
                   "head_patterns": patterns, "triangle_start_layer": (art.manifest["methods"]["trianglemix"] or {}).get("start_layer"),
                   "prefill_dense_ms": round(t_dense, 1), "prefill_sparse_ms": round(t_total, 1), "prefill_sparse_run_ms": round(t_sparse, 1),
                   "rest_ms": round(t_rest, 1),
                   "attention_dense_ms": round(t_dense - t_rest, 1), "attention_sparse_ms": round(t_total - t_rest, 1),
                   "index_ms": round(t_index, 1), "attention_by_kind_ms": split, "density_by_pattern": density,
                   "speedup": round(t_dense / t_total, 3), "speedup_attention_free_limit": round(t_dense / t_rest, 3),
                   "command": command}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
