"""Without CUDA, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET=1`` is set here,
before any replica test module can import triton (the mode is fixed when a kernel is decorated)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
