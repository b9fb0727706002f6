"""Reports for people: PNG maps and plots (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path


def save_png(fig, path: Path, dpi: int = 120) -> Path:
    """Write a matplotlib figure atomically (temp file + rename) and close it."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    tmp.replace(path)
    return path
