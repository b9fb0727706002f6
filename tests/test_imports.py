"""Imports point down: only runtime/ (and models/, inside its loading functions) may import transformers.

Each module is imported in a fresh interpreter in turn; the first one after which ``transformers`` is in
sys.modules is reported. The search borrowing the runtime used to load transformers on
``import sparsesearch.search.layer`` (about 3 s of its 4.6 s import).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import sparsesearch

ALLOWED = ("sparsesearch.runtime",)  # the one package that imports transformers at import time


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(sparsesearch.__path__, "sparsesearch.")]
    return sorted(n for n in names if not n.startswith(ALLOWED))


def test_only_runtime_imports_transformers():
    script = (
        "import importlib, sys\n"
        f"for name in {_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'transformers' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
    )
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "", f"importing {found} loads transformers"


def test_search_and_executor_import_without_transformers():
    script = (
        "import sys, sparsesearch.search.layer, sparsesearch.execute, sparsesearch.export.flex, sparsesearch.selfcheck, "
        "sparsesearch.calibrate\nprint('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
