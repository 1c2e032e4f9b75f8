"""The paged KV cache layout shared by every backend: per layer one tensor
``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (index 0 = keys, 1 = values), addressed by
slot ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's cache: ``(2, num_blocks, block_size, num_kv_heads, head_dim)``."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_block_bytes(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_layers: int
) -> int:
    """Bytes one block costs across all layers, K and V: ``2 * B * num_kv_heads * head_dim *
    dtype_size * num_layers`` (the denominator of DESIGN.md §3.2's ``num_blocks`` sizing)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * itemsize * num_layers


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zero-filled cache tensor per layer, shape ``kv_cache_shape(...)``.

    Zero-filled rather than ``empty``: kernels that read whole blocks and mask the unused tail
    can't mask a NaN that uninitialised memory may hold (NaN * 0 = NaN).
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    all_valid: bool = False,
) -> None:
    """Store ``key`` / ``value`` [T, num_kv_heads, head_dim] at ``slot_mapping`` [T] (int64) of
    ``kv_cache`` (layout above), in place. Slots of -1 (padding) are skipped.

    Backends slice off the batch's padded tail first (``[:num_actual_tokens]``, free), so the
    common case is one ``index_copy_`` per K and V. Checking for an interior -1 reads one bool back
    from the device (a host sync on CUDA); ``all_valid=True`` skips it for callers that know there
    is none (``build_attention_metadata`` only pads the tail, so its ``slot_mapping[:num_actual_tokens]``
    never holds -1); a fused cache-write kernel would remove it when CUDA graphs need that.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping
    if not all_valid:
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
    flat[0].index_copy_(0, slots, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, value.to(kv_cache.dtype))
