"""`sparsesearch tune-kernels`: measure the Triton kernel's launch configs on this GPU and record the fastest."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from .common import JsonOpt, err_console, exits_cleanly, out_console, print_json


def _check_gpu_memory(tokens: int, heads: int, kv_heads: int, head_dim: int, block: int) -> None:
    """The timed launch's tensors fit in the GPU's free memory before any is made (on a machine without a GPU
    tune_launches refuses first): Q/K/V and two outputs in bf16, the block top-k index (int32 lists, ~20 B a
    block pair per head while it is built). Sizes below 1 are left to tune_launches' own checks."""
    import torch

    from sparsesearch.memory import fits_memory

    if not torch.cuda.is_available() or min(tokens, heads, kv_heads, head_dim, block) < 1:
        return
    blocks = -(-tokens // block)
    nbytes = 2 * (3 * heads + 2 * kv_heads) * tokens * head_dim + 20 * kv_heads * blocks * blocks
    fits_memory(f"--tokens {tokens} with {heads}/{kv_heads} heads of dim {head_dim}", nbytes,
                available=torch.cuda.mem_get_info()[0], where="the GPU")


@exits_cleanly
def tune_kernels(
    block: Annotated[Optional[list[int]], typer.Option("--block", help="Index block sizes to tune (repeatable; default 64 and 128).")] = None,
    head_dim: Annotated[Optional[list[int]], typer.Option("--head-dim", help="Head dims to tune (repeatable; default 64 and 128).")] = None,
    tokens: Annotated[int, typer.Option(help="Prompt length of the timed launches.")] = 16384,
    heads: Annotated[int, typer.Option(help="Query heads.")] = 32,
    kv_heads: Annotated[int, typer.Option(help="KV heads.")] = 8,
    density: Annotated[float, typer.Option(help="Block top-k density of the timed index (share of causal blocks).")] = 0.25,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Time and report, but leave the launch table as it is.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Time every candidate launch config of the block-sparse kernel on this GPU and record the fastest per (block,
    head_dim) in the user cache, where later runs' launches read it. Needs a CUDA GPU.

    Example: sparsesearch tune-kernels --block 64 --head-dim 128
    """
    from sparsesearch.kernel_tuning import tune_launches

    _check_gpu_memory(tokens, heads, kv_heads, max(head_dim or [128]), min(block or [64]))
    with err_console.status("tuning") as status:
        result = tune_launches(block or [64, 128], head_dim or [64, 128], tokens, heads, kv_heads, density,
                               write=not dry_run, progress=lambda what: status.update(f"tuning {what}"))
    if json_out:
        print_json(result)
        return
    table = Table(title=f"launch configs on {result['device']} — {tokens} tokens, {heads}/{kv_heads} heads, block top-k {density:.0%}")
    for col in ("block x d", "default", "default ms", "fastest", "fastest ms", "speed-up", "failed"):
        table.add_column(col, justify="left" if col in ("block x d", "default", "fastest") else "right", no_wrap=True)
    for r in result["results"]:
        show = lambda c: "—" if c is None else f"{c['TILE_N']} / {c['num_warps']} w / {c['num_stages']} st"  # noqa: E731
        ms = lambda t: "—" if t is None else f"{t:.3f}"  # noqa: E731
        gain = "—" if r["best_ms"] is None or r["default_ms"] is None else f"{r['default_ms'] / r['best_ms']:.2f}x"
        failed = sum("error" in row for row in r["rows"])
        table.add_row(r["key"], show(r["default"]), ms(r["default_ms"]), show(r["best"]), ms(r["best_ms"]), gain, str(failed))
    out_console.print(table)
    where = "not written (--dry-run)" if dry_run else f"written to {result['path']}"
    err_console.print(f"launch table {where}")
