"""How many compiles a modal search asks of the block-sparse kernel, counted on a CPU (issue 14 §3).

Triton compiles a ``@triton.jit`` kernel once per key: its constexprs plus, for every argument the kernel
does not mark ``do_not_specialize``, whether an integer is 1, a multiple of 16, or past int32, and whether a
pointer is 16-byte aligned. A cold modal search on an H200 compiled 110 variants of ``_block_sparse_fwd``,
about two minutes of its 207 s (benchmarks/RESULTS.md, "Search time"). This runs the same search on a CPU, with
the interpreted kernel standing in for CUDA's. It records every launch's key by those rules, honouring the
kernel's ``do_not_specialize``, and reports how many keys there are, how many constexpr sets, and which
arguments split a set. A change meant to cut compiles can be checked here before it spends GPU time.

    PYTHONPATH=. TRITON_INTERPRET=1 python -m benchmarks.compile_keys --layers 2 --tokens 2048   # ~9 min
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

from benchmarks.search_time import NAMES, activations, interleave
from sparsesearch import execute
from sparsesearch.kernels import block_sparse, block_sparse_attention
from sparsesearch.search.boundary import search_modal_layer
from sparsesearch.search.cost import AnalyticCost
from sparsesearch.search.space import load_space


def generic_args(kernel) -> set[str]:
    """Names of the arguments ``kernel`` (JIT or interpreted) keeps out of its compile key."""
    names = list(kernel.arg_names)
    marked = getattr(kernel, "do_not_specialize", None)
    if marked is None:  # the interpreter keeps the decorator's arguments as given
        marked = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize")
    return {names[m] if isinstance(m, int) else m for m in (marked or ())}


def arg_key(value, specialised: bool = True) -> tuple:
    """What Triton's compile key holds of one argument: its type (pointer dtype, int32 or int64) always, and
    when specialised, whether a pointer is 16-byte aligned and whether an int is 1 or a multiple of 16."""
    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype)) + ((value.data_ptr() % 16 == 0,) if specialised else ())
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", -(2**31) <= value < 2**31) + ((value == 1, value % 16 == 0) if specialised else ())
    return (type(value).__name__,)


def launch_key(names: list[str], generic: set[str], args: tuple, constexprs: dict) -> tuple:
    """(constexprs, per-argument keys): one compile per distinct value."""
    specs = tuple(arg_key(value, name not in generic) for name, value in zip(names, args))
    return tuple(sorted(constexprs.items())), specs


class KeyRecorder:
    """Stands in for ``block_sparse._block_sparse_fwd``: records each launch's key, then launches."""

    def __init__(self, kernel):
        self.kernel, self.names, self.generic = kernel, list(kernel.arg_names), generic_args(kernel)
        self.keys: set[tuple] = set()

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.keys.add(launch_key(self.names, self.generic, args, constexprs))
            return self.kernel[grid](*args, **constexprs)

        return launch

    def summary(self) -> dict:
        by_constexprs = collections.defaultdict(set)
        for constexprs, specs in self.keys:
            by_constexprs[constexprs].add(specs)
        splitting = collections.Counter()
        for specs in by_constexprs.values():
            for i in range(len(next(iter(specs)))):  # the positional arguments (constexprs come by name)
                if len({s[i] for s in specs}) > 1:
                    splitting[self.names[i]] += 1
        return {"keys": len(self.keys), "constexpr_sets": len(by_constexprs), "generic_args": sorted(self.generic),
                "splitting_args": dict(splitting.most_common())}


def triton_attend(q, k, v, index, scale, heads, out, lse, row_pos=None, *, maps=None, lines=None) -> None:
    """``execute.sparse_attend`` as it runs on CUDA: the Triton kernel (interpreted on a CPU)."""
    block_sparse_attention(q, k, v, index, scale=scale, heads=heads, out=out, lse=lse, row_pos=row_pos, maps=maps, lines=lines)


def run(layers: int, heads: int, kv_heads: int, dim: int, tokens: int) -> dict:
    recorder = KeyRecorder(block_sparse._block_sparse_fwd)
    saved = block_sparse._block_sparse_fwd, execute.sparse_attend
    block_sparse._block_sparse_fwd, execute.sparse_attend = recorder, triton_attend
    try:
        space, costs = load_space(), AnalyticCost()
        modality = interleave(tokens, torch.device("cpu"), span=min(1024, tokens // 8))
        for layer in range(layers):
            q, k, v = activations(layer, heads, kv_heads, tokens, dim, torch.device("cpu"), torch.float32)
            search_modal_layer(q, k, v, modality, NAMES, space, costs, head_space="kv", objective="output_error")
            print(f"layer {layer}: {len(recorder.keys)} keys so far", file=sys.stderr, flush=True)
    finally:
        block_sparse._block_sparse_fwd, execute.sparse_attend = saved
    return {"layers": layers, "q_heads": heads, "kv_heads": kv_heads, "head_dim": dim, "tokens": tokens, **recorder.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("benchmarks/compile_keys.py runs the interpreted kernel on a CPU: set TRITON_INTERPRET=1")
    print(json.dumps(run(args.layers, args.heads, args.kv_heads, args.dim, args.tokens)))


if __name__ == "__main__":
    main()
