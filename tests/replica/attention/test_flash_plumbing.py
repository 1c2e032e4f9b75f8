"""FlashAttnBackend's argument plumbing, on CPU, against stand-in flash-attention modules.

The stand-ins implement ``flash_attn_varlen_func``'s documented contract (paged K/V through
``block_table``, key lengths from ``seqused_k`` or ``cu_seqlens_k``, bottom-right causal mask) with
plain torch, so a wrong keyword, a wrong ``cu_seqlens_k`` or a padding slip shows up without a GPU.
The real kernels are compared in test_flash.py (CUDA).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from replica.attention import (
    FlashAttnBackend,
    TorchAttentionBackend,
    allocate_kv_caches,
    build_attention_metadata,
)
from tests.support import one_torch_thread  # noqa: F401  (an autouse fixture)


def _reference_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table,
                      seqused_k=None, cu_seqlens_k=None):  # fmt: skip
    assert causal is True
    assert q.dtype == k.dtype
    assert cu_seqlens_q.dtype == torch.int32 and block_table.dtype == torch.int32
    if seqused_k is not None:
        k_lens = seqused_k.tolist()
    else:
        assert cu_seqlens_k.dtype == torch.int32
        k_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    starts = cu_seqlens_q.tolist()
    assert starts[-1] == q.shape[0], "q must be cut to the actual tokens"
    assert max(k_lens) == max_seqlen_k
    assert max(b - a for a, b in zip(starts, starts[1:], strict=False)) == max_seqlen_q
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[2]
    for i, k_len in enumerate(k_lens):
        qi = q[starts[i] : starts[i + 1]]
        keys = k[block_table[i].long()].flatten(0, 1)[:k_len].repeat_interleave(group, dim=1)
        values = v[block_table[i].long()].flatten(0, 1)[:k_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * softmax_scale
        q_pos = torch.arange(k_len - qi.shape[0], k_len)[:, None]
        scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def _fake_module(name: str, seqused: bool) -> types.ModuleType:
    module = types.ModuleType(name)
    if seqused:

        def flash_attn_varlen_func(*, q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                                   causal, block_table):  # fmt: skip
            return _reference_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                     block_table, seqused_k=seqused_k)  # fmt: skip
    else:

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, block_table=None):  # fmt: skip
            return _reference_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                     block_table, cu_seqlens_k=cu_seqlens_k)  # fmt: skip

    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


@pytest.fixture(params=["vllm_flash_attn", "flash_attn"])
def fake_flash(request, monkeypatch):
    if request.param == "vllm_flash_attn":
        monkeypatch.setitem(sys.modules, "vllm_flash_attn", _fake_module("vllm_flash_attn", seqused=True))
        return 16
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_module("flash_attn", seqused=False))
    return 256


def test_flash_backend_passes_the_metadata_the_kernel_expects(fake_flash):
    block_size = fake_flash
    backend = FlashAttnBackend()
    assert backend.supports_block_size(block_size) and not backend.supports_block_size(block_size // 2)
    requests = [(1, 300), (37, 37), (5, 600), (1, 1)]  # (query_len, seq_len)
    num_blocks = sum(-(-s // block_size) for _, s in requests) + 2
    gen = torch.Generator().manual_seed(0)
    (cache_t,) = allocate_kv_caches(1, num_blocks, block_size, 2, 16, torch.float32, "cpu")
    cache_t.normal_(generator=gen)
    cache_f = cache_t.clone()
    free = list(range(num_blocks - 1, 0, -1))
    tables = [[free.pop() for _ in range(-(-s // block_size))] for _, s in requests]
    md, _ = build_attention_metadata([q for q, _ in requests], [s for _, s in requests], tables, block_size, pad_to=64)
    q = torch.randn(md.num_tokens, 4, 16, generator=gen)
    k = torch.randn(md.num_tokens, 2, 16, generator=gen)
    v = torch.randn(md.num_tokens, 2, 16, generator=gen)

    got = backend.forward(q, k, v, cache_f, md, 0.25)
    expected = TorchAttentionBackend().forward(q, k, v, cache_t, md, 0.25)

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[md.num_actual_tokens :] == 0)
    assert torch.equal(cache_f, cache_t)


def test_flash_backend_rejects_a_block_size_its_kernel_cannot_page(fake_flash):
    block_size = fake_flash
    md, _ = build_attention_metadata([1], [1], [[1]], block_size // 2)
    cache = torch.zeros(2, 2, block_size // 2, 1, 8)
    with pytest.raises(ValueError, match=f"multiple of {block_size}"):
        FlashAttnBackend().forward(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, md, 1.0)


def test_missing_flash_attn_is_an_import_error_naming_the_fallback(monkeypatch):
    for name in ("vllm_flash_attn", "vllm", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="'torch' attention backend"):
        FlashAttnBackend()
