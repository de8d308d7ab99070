"""Run Triton kernels in interpreter mode on machines without a GPU (CI): every kernel is checked there."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit definition is executed, i.e. before our triton modules import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
