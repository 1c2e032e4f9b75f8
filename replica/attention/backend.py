"""The interface every attention backend implements (the choice between them: ``selector``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from replica.attention.kv_cache import write_kv_cache
from replica.attention.metadata import AttentionMetadata


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


__all__ = ["AttentionBackend", "FlashBuild"]
