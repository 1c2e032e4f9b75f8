"""Engine settings and KV cache sizing (DESIGN.md §3.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroute.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_SEED


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model folder.

    KV sizing: ``num_blocks`` when set; otherwise on CUDA ``gpu_memory_utilization`` of the
    device's memory less what others hold, the weights and the activations measured by a profiling
    pass at ``max_num_batched_tokens``; on CPU ``kv_cache_memory_bytes``. See
    :func:`compute_num_blocks`. ``enforce_eager``: never run decode steps as CUDA graphs (vLLM's
    name); graphs are used on CUDA when the attention backend is graph-safe.
    """

    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    dtype: str = "auto"  # "float32", "float16", "bfloat16" or "auto" (float32 on CPU, bf16 on CUDA)
    attn_backend: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 2**20
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    free_order: str = "lru"
    hash_algorithm: str = "sha256_cbor"
    hash_seed: str = DEFAULT_SEED
    cpu_offload_blocks: int = 0
    seed: int | None = 0  # the sampler's shared generator; per-request seeds override it
    torch_threads: int | None = None
    enforce_eager: bool = False

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype]
        except KeyError:
            raise ValueError(f"dtype: expected float32, float16, bfloat16 or auto, got {self.dtype!r}") from None


def compute_num_blocks(
    config: EngineConfig, device: torch.device, block_bytes: int, weight_bytes: int, activation_bytes: int = 0
) -> int:
    """Number of KV blocks (including the null block 0) that fit the memory budget.

    ``num_blocks = (device_memory * gpu_memory_utilization - used_by_others - weights -
    activations) // block_bytes`` on CUDA (device_memory = total memory; ``used_by_others`` = what
    the device has in use that this process's torch allocator did not allocate: other processes,
    the CUDA context; ``activation_bytes`` from ``replica.engine.profiling``), and
    ``kv_cache_memory_bytes // block_bytes`` on CPU, where ``block_bytes = 2 * B * num_kv_heads *
    head_dim * dtype_size * num_layers`` (DESIGN.md §3.2).

    Raises:
        ValueError: the budget leaves fewer than 2 blocks.
    """
    if config.num_blocks is not None:
        n = config.num_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - torch.cuda.memory_allocated(device)
        budget = total * config.gpu_memory_utilization - used_by_others - weight_bytes - activation_bytes
        n = int(budget // block_bytes)
    else:
        n = int(config.kv_cache_memory_bytes // block_bytes)
    if n < 2:
        raise ValueError(f"num_blocks: the KV budget leaves {n} blocks of {block_bytes} bytes; need at least 2")
    return n
