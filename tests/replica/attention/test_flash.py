"""FlashAttnBackend against TorchAttentionBackend on the same metadata and cache (CUDA only)."""

from __future__ import annotations

import random

import pytest
import torch

from replica.attention import (
    FlashAttnBackend,
    TorchAttentionBackend,
    allocate_kv_caches,
    build_attention_metadata,
    flash_attn_available,
    select_backend,
)
from replica.attention.triton_backend import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not flash_attn_available(), reason="needs a flash-attention build"),
]


def _block_size(backend: FlashAttnBackend) -> int:
    # vLLM's flash-attn fork pages at 16 tokens; upstream flash_attn's paged path needs 256.
    return 16 if backend.supports_block_size(16) else 256


def _compare(requests: list[tuple[int, int]], dtype: torch.dtype, pad_to: int | None, seed: int = 0) -> None:
    flash = FlashAttnBackend()
    block_size = _block_size(flash)
    num_heads, num_kv_heads, head_dim = 8, 2, 128
    num_blocks = sum(-(-s // block_size) for _, s in requests) + 8
    gen = torch.Generator(device="cuda").manual_seed(seed)
    (cache_t,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cuda")
    cache_t.normal_(generator=gen)  # context K/V already in the cache
    cache_f = cache_t.clone()
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for _, s in requests]
    md, _ = build_attention_metadata(
        [q for q, _ in requests], [s for _, s in requests], tables, block_size, pad_to=pad_to, device="cuda"
    )
    shape_q = (md.num_tokens, num_heads, head_dim)
    shape_kv = (md.num_tokens, num_kv_heads, head_dim)
    q = torch.randn(shape_q, generator=gen, device="cuda").to(dtype)
    k = torch.randn(shape_kv, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape_kv, generator=gen, device="cuda").to(dtype)
    scale = head_dim**-0.5

    expected = TorchAttentionBackend().forward(q, k, v, cache_t, md, scale)
    got = flash.forward(q, k, v, cache_f, md, scale)

    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.all(got[md.num_actual_tokens :] == 0)
    assert torch.equal(cache_f, cache_t), "both backends must write the same slots"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_matches_torch_on_a_decode_batch(dtype):
    _compare([(1, 1), (1, 17), (1, 300), (1, 513), (1, 64)], dtype, pad_to=8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_matches_torch_on_mixed_prefill_and_decode(dtype):
    _compare([(1, 40), (37, 37), (5, 997), (1, 2), (128, 300)], dtype, pad_to=256, seed=1)


def test_auto_selects_flash_on_cuda_for_half_precision():
    backend = select_backend("cuda", dtype=torch.bfloat16, block_size=_block_size(FlashAttnBackend()))
    assert backend.name == "flash_attn"
    assert select_backend("cuda", dtype=torch.float32).name == ("triton" if triton_available() else "torch")
