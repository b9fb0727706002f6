"""The pattern registry: every pattern declares every fact, and no other module keeps a pattern list.

A new pattern touches its own module, patterns/registry.py and its tests; these tests fail when a
consumer grows its own list of pattern names again (the static/dynamic lists of runtime, export/flex and
search/cost once disagreed about grid).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pyarrow as pa
import pytest

from sparsesearch.artifacts.columns import PARAM_COLUMNS
from sparsesearch.kernels.dynamic_index import BUILDS, REFUSALS
from sparsesearch.patterns.registry import FACTS, PARAMS, REGISTRY, pattern

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_pattern_declares_every_fact(name):
    module = REGISTRY[name]
    missing = [fact for fact in FACTS if not hasattr(module, fact)]
    assert not missing, f"{name} lacks {missing}"
    assert module.NAME == name and PARAMS[name] is module.Params
    assert dataclasses.is_dataclass(module.Params) and module.Params.__dataclass_params__.frozen
    for flag in ("DYNAMIC", "REGION", "STREAMING"):
        assert isinstance(getattr(module, flag), bool), (name, flag)
    assert re.fullmatch(r"#[0-9a-f]{6}", module.COLOR), module.COLOR
    for tokens in (1, 64, 1000, 32768):
        assert isinstance(module.demo_params(tokens), module.Params), (name, tokens)


def test_facts_agree_with_build_index_signatures():
    """DYNAMIC patterns take q and k; REGION patterns take the region frame row_pos."""
    import inspect

    for name, module in REGISTRY.items():
        args = inspect.signature(module.build_index).parameters
        assert ("q" in args) == module.DYNAMIC, name
        assert (name in BUILDS and name in REFUSALS) == module.DYNAMIC, name  # its fused build and its limits
        assert ("row_pos" in args) == module.REGION, name


def test_colours_are_distinct():
    colors = [m.COLOR for m in REGISTRY.values()]
    assert len(set(colors)) == len(colors)


def test_unknown_pattern_names_the_known_ones():
    with pytest.raises(ValueError, match="known: "):
        pattern("nope")


def test_param_columns_keep_the_v1_layout():
    """The registry assembles heads.parquet's parameter columns; their order and types are the file format."""
    assert list(PARAM_COLUMNS) == [
        "sink", "local", "window", "last", "vertical_size", "slash_size", "last_q", "force_vertical", "force_slash",
        "k_blocks", "sink_blocks", "stride", "phase", "use_hline", "use_vline", "use_slash",
    ]
    assert {n for n, t in PARAM_COLUMNS.items() if t == pa.bool_()} == {"use_hline", "use_vline", "use_slash"}
    assert all(t in (pa.int32(), pa.bool_()) for t in PARAM_COLUMNS.values())


def _pattern_lists(path: Path) -> list[int]:
    """Lines holding a tuple/list/set literal or dict keys with two or more pattern names."""
    names = set(REGISTRY)
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
        found = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
        if len(found) >= 2:
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_patterns_keeps_a_pattern_list():
    files = [p for d in ("sparsesearch", "cli") for p in (ROOT / d).rglob("*.py") if "patterns" not in p.relative_to(ROOT).parts]
    offenders = {str(p.relative_to(ROOT)): lines for p in files if (lines := _pattern_lists(p))}
    assert not offenders, f"per-pattern lists outside patterns/ (read the registry's facts instead): {offenders}"


def test_every_pattern_has_a_short_unique_label():
    labels = [m.LABEL for m in REGISTRY.values()]
    assert all(isinstance(label, str) and 0 < len(label) <= 7 for label in labels) and len(set(labels)) == len(labels)
