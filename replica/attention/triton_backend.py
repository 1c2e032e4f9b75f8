"""Paged attention with Triton kernels (``replica.attention.triton_kernels``): any block size, GQA,
prefill, chunked prefill and decode in one launch per layer, K/V read in place.

CUDA in float16 / bfloat16 / float32. On a machine without a GPU, Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before ``triton`` is first imported) runs the same
kernels on CPU tensors; that is how the tests check them. ``triton`` is imported when the backend
is constructed, never at module import.
"""

from __future__ import annotations

import importlib.util

import torch

from replica.attention.backend import AttentionBackend
from replica.attention.metadata import AttentionMetadata

_WRITE_TOKENS = 16  # tokens per program of the cache write
# float32 matmuls in full precision (not TF32: the tests hold them to 1e-4); the half types take
# Triton's default.
_DOT_PRECISION = {torch.float32: "ieee", torch.float16: None, torch.bfloat16: None}


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (CUDA builds of torch ship it)."""
    return importlib.util.find_spec("triton") is not None


def _block_m(max_query_len: int, group: int) -> int:
    """Query rows per program: a decode needs ``group`` rows (tl.dot wants at least 16); prefill
    chunks take 64-row tiles."""
    rows = max_query_len * group
    return max(16, min(64, 1 << (rows - 1).bit_length()))


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through ``paged_attention_kernel`` (see ``triton_kernels``' docstring).

    Writes the cache with its own kernel, which skips slots of -1 on the device, so that neither
    the write nor the attention reads a host value per step: a decode step runs under a CUDA graph
    (``cuda_graph_safe``). Padded rows come back as zeros.

    Raises:
        ImportError: at construction, when ``triton`` is not installed.
        ValueError: at ``forward``, for a dtype other than float16 / bfloat16 / float32.
    """

    name = "triton"
    cuda_graph_safe = True

    def __init__(self, block_n: int = 32) -> None:
        """``block_n``: K/V positions per inner-loop tile (a power of two, at least 16)."""
        if not triton_available():
            raise ImportError("attention backend 'triton' needs the triton package (shipped with CUDA builds of torch)")
        from replica.attention import triton_kernels

        self._kernels = triton_kernels
        self._triton = importlib.import_module("triton")
        interpreter = importlib.import_module("triton.runtime.interpreter")
        self._interpreted = isinstance(triton_kernels.paged_attention_kernel, interpreter.InterpretedFunction)
        self.block_n = block_n

    def _check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dtype not in _DOT_PRECISION:
            raise ValueError(f"attention backend 'triton': KV cache dtype {kv_cache.dtype} is not float16, bfloat16 or float32")

    def _write_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Every row of ``key`` / ``value`` [T, Hkv, D] whose slot is not -1, in one launch."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_tokens = key.shape[0]
        self._kernels.write_kv_cache_kernel[(-(-num_tokens // _WRITE_TOKENS), num_kv_heads)](
            key, value, k_cache, v_cache, metadata.slot_mapping, num_tokens,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=self._triton.next_power_of_2(head_dim),
            BLOCK_T=_WRITE_TOKENS,
        )  # fmt: skip

    def _attend(
        self, query: torch.Tensor, step_kv: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] in query's dtype: one launch over every request."""
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = query.shape[1]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        group = num_heads // num_kv_heads
        query = _last_dim_contiguous(query)
        padded = metadata.num_actual_tokens < metadata.num_tokens
        out = torch.zeros_like(query) if padded else torch.empty_like(query)
        block_m = _block_m(metadata.max_query_len, group)
        grid = (metadata.num_reqs, num_kv_heads, -(-metadata.max_query_len * group // block_m))
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._kernels.paged_attention_kernel[grid](
            out, query, k_cache, v_cache,
            metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            scale * self._kernels.LOG2E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_table.stride(0),
            GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            BLOCK_D=max(16, self._triton.next_power_of_2(head_dim)),
            BLOCK_M=block_m, BLOCK_N=self.block_n, DOT_PRECISION=_DOT_PRECISION[query.dtype],
            DOT_FP32=self._interpreted and query.dtype == torch.bfloat16,
        )  # fmt: skip
        return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take any token/head strides but a unit stride along head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()
