"""The interface every attention backend implements, and the choice between them."""

from __future__ import annotations

from typing import Protocol

import torch

from replica.attention.metadata import AttentionMetadata

BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "flash_attn")


class AttentionBackend(Protocol):
    """Paged attention for one layer of one step.

    ``forward`` writes the step's keys/values into ``kv_cache`` at ``metadata.slot_mapping`` and
    returns causal attention of each request's query tokens over its first ``seq_len`` positions.
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache (2, num_blocks, B, Hkv, D) ->
        [T, H, D] in query's dtype; rows past ``num_actual_tokens`` are zeros."""
        ...


def select_backend(
    device: torch.device | str,
    name: str = "auto",
    *,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """Pick an attention backend.

    ``auto``: ``flash_attn`` on CUDA when a flash-attention build is importable and accepts the
    ``block_size`` and ``dtype`` (when given), else ``torch``. ``torch`` / ``flash_attn`` force one.

    Raises:
        ValueError: an unknown name, or ``flash_attn`` asked for on a non-CUDA device.
        ImportError: ``flash_attn`` asked for and not importable.
    """
    from replica.attention.flash_attn_backend import FlashAttnBackend, flash_attn_available
    from replica.attention.torch_backend import TorchAttentionBackend

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn":
        if device.type != "cuda":
            raise ValueError(f"attention backend 'flash_attn' needs a CUDA device, got {device}")
        return FlashAttnBackend()
    if device.type == "cuda" and flash_attn_available():
        backend = FlashAttnBackend()
        if (block_size is None or backend.supports_block_size(block_size)) and (
            dtype is None or dtype in (torch.float16, torch.bfloat16)
        ):
            return backend
    return TorchAttentionBackend()
