"""`sparsesearch check`: every pattern end to end (index -> kernel -> oracle) on this machine."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from .common import BadInput, DeviceOpt, JsonOpt, err_console, exits_cleanly, out_console, prepare_cpu_kernels, print_json, resolve_device


def _check_sizes(tokens: int, heads: int, kv_heads: int, head_dim: int, block: int) -> None:
    """Positive sizes whose tensors fit in memory, before any is made: random Q/K/V drawn in float32 and cast,
    the kernel's and the oracle's outputs (``16 B`` an element, all told), and a pattern's block masks packed
    into lists (about 20 B a block pair per head)."""
    from sparsesearch.memory import fits_memory

    for option, value in (("--tokens", tokens), ("--heads", heads), ("--kv-heads", kv_heads), ("--head-dim", head_dim), ("--block", block)):
        if value < 1:
            raise BadInput(f"{option} must be >= 1, got {value}")
    blocks = -(-tokens // block)
    nbytes = 16 * (heads + 2 * kv_heads) * tokens * head_dim + 20 * heads * blocks * blocks
    fits_memory(f"--tokens {tokens} with {heads}/{kv_heads} heads of dim {head_dim}", nbytes)


@exits_cleanly
def check(
    tokens: Annotated[int, typer.Option(help="Sequence length of the random Q/K/V.")] = 1024,
    heads: Annotated[int, typer.Option(help="Query heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="KV heads (GQA group = heads / kv_heads).")] = 2,
    head_dim: Annotated[int, typer.Option(help="64, 80, 96, 128 or 256.")] = 64,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32.")] = "bf16",
    block: Annotated[int, typer.Option(help="Index block size (16, 32, 64 or 128).")] = 64,
    pattern: Annotated[Optional[list[str]], typer.Option("--pattern", help="Only these patterns (repeatable).")] = None,
    device: DeviceOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Build every pattern's index, run our Triton kernel and compare with the torch oracle.

    Example: sparsesearch check --tokens 512 --pattern vertical_slash --pattern triangle
    """
    _check_sizes(tokens, heads, kv_heads, head_dim, block)
    device = resolve_device(device)
    prepare_cpu_kernels(device)
    from sparsesearch.selfcheck import check_patterns, rows_as_dicts

    with err_console.status("checking patterns") as status:
        rows = check_patterns(tokens, heads, kv_heads, head_dim, dtype, block, device, pattern,
                              progress=lambda name: status.update(f"checking {name}"))
    if json_out:
        print_json({"device": device, "tokens": tokens, "rows": rows_as_dicts(rows)})
    else:
        table = Table(title=f"sparsesearch check — {tokens} tokens, {heads}/{kv_heads} heads, d={head_dim}, {dtype}, {device}")
        for col in ("pattern", "density", "rel. error", "budget", "ok", "index ms", "kernel ms"):
            table.add_column(col, justify="left" if col == "pattern" else "right", no_wrap=True)
        for r in rows:
            table.add_row(r.pattern, f"{r.density:.3f}", f"{r.rel_error:.2e}", f"{r.budget:.2e}",
                          "[green]yes[/green]" if r.ok else "[red]NO[/red]", f"{r.index_ms:.1f}", f"{r.kernel_ms:.1f}")
        out_console.print(table)
    if not all(r.ok for r in rows):
        raise typer.Exit(code=1)
