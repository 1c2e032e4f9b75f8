"""The interface every attention backend implements, and the choice between them."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from replica.attention.kv_cache import write_kv_cache
from replica.attention.metadata import AttentionMetadata

BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "flash_attn", "triton")
HALF_DTYPES = (torch.float16, torch.bfloat16)

log = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Paged attention for one layer of one step.

    ``forward`` writes the step's keys/values into ``kv_cache`` at ``metadata.slot_mapping`` and
    returns causal attention of each request's query tokens over its first ``seq_len`` positions.
    A backend implements ``_attend`` (the attention over the cache just written) and, when its
    kernel constrains the cache, ``_check_cache``; one with its own cache-write kernel overrides
    ``_write_cache``.

    ``cuda_graph_safe``: whether ``forward`` reads no host value that changes from step to step
    (and syncs nothing), so that a decode step can be captured in a CUDA graph and replayed with
    new contents in the same metadata tensors (``replica.engine.cuda_graphs``).
    """

    name: str
    cuda_graph_safe: bool = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] (T may include padding), kv_cache
        (2, num_blocks, B, Hkv, D) -> [T, H, D] in query's dtype; rows past ``num_actual_tokens``
        are zeros.

        Writes the actual tokens' key/value into ``kv_cache`` first (padding is never written).

        Raises:
            ValueError: the backend's kernel cannot read this cache (``_check_cache``).
        """
        self._check_cache(kv_cache)
        self._write_cache(key, value, kv_cache, metadata)
        return self._attend(query, (key, value), kv_cache, metadata, scale)

    def _write_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Store the actual tokens' key/value at their slots (the padded tail is never written)."""
        n = metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, metadata.slot_mapping[:n], all_valid=True)

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ``ValueError`` before anything is written when the kernel cannot read ``kv_cache``
        (the default: any cache will do)."""
        return None

    @abstractmethod
    def _attend(
        self, query: torch.Tensor, step_kv: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Attention of ``query`` over ``kv_cache``, which already holds this step's K/V; ``step_kv``
        is that (key, value) pair as given to ``forward``, for backends that can read it directly."""


@dataclass(frozen=True)
class FlashBuild:
    """An importable flash-attention build: its module and the block sizes its paged path takes
    (multiples of ``block_multiple``)."""

    module: str
    block_multiple: int


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
    from replica.attention.flash_attn_backend import FlashAttnBackend, flash_attn_builds
    from replica.attention.torch_backend import TorchAttentionBackend
    from replica.attention.triton_backend import TritonAttentionBackend, triton_available

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
