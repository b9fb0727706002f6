"""Run by .ci/run with a fresh venv's Python, from outside the repository, after `pip install` of the
built wheel (not editable): every module of the source tree must import from the installed package, the
bundled data files must be there, and nothing may come from the checkout.

usage: python check_wheel.py REPO_ROOT
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Source directory -> the package name it installs as (setup.py).
ROOTS = {"sparsesearch": "sparsesearch", "cli": "sparsesearch_cli", "search_spaces": "sparsesearch.search_spaces"}
DATA = {"sparsesearch.search_spaces": "mminference.json", "sparsesearch.artifacts": "manifest.v1.json"}


def source_modules(repo: Path) -> list[str]:
    """Every module the checkout has, named as the wheel installs it."""
    names = []
    for folder, package in ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = path.relative_to(repo / folder).with_suffix("").parts
            if "__pycache__" in parts or parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((package, *parts)))
    return names


def main(repo: Path) -> int:
    failures = []
    for name in source_modules(repo):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, not just the first
            failures.append(f"{name}: {exc.__class__.__name__}: {exc}")
            continue
        origin = Path(getattr(module, "__file__", "") or "").resolve()
        if repo in origin.parents:
            failures.append(f"{name}: imported from the checkout ({origin}), not from the wheel")
    for package, filename in DATA.items():
        folder = Path(importlib.import_module(package).__file__).parent
        if not (folder / filename).is_file():
            failures.append(f"{package}: {filename} missing from the wheel")
    for line in failures:
        print(f"wheel check: {line}", file=sys.stderr)
    print(f"wheel check: {len(source_modules(repo)) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
