"""Paged attention: the per-step metadata, the KV cache layout, and the backends that use them.

Consumes: q/k/v of one layer for a flattened batch of tokens, that layer's cache
``(2, num_blocks, block_size, num_kv_heads, head_dim)``, and an ``AttentionMetadata`` built once
per step by ``build_attention_metadata`` (DESIGN.md §3.2).
Guarantees: every backend writes exactly the slots of ``slot_mapping`` that are not -1, and
returns causal attention of each request's query tokens (its last ``query_len`` positions) over
its first ``seq_len`` positions; padded rows come back as zeros. Backends subclass
``AttentionBackend``, whose ``forward`` writes the cache and then calls the backend's ``_attend``:
``torch`` (CPU and CUDA, the reference), ``flash_attn`` (CUDA, imported lazily) and ``triton``
(CUDA, any block size; triton imported lazily); ``choose_backend`` is the documented choice between
them and ``select_backend`` / ``resolve_backend`` build it.

Modules: ``metadata``, ``kv_cache`` (the layout), ``backend`` (the base class), ``selector`` (the choice),
``torch_backend`` (with the compiled CPU decode kernel ``_cpu_paged``), ``flash_attn_backend``,
``triton_backend`` over ``triton_kernels``.

Imports: torch and numpy (a flash-attention build and triton lazily); nothing else of kvroute or
the replica.
"""

from replica.attention.backend import AttentionBackend
from replica.attention.flash_attn_backend import FlashAttnBackend, flash_attn_available
from replica.attention.kv_cache import (
    allocate_kv_caches,
    kv_cache_block_bytes,
    kv_cache_shape,
    write_kv_cache,
)
from replica.attention.metadata import AttentionMetadata, build_attention_metadata
from replica.attention.selector import BACKEND_NAMES, select_backend
from replica.attention.torch_backend import TorchAttentionBackend
from replica.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "FlashAttnBackend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "allocate_kv_caches",
    "build_attention_metadata",
    "flash_attn_available",
    "kv_cache_block_bytes",
    "kv_cache_shape",
    "select_backend",
    "write_kv_cache",
]
