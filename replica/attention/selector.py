"""The choice between the attention backends (``choose_backend``, a pure table) and building the
chosen one (``select_backend`` / ``resolve_backend``, which probe what is installed).

Imports: the backend modules of this package (which import only ``backend``, the interface).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from replica.attention.backend import AttentionBackend, FlashBuild
from replica.attention.flash_attn_backend import FlashAttnBackend, flash_attn_builds
from replica.attention.torch_backend import TorchAttentionBackend
from replica.attention.triton_backend import TritonAttentionBackend, triton_available

BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "flash_attn", "triton")
HALF_DTYPES = (torch.float16, torch.bfloat16)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendChoice:
    """Which backend runs and why (the startup log and the heartbeat carry both).

    ``flash_build``: the flash-attention module to use when ``name`` is ``flash_attn``.
    """

    name: str
    reason: str
    flash_build: str | None = None


def choose_backend(
    requested: str,
    *,
    device_type: str,
    block_size: int | None,
    dtype: torch.dtype | None,
    flash_builds: Sequence[FlashBuild],
    triton_importable: bool,
) -> BackendChoice:
    """The backend choice as a function of what is asked for and what is installed (no imports).

    ``auto``:

    ========  ====================================================================  ============
    device    condition (first that holds)                                          backend
    ========  ====================================================================  ============
    not CUDA  always                                                                ``torch``
    CUDA      dtype fp16/bf16 (or unknown) and a flash build pages ``block_size``   ``flash_attn``
    CUDA      ``triton`` importable                                                 ``triton``
    CUDA      otherwise                                                             ``torch``
    ========  ====================================================================  ============

    A build pages ``block_size`` when it is a multiple of the build's ``block_multiple`` (vLLM's
    fork: 16, upstream flash-attn: 256); the first such build in ``flash_builds`` (preference
    order) is used. ``torch`` / ``flash_attn`` / ``triton`` are taken as asked or refused.

    Raises:
        ValueError: an unknown name; ``flash_attn`` or ``triton`` asked for on a device that is not
            CUDA; ``flash_attn`` asked for with a ``block_size`` no importable build pages (the
            message names the block size and the builds' multiples) or a dtype other than fp16/bf16.
        ImportError: ``flash_attn`` asked for and no build is importable, or ``triton`` and triton
            is not installed.
    """
    if requested not in BACKEND_NAMES:
        raise ValueError(f"attn_backend: unknown attention backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if requested == "torch":
        return BackendChoice("torch", "asked for (attn_backend=torch)")
    if requested in ("flash_attn", "triton") and device_type != "cuda":
        raise ValueError(f"attn_backend: attention backend {requested!r} needs a CUDA device, got {device_type}")
    paging = [b for b in flash_builds if block_size is None or block_size % b.block_multiple == 0]
    if requested == "flash_attn":
        if not flash_builds:
            raise ImportError(
                "attn_backend: 'flash_attn' asked for but no flash-attention build is importable; install the "
                "'gpu' extra or use attn_backend=triton"
            )
        if not paging:
            raise ValueError(
                f"attn_backend: 'flash_attn' cannot page block_size {block_size}: "
                + _builds_text(flash_builds)
                + "; use attn_backend=triton, or a block_size the build pages"
            )
        if dtype is not None and dtype not in HALF_DTYPES:
            raise ValueError(f"attn_backend: 'flash_attn' needs dtype float16 or bfloat16, got {_dtype_name(dtype)}")
        return BackendChoice("flash_attn", f"asked for; {_builds_text(paging[:1])}", paging[0].module)
    if requested == "triton":
        if not triton_importable:
            raise ImportError("attn_backend: 'triton' asked for but the triton package is not installed")
        return BackendChoice("triton", "asked for (attn_backend=triton)")
    if device_type != "cuda":
        return BackendChoice("torch", f"device {device_type}: the CUDA kernels do not run here")
    if paging and (dtype is None or dtype in HALF_DTYPES):
        return BackendChoice("flash_attn", f"{_builds_text(paging[:1])}, block_size {block_size}", paging[0].module)
    if not flash_builds:
        why = "no flash-attention build is importable"
    elif not paging:
        why = f"no flash-attention build pages block_size {block_size} ({_builds_text(flash_builds)})"
    else:
        why = f"dtype {_dtype_name(dtype)}: flash-attention takes float16/bfloat16 only"
    if triton_importable:
        return BackendChoice("triton", why)
    return BackendChoice("torch", why + " and triton is not installed (gather + SDPA)")


def select_backend(
    device: torch.device | str,
    name: str = "auto",
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Build the backend :func:`resolve_backend` chooses (its errors)."""
    return resolve_backend(device, name, block_size=block_size, dtype=dtype)[1]


def resolve_backend(
    device: torch.device | str,
    name: str = "auto",
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[BackendChoice, AttentionBackend]:
    """Probe what is installed (flash-attention builds only on CUDA), :func:`choose_backend`, log
    the choice and its reason, and build the backend.

    Raises:
        ValueError / ImportError: as :func:`choose_backend`.
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    choice = choose_backend(
        name, device_type=device.type, block_size=block_size, dtype=dtype,
        flash_builds=flash_attn_builds() if on_cuda and name in ("auto", "flash_attn") else (),
        triton_importable=on_cuda and triton_available(),
    )  # fmt: skip
    # The gather path on a GPU is a slow fallback: said as a warning.
    level = logging.WARNING if on_cuda and choice.name == "torch" else logging.INFO
    log.log(level, "attention backend %s: %s", choice.name, choice.reason)
    if choice.name == "flash_attn":
        return choice, FlashAttnBackend(choice.flash_build)
    if choice.name == "triton":
        return choice, TritonAttentionBackend()
    return choice, TorchAttentionBackend()


def _builds_text(builds: Sequence[FlashBuild]) -> str:
    return ", ".join(f"{b.module} pages multiples of {b.block_multiple}" for b in builds)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["BACKEND_NAMES", "BackendChoice", "choose_backend", "resolve_backend", "select_backend"]
