"""Imports point down the floors of docs/architecture.md: a new back-arrow fails here (P13 §1/§4).

Every import in sparsesearch/ — module level and inside functions, absolute and relative — is mapped to the
floor of the top-level package or module it names. An import from a floor to a higher one is a back-arrow.
The ones the code had when this test was written are listed in KNOWN with where they sit; the test fails on
any other, and on a KNOWN entry that no longer exists (so the list only shrinks).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "sparsesearch"

# Lowest first. A module may import its own floor and the floors below it.
FLOORS = (
    ("ground", ("files", "user_cache", "index", "merge", "quality", "workdir", "memory", "json_input")),
    ("patterns", ("patterns",)),
    ("kernels", ("kernels", "reference")),
    ("executor", ("execute", "graphed")),
    ("data", ("artifacts", "models", "data")),
    ("runtime", ("runtime",)),
    ("services", ("search", "fidelity", "keycheck", "report", "preflight", "export")),
    ("methods", ("calibrate", "tuning", "probe", "nosa", "spava", "pareto", "kernel_tuning", "selfcheck")),
)
FLOOR = {name: i for i, (_, names) in enumerate(FLOORS) for name in names}

# (importing module, imported top-level name): the back-arrows to remove, each a P13 item.
KNOWN: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node, package: str) -> list[str]:
    """Dotted names an import statement names (relative ones resolved against ``package``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    return [mod] + ([f"{mod}.{a.name}" for a in node.names] if mod == "sparsesearch" else [])


def _top(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sparsesearch" else None


def back_arrows() -> set[tuple[str, str]]:
    found = set()
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, package):
                a, b = _top(me), _top(target)
                if a and b and a != b and FLOOR[b] > FLOOR[a]:
                    found.add((me, b))
    return found


def test_every_package_has_a_floor():
    names = {_top(_module(p)) for p in ROOT.rglob("*.py")} - {None}
    assert names <= set(FLOOR), f"place these in FLOORS (and docs/architecture.md): {sorted(names - set(FLOOR))}"


def test_no_new_back_arrow_and_no_stale_allowance():
    found = back_arrows()
    assert not found - KNOWN, f"imports that point up a floor (docs/architecture.md): {sorted(found - KNOWN)}"
    assert not KNOWN - found, f"these back-arrows are gone: delete them from KNOWN: {sorted(KNOWN - found)}"
