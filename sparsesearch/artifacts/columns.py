"""Column contract of heads.parquet (artifact v1), shared by the writer, the runtime and the exporters.

One row per (layer, head[, q_modality, k_modality]). A row's pattern parameters live in typed, nullable
columns named after the fields of the pattern's params dataclass (``Params`` in patterns/registry.py);
columns a pattern does not use are null. ``params_from_row`` / ``row_from_params`` convert both ways.

Modality regions (patterns/boundary.py): (all, all) is the global pattern every head has; (a, a) intra,
(a, b) cross, (a, all) the rows of a (Q-boundary), (all, b) the keys of b (K-boundary). ``boundary`` is the
head's chosen type and is the same on every row of the head; the runtime runs the regions of that type
(none: the global row) and ignores the head's other rows, which stay as the searched alternatives.

Hybrid models (ModelInfo.layer_types, e.g. Gemma 3): a sliding-window layer's rows carry the model's own
window as their pattern — ashape with sink 0 and local = sliding_window (``window_row``), one global row
per head, density computed, nothing measured. They are the model's attention, not a searched choice:
``check_window_rows`` refuses any other pattern on such a layer, so a row on a sliding layer always means
"the model's window", and readers (inspect, exports) tell them apart by the manifest's model.layer_types.
"""

from __future__ import annotations

from dataclasses import asdict, fields

import pyarrow as pa

from sparsesearch.patterns.boundary import ALL as ALL_MODALITIES  # every token: text-only and global rows
from sparsesearch.patterns.boundary import BOUNDARIES as BOUNDARIES  # re-exported: the schema lists them
from sparsesearch.patterns.registry import PARAMS, pattern

# A row's identity: at most one row per key, and the order rows are stored in.
HEADS_KEY = ("layer", "head", "q_modality", "k_modality")

# Arrow type of a params field by its annotation (dataclass fields are annotated int or bool).
ARROW_TYPES = {"int": pa.int32(), "bool": pa.bool_()}


def _param_columns() -> dict[str, pa.DataType]:
    """Every field of every registered pattern's params dataclass, with its arrow type, in registry order
    (first appearance): the file layout of heads.parquet, pinned by tests/test_artifacts.py."""
    columns: dict[str, pa.DataType] = {}
    for name, cls in PARAMS.items():
        for f in fields(cls):
            typ = ARROW_TYPES.get(f.type if isinstance(f.type, str) else f.type.__name__)
            if typ is None or columns.setdefault(f.name, typ) != typ:
                raise TypeError(f"{name} params field {f.name}: type {f.type!r} has no column type or differs from another pattern's")
    return columns


PARAM_COLUMNS: dict[str, pa.DataType] = _param_columns()

HEADS_SCHEMA = pa.schema(
    [
        pa.field("layer", pa.int32(), nullable=False),
        pa.field("head", pa.int32(), nullable=False),
        pa.field("q_modality", pa.string(), nullable=False),
        pa.field("k_modality", pa.string(), nullable=False),
        pa.field("boundary", pa.string(), nullable=False),
        pa.field("pattern", pa.string(), nullable=False),
        *[pa.field(name, typ, nullable=True) for name, typ in PARAM_COLUMNS.items()],
        pa.field("block_m", pa.int32(), nullable=False),
        pa.field("block_n", pa.int32(), nullable=False),
        # Measured at calibration (null when imported or hand-written):
        pa.field("density", pa.float64(), nullable=True),       # computed fraction of the causal matrix
        pa.field("recall", pa.float64(), nullable=True),        # attention mass (x |v|) kept
        pa.field("output_error", pa.float64(), nullable=True),  # relative L2 error of the head's output
        pa.field("latency_ms", pa.float64(), nullable=True),    # measured (GPU) or modelled (CPU) cost
        pa.field("score", pa.float64(), nullable=True),         # the objective value the search ranked by
        # Why the pick is not the head's best admissible sparse candidate (search/layer.py choose_head, or a
        # quality target that left the head dense); null when it is, or when not searched:
        pa.field("reason", pa.string(), nullable=True),
        # The pattern of another kind whose objective tied the pick's (search/layer.py TIE_ABS / TIE_REL): the
        # pick won on cost between equals, a coin toss between the two kinds; null when the pick was
        # strictly the best (a real preference), was not chosen among equals, or was not searched:
        pa.field("tie", pa.string(), nullable=True),
    ]
)

# Nullable columns added to heads.parquet v1 after artifacts without them were written: such a file loads
# with the column null (artifacts/io.py), so no migration is needed. New columns go here and at the end.
ADDED_COLUMNS = ("reason", "tie")


def is_global(row: dict) -> bool:
    """The head's global (all x all) row: what it runs without modality ids, and its boundary-none pattern."""
    return row["q_modality"] == ALL_MODALITIES and row["k_modality"] == ALL_MODALITIES


WINDOW_BLOCK = 64  # block_m = block_n of a sliding layer's window rows: the runtime runs the window with it


def window_params(window: int):
    """The pattern of a sliding-window layer: AShapeParams(sink=0, local=window), i.e. key j admitted for
    the query at position p iff 0 <= p - j < window (transformers' sliding_window_overlay + causal)."""
    from sparsesearch.patterns.ashape import AShapeParams

    return AShapeParams(sink=0, local=int(window))


def window_row(layer: int, head: int, window: int, *, density: float | None = None) -> dict:
    """The heads row of head ``head`` on sliding layer ``layer``: the model's window, nothing measured."""
    return {
        "layer": layer, "head": head, "q_modality": ALL_MODALITIES, "k_modality": ALL_MODALITIES,
        "boundary": "none", "pattern": "ashape", **row_from_params(window_params(window)),
        "block_m": WINDOW_BLOCK, "block_n": WINDOW_BLOCK, "density": density, "recall": None,
        "output_error": None, "latency_ms": None, "score": None, "reason": None, "tie": None,
    }


def is_window_row(row: dict, window: int) -> bool:
    """Whether ``row`` says exactly "the model's window" (global, boundary none, ashape sink 0, local window)."""
    return (
        is_global(row) and row["boundary"] == "none" and row["pattern"] == "ashape"
        and _int(row.get("sink")) == 0 and _int(row.get("local")) == int(window)
    )


def check_window_rows(rows, layer_types, sliding_window: int | None) -> None:
    """Raise ArtifactError (a ValueError, one line naming the layer and the constraint) when a row on a
    sliding-window layer is anything but that layer's window. layer_types: per layer "sliding_attention" /
    "full_attention", or None for a uniform full-attention model (nothing to check)."""
    from sparsesearch.artifacts.schema import ArtifactError

    if not layer_types:
        return
    for row in rows:
        layer = int(row["layer"])
        if layer_types[layer] == "sliding_attention" and not is_window_row(row, sliding_window):
            raise ArtifactError(
                f"layer {layer} is a sliding-window layer of the model (window {sliding_window}): its only pattern is that "
                f"window (ashape sink 0, local {sliding_window}, all->all), got {_describe(row)} for head {int(row['head'])}"
            )


def _int(value) -> int | None:
    return None if value is None or value != value else int(value)  # null or NaN from pandas -> None


def _describe(row: dict) -> str:
    values = {name: _int(row.get(name)) if PARAM_COLUMNS[name] != pa.bool_() else row.get(name) for name in PARAM_COLUMNS}
    params = ", ".join(f"{k} {v}" for k, v in values.items() if v is not None)
    scope = "" if is_global(row) else f" on {row['q_modality']}->{row['k_modality']}"
    return f"{row['pattern']}" + (f" ({params})" if params else "") + scope


def params_from_row(row: dict):
    """The params dataclass instance a heads row describes (validated by the dataclass)."""
    cls = pattern(row["pattern"]).Params
    values = {}
    for f in fields(cls):
        value = row.get(f.name)
        if value is None or value != value:  # null or NaN from pandas
            continue
        values[f.name] = bool(value) if PARAM_COLUMNS.get(f.name) == pa.bool_() else int(value)
    return cls(**values)


def row_from_params(params) -> dict:
    """Parameter columns for a params dataclass: its fields set, every other parameter column None."""
    row = {name: None for name in PARAM_COLUMNS}
    for name, value in asdict(params).items():
        if name not in PARAM_COLUMNS:
            raise ValueError(f"params field {name!r} has no heads.parquet column")
        row[name] = value
    return row
