"""The activation memory of the largest step, measured as vLLM does: one profiling forward pass
at ``max_num_batched_tokens`` tokens on the device, over a scratch KV cache (DESIGN.md §3.2)."""

from __future__ import annotations

import torch

from replica.attention import allocate_kv_caches, build_attention_metadata
from replica.model.llama import LlamaModel


@torch.inference_mode()
def profile_activation_bytes(
    model: LlamaModel, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype
) -> int:
    """Peak bytes a step of ``max_num_batched_tokens`` prompt tokens allocates on the model's CUDA
    device beyond the weights: the forward pass (as few prompts of at most the model's
    ``max_model_len`` as hold the tokens) and the float32 logits of ``min(max_num_seqs, tokens)``
    rows. The scratch cache the pass writes into is allocated first and not counted.

    Raises:
        ValueError: the model is not on a CUDA device, or ``max_num_batched_tokens`` < 1.
    """
    device = model.model.embed_tokens.weight.device
    if device.type != "cuda":
        raise ValueError(f"profiling measures CUDA memory; the model is on {device}")
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    cfg = model.config
    longest = max(1, cfg.max_model_len)
    lens = [longest] * (max_num_batched_tokens // longest)
    if max_num_batched_tokens % longest:
        lens.append(max_num_batched_tokens % longest)
    tables, next_block = [], 1
    for n in lens:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    caches = allocate_kv_caches(
        cfg.num_hidden_layers, next_block, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device
    )
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    metadata, positions = build_attention_metadata(lens, lens, tables, block_size, device=device)
    input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, caches, metadata)
    model.compute_logits(hidden[: min(max_num_seqs, max_num_batched_tokens)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches, hidden, metadata, positions, input_ids
    torch.cuda.empty_cache()
    return peak
