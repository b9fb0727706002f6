"""Where per-user files live, read from the environment at call time: $XDG_CACHE_HOME (else ~/.cache), and sparsesearch's
own folder in it (the cost cache, the launch table, assembled model files)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


def user_cache_dir() -> Path:
    """sparsesearch's folder in the user cache."""
    return cache_home() / "sparsesearch"
