"""Paged attention with FlashAttention's varlen kernel reading the KV cache through the block table.

Two builds are understood, imported lazily (never at module import, so CPU-only installs work):

- ``vllm_flash_attn`` (vLLM's fork): ``flash_attn_varlen_func(..., seqused_k=seq_lens,
  block_table=...)``; block_size a multiple of 16.
- ``flash_attn`` (upstream 2.x): same call with ``cu_seqlens_k`` (prefix sums of seq_lens) in place
  of ``seqused_k``; its paged path needs block_size a multiple of 256.

Both take the cache as K [num_blocks, B, Hkv, D] and V alike — our layout's ``kv_cache[0]`` /
``kv_cache[1]`` — and align the causal mask bottom-right, as our metadata means it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from replica.attention.backend import AttentionBackend, FlashBuild
from replica.attention.metadata import AttentionMetadata

# (module, flavour, block size multiple), in order of preference.
_CANDIDATES: tuple[tuple[str, str, int], ...] = (
    ("vllm_flash_attn", "seqused_k", 16),
    ("vllm.vllm_flash_attn", "seqused_k", 16),
    ("flash_attn", "cu_seqlens_k", 256),
)


def _import_build(module_name: str) -> Callable[..., Any] | None:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # ImportError, or a build whose CUDA libraries don't load
        return None
    return getattr(module, "flash_attn_varlen_func", None)


def flash_attn_builds() -> tuple[FlashBuild, ...]:
    """The flash-attention builds with ``flash_attn_varlen_func`` that import, in order of
    preference (vLLM's fork first), each with the block size multiple its paged path needs."""
    return tuple(FlashBuild(m, multiple) for m, _, multiple in _CANDIDATES if _import_build(m) is not None)


def flash_attn_available() -> bool:
    """True when CUDA is usable and a flash-attention build with ``flash_attn_varlen_func`` imports."""
    return torch.cuda.is_available() and bool(flash_attn_builds())


class FlashAttnBackend(AttentionBackend):
    """Paged attention through ``flash_attn_varlen_func`` with ``block_table``.

    CUDA only, fp16/bf16 only (the kernel's constraint). ``module``: the build to use (one of
    ``flash_attn_builds()``' modules); None = the first importable one.

    Raises:
        ImportError: at construction, when no build (or not ``module``) is importable.
        ValueError: at ``forward``, for a block size the build cannot page.
    """

    name = "flash_attn"

    def __init__(self, module: str | None = None) -> None:
        for module_name, flavour, multiple in _CANDIDATES:
            if module is not None and module_name != module:
                continue
            varlen = _import_build(module_name)
            if varlen is not None:
                self._varlen, self._flavour, self._block_multiple = varlen, flavour, multiple
                self.module = module_name
                return
        tried = module or ", ".join(m for m, _, _ in _CANDIDATES)
        raise ImportError(
            f"no flash-attention build is importable (tried {tried}); install the 'gpu' extra or use the "
            "'triton' or 'torch' attention backend"
        )

    def supports_block_size(self, block_size: int) -> bool:
        """Whether the installed kernel accepts a paged cache with this block size."""
        return block_size % self._block_multiple == 0

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        block_size = kv_cache.shape[2]
        if not self.supports_block_size(block_size):
            raise ValueError(
                f"this flash-attention build needs block_size to be a multiple of {self._block_multiple}, "
                f"got {block_size}; use the 'triton' attention backend"
            )

    def _attend(
        self, query: torch.Tensor, step_kv: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """On CUDA in fp16/bf16: the varlen kernel reads the cache through the block table."""
        n = metadata.num_actual_tokens
        common = dict(
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=metadata.block_table,
        )
        if self._flavour == "seqused_k":
            o = self._varlen(
                q=query[:n],
                k=kv_cache[0],
                v=kv_cache[1],
                cu_seqlens_q=metadata.query_start_loc,
                seqused_k=metadata.seq_lens,
                **common,
            )
        else:
            cu_seqlens_k = torch.zeros(metadata.num_reqs + 1, dtype=torch.int32, device=query.device)
            cu_seqlens_k[1:] = torch.cumsum(metadata.seq_lens, dim=0, dtype=torch.int32)
            o = self._varlen(
                query[:n],
                kv_cache[0],
                kv_cache[1],
                cu_seqlens_q=metadata.query_start_loc,
                cu_seqlens_k=cu_seqlens_k,
                **common,
            )
        if n == query.shape[0]:
            return o
        out = torch.zeros_like(query)
        out[:n] = o
        return out
