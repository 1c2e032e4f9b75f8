"""TritonAttentionBackend against the float64 naive reference (tests/replica/attention/reference.py).

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/replica/conftest.py before anything imports triton: the mode is fixed when a kernel is
decorated). With CUDA the same cases run the compiled kernels on the GPU. Shapes are
small so that the interpreter, which runs every program of the grid one after the other in numpy,
keeps the module to a few seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replica.attention import TritonAttentionBackend, build_attention_metadata
from replica.attention.triton_backend import triton_available
from tests.replica.attention import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(), reason="needs the triton package")

# (query_len, seq_len) per request.
DECODES = [(1, 1), (1, 17), (1, 40), (1, 16), (1, 33)]
PREFILLS = [(9, 9), (20, 20)]
MIXED = [(1, 40), (7, 7), (5, 37), (1, 2), (12, 30)]  # decodes, a whole prompt, chunked prefills


def check(requests, atol=1e-4, **kwargs):
    return reference.check_against_reference(TritonAttentionBackend(), requests, atol=atol, device=DEVICE, **kwargs)


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("batch", [DECODES, PREFILLS, MIXED], ids=["decode", "prefill", "mixed"])
def test_float32_matches_the_float64_reference_at_any_block_size(batch, block_size):
    num_blocks = sum(-(-s // block_size) for _, s in batch) + 2
    check(batch, block_size=block_size, num_blocks=num_blocks, pad_to=sum(q for q, _ in batch) + 3)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)], ids=["mha", "gqa4"])
def test_head_dims_and_gqa_ratios_match_the_reference(head_dim, num_heads, num_kv_heads):
    check(MIXED, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=16,
          num_blocks=16, pad_to=32, seed=2)  # fmt: skip


def test_a_head_dim_that_is_not_a_power_of_two_is_masked_not_misread():
    check([(1, 21), (6, 10)], head_dim=80, block_size=4, num_blocks=16, seed=5)


def test_cache_holds_every_token_at_its_slot_and_padding_writes_nothing():
    out, md, cache, full_k, full_v, tables = check(MIXED, block_size=4, num_blocks=64, pad_to=40)
    expected = torch.full_like(cache, reference.SENTINEL)
    for table, k, v in zip(tables, full_k, full_v, strict=True):
        for pos in range(k.shape[0]):
            expected[0, table[pos // 4], pos % 4] = k[pos]
            expected[1, table[pos // 4], pos % 4] = v[pos]
    # The context was written with SENTINEL elsewhere by write_kv_cache; the rest only by the kernel.
    assert torch.equal(cache.cpu(), expected.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precisions_match_the_reference_loosely(dtype):
    check(MIXED, atol=3e-2, dtype=dtype, block_size=16, num_blocks=16, pad_to=32)


def test_a_request_padded_in_with_no_keys_gets_zeros_and_writes_nothing():
    """The CUDA-graph padding: a trailing request with seq_len 0 and slot -1 (built by hand; the
    metadata builder never makes one)."""
    md, _ = build_attention_metadata([1, 1], [3, 1], [[1], [2]], 4, device=DEVICE)
    seq_lens = md.seq_lens.clone()
    seq_lens[1] = 0
    slots = md.slot_mapping.clone()
    slots[1] = -1
    md = dataclasses.replace(md, seq_lens=seq_lens, slot_mapping=slots)
    cache = torch.zeros(2, 4, 4, 1, 16, device=DEVICE)
    q = torch.ones(2, 2, 16, device=DEVICE)
    k = torch.full((2, 1, 16), 2.0, device=DEVICE)
    v = torch.full((2, 1, 16), 3.0, device=DEVICE)
    out = TritonAttentionBackend().forward(q, k, v, cache, md, 0.25)
    # Request 0: keys 0, 1 are zeros, key 2 is this step's (v = 3): softmax over scores 0, 0, 8.
    w = torch.softmax(torch.tensor([0.0, 0.0, 8.0], dtype=torch.float64), 0)
    torch.testing.assert_close(out[0].cpu().double(), torch.full((2, 16), 3.0 * float(w[2]), dtype=torch.float64))
    assert torch.all(out[1] == 0)
    assert torch.count_nonzero(cache[:, 2]) == 0, "slot -1 must not be written"


def test_an_unsupported_cache_dtype_is_refused_before_anything_is_written():
    md, _ = build_attention_metadata([1], [1], [[1]], 4, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float64, device=DEVICE)
    x = torch.ones(1, 1, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float64"):
        TritonAttentionBackend().forward(x, x, x, cache, md, 1.0)
    assert torch.count_nonzero(cache) == 0
