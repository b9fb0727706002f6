"""FlashPrefill V2's SGLang backend: the dense-prefix flag line.

FlashPrefill's fork takes global flags only (docs/peers.md, "Where a searched artifact can be deployed");
the one an artifact can answer is ``--flashprefill-full-attention-layers N``: the first N layers run dense
attention, the rest FlashPrefill's own online block-sparse selection. TriangleMix probing (``probe-layers``)
answers the same question, at which layer sparse attention may start, and records it as
``methods.trianglemix.start_layer``; layers below it are the ones to keep exact. So N = start_layer.

What does not carry over: the per-head patterns below the start layer (FlashPrefill runs those layers dense,
which costs more but loses nothing) and TriangleMix's triangle shape above it (FlashPrefill selects its own
blocks there). The file holds the one flag line, to paste into the server's command line.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..artifacts.io import Artifact
from ._common import write_file_atomic

FORMAT = "flashprefill"
FLAG = "--flashprefill-full-attention-layers"
LINE = re.compile(rf"^{re.escape(FLAG)}(?:=| +)(\d+)$")


def start_layer(artifact: Artifact) -> int:
    """The probed TriangleMix start layer, or ValueError (one line) when the artifact has none."""
    tri = artifact.manifest["methods"].get("trianglemix") or {}
    start = tri.get("start_layer")
    if start is None:
        raise ValueError(f"{FORMAT}: the artifact has no probed start layer (methods.trianglemix.start_layer); "
                         f"run sparsesearch probe-layers on it first")
    return start


def flag_line(artifact: Artifact) -> str:
    """``--flashprefill-full-attention-layers N`` for the artifact's start layer."""
    return f"{FLAG} {start_layer(artifact)}"


def write_flashprefill(artifact: Artifact, out) -> Path:
    """Write the flag line (and a newline) at ``out`` whole or not at all."""
    return write_file_atomic(out, (flag_line(artifact) + "\n").encode())


def parse_flag_line(text: str, where: str) -> int:
    """N of a flag file's one line (``FLAG N`` or ``FLAG=N``); ValueError naming ``where`` otherwise."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise ValueError(f"{where}: expected one line '{FLAG} N', got {len(lines)} non-empty lines")
    match = LINE.match(lines[0])
    if match is None:
        raise ValueError(f"{where}: expected '{FLAG} N', got {lines[0][:80]!r}")
    return int(match.group(1))
