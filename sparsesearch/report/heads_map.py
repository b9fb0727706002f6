"""PNG map of an artifact's global rows: layers x heads, colour = pattern, label = density (%) and, for
boundary heads, their type (K, Q, 2D); a hybrid model's sliding layers are labelled W (the model's window)."""

from __future__ import annotations

from pathlib import Path

from ..artifacts.columns import is_global
from ..patterns.registry import REGISTRY
from . import save_png

PATTERN_COLORS = {name: module.COLOR for name, module in REGISTRY.items()}


def draw_heads_map(rows: list[dict], info, path: Path, density: dict | None = None) -> Path:
    """rows: heads.parquet records (the all x all rows are drawn); density: {(layer, head): value} to label
    with instead of the rows' own (calibrate's effective densities of boundary heads). Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    text = [r for r in rows if is_global(r)]
    heads = max(r["head"] for r in text) + 1 if text else 1
    names = list(PATTERN_COLORS)
    grid = [[names.index("dense")] * heads for _ in range(info.num_layers)]
    labels = [[""] * heads for _ in range(info.num_layers)]
    for r in text:
        grid[r["layer"]][r["head"]] = names.index(r["pattern"])
        value = (density or {}).get((r["layer"], r["head"]), r.get("density"))
        if value is not None:
            labels[r["layer"]][r["head"]] = f"{100 * value:.0f}"
        if r.get("boundary", "none") != "none":
            labels[r["layer"]][r["head"]] += f" {r['boundary'].upper()}"
        if info.window_of(r["layer"]) is not None:  # a hybrid model's own window, not a searched choice
            labels[r["layer"]][r["head"]] += " W"
    fig, ax = plt.subplots(figsize=(max(5.5, 0.5 * heads + 2), max(4, 0.25 * info.num_layers + 1.5)))
    ax.imshow(grid, cmap=ListedColormap([PATTERN_COLORS[n] for n in names]), vmin=0, vmax=len(names) - 1, aspect="auto")
    for layer in range(info.num_layers):
        for head in range(heads):
            ax.text(head, layer, labels[layer][head], ha="center", va="center", fontsize=6, color="white")
    ax.set_xticks(range(heads))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    window = f" · W: the model's sliding window {info.sliding_window}" if info.sliding_layers else ""
    ax.set_title(f"{info.id}\npattern per head · numbers: density % · K/Q/2D: boundary type{window}", fontsize=10)
    used = sorted({r["pattern"] for r in text}) or ["dense"]
    ax.legend(handles=[Patch(color=PATTERN_COLORS[n], label=n) for n in used], loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(used), fontsize=7)
    fig.tight_layout()
    return save_png(fig, path)
