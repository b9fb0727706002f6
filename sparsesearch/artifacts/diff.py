"""Row-by-row differences between two artifacts' heads tables (what `sparsesearch diff` shows).

Rows are matched on (layer, head, q_modality, k_modality). When the artifacts use different head spaces
the KV-space one is expanded to query heads first (each KV row copied to its group), so both compare in
query-head space.
"""

from __future__ import annotations

import math

from .columns import PARAM_COLUMNS
from .io import Artifact
from .tables import sort_key, to_query_heads

COMPARED = ("pattern", "boundary", "block_m", "block_n", *PARAM_COLUMNS)


def _key_dict(key: tuple) -> dict:
    return dict(zip(("layer", "head", "q_modality", "k_modality"), key))


def diff_artifacts(a: Artifact, b: Artifact, *, density_tol: float = 1e-9) -> dict:
    """{"head_index_space", "model_changes", "only_a", "only_b", "changed", "same_rows"}.

    changed: one entry per matched row that differs, with ``fields`` {name: [a, b]} for pattern, boundary,
    block sizes and every parameter column, and ``density`` [a, b] when the densities differ by more than
    ``density_tol`` (or one is null).
    """
    rows_a, rows_b = a.head_rows(), b.head_rows()
    space = a.head_index_space
    if a.head_index_space != b.head_index_space:
        rows_a, rows_b = to_query_heads(rows_a, a.manifest), to_query_heads(rows_b, b.manifest)
        space = "query"
    by_a = {sort_key(r): r for r in rows_a}
    by_b = {sort_key(r): r for r in rows_b}
    model_changes = {
        k: [a.manifest["model"].get(k), b.manifest["model"].get(k)]
        for k in sorted(set(a.manifest["model"]) | set(b.manifest["model"]))
        if a.manifest["model"].get(k) != b.manifest["model"].get(k)
    }
    changed, same = [], 0
    for key in sorted(set(by_a) & set(by_b)):
        ra, rb = by_a[key], by_b[key]
        fields = {name: [ra[name], rb[name]] for name in COMPARED if ra[name] != rb[name]}
        da, db = ra["density"], rb["density"]
        density = None
        if (da is None) != (db is None) or (da is not None and not math.isclose(da, db, rel_tol=0, abs_tol=density_tol)):
            density = [da, db]
        if fields or density is not None:
            changed.append({**_key_dict(key), "fields": fields, "density": density})
        else:
            same += 1
    return {
        "head_index_space": space,
        "model_changes": model_changes,
        "only_a": [_key_dict(k) for k in sorted(set(by_a) - set(by_b))],
        "only_b": [_key_dict(k) for k in sorted(set(by_b) - set(by_a))],
        "changed": changed,
        "same_rows": same,
    }
