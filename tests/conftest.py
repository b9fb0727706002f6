"""Test set-up: Triton kernels run under the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it then), which is
why it is set here and not inside a fixture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
