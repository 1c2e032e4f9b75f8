"""Every attention backend on the GPU against the float64 reference: decode, prefill and mixed
batches at block sizes 16 and 256 (skipped without CUDA; bench/gpu_check.py runs these)."""

from __future__ import annotations

import pytest
import torch

from replica.attention import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from replica.attention.flash_attn_backend import flash_attn_builds
from tests.replica.attention import reference
from tests.replica.attention.test_triton_backend import DECODES, MIXED, PREFILLS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _backend(name: str, block_size: int):
    if name == "torch":
        return TorchAttentionBackend(), torch.float32, 1e-4
    if name == "triton":
        return TritonAttentionBackend(), torch.float32, 1e-4
    build = next((b for b in flash_attn_builds() if block_size % b.block_multiple == 0), None)
    if build is None:
        pytest.skip(f"no flash-attention build pages block_size {block_size}")
    return FlashAttnBackend(build.module), torch.bfloat16, 3e-2


@pytest.mark.parametrize("name", ["torch", "triton", "flash_attn"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch", [DECODES, PREFILLS, MIXED], ids=["decode", "prefill", "mixed"])
def test_backend_matches_the_reference_on_the_gpu(name, block_size, batch):
    backend, dtype, atol = _backend(name, block_size)
    num_blocks = sum(-(-s // block_size) for _, s in batch) + 2
    reference.check_against_reference(
        backend, batch, atol=atol, dtype=dtype, device="cuda", block_size=block_size, num_blocks=num_blocks,
        num_heads=32, num_kv_heads=8, head_dim=128, pad_to=sum(q for q, _ in batch) + 5,
    )  # fmt: skip
