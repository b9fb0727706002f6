"""Reports for people: PNG maps and plots (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from ..files import atomic_path


def save_png(fig, path: Path, dpi: int = 120) -> Path:
    """Write a matplotlib figure whole or not at all (``files.atomic_path``) and close it, also when saving fails.
    The temporary ends in ``.png``: matplotlib picks the format from the name it writes to."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path, suffix=".tmp.png") as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    return path
