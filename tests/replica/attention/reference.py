"""The float64 reference the attention backends are checked against, and the case builder they share.

``run_case`` fills a paged cache with each request's context K/V through shuffled block tables
(blocks 0 and the last one never handed out, every other cell holding ``SENTINEL``), pads the batch
with rows that must not matter, and runs a backend; ``check_against_reference`` compares its output
with ``naive_attention`` (full causal attention on contiguous K/V, float64 loops).
"""

from __future__ import annotations

import math

import torch

from replica.attention import AttentionBackend, allocate_kv_caches, build_attention_metadata, write_kv_cache

SENTINEL = 7.0


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """q [L, H, D] at positions first_pos.., k/v [S, Hkv, D] contiguous; float64 loops."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        pos = first_pos + j
        for h in range(num_heads):
            keys = k[: pos + 1, h // group].double()
            scores = keys @ q[j, h].double() * scale
            weights = torch.softmax(scores, dim=0)
            out[j, h] = weights @ v[: pos + 1, h // group].double()
    return out


def run_case(
    backend: AttentionBackend,
    requests: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 4,
    num_blocks: int = 64,
    pad_to: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
):
    """requests: (query_len, seq_len) each. Context K/V is pre-written through the block table;
    the backend writes the query tokens' K/V itself, on ``device`` (the random data is drawn on
    the CPU, so every device sees the same case). Returns everything needed to check (``full_k`` /
    ``full_v`` / ``queries`` on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / math.sqrt(head_dim)
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    cache.fill_(SENTINEL)
    # Non-contiguous, shuffled block ids; block 0 (null) and the last block are never handed out.
    free = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
    tables, full_k, full_v, queries, new_k, new_v = [], [], [], [], [], []
    for query_len, seq_len in requests:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        full_k.append(k)
        full_v.append(v)
        ctx = seq_len - query_len
        if ctx:
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
            write_kv_cache(k[:ctx].to(device), v[:ctx].to(device), cache, slots.to(device))
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    md, _ = build_attention_metadata(
        [q for q, _ in requests], [s for _, s in requests], tables, block_size, pad_to, device=device
    )
    num_pad = md.num_tokens - md.num_actual_tokens
    q = torch.cat([*queries, torch.full((num_pad, num_heads, head_dim), 3.0, dtype=dtype)])
    k = torch.cat([*new_k, torch.full((num_pad, num_kv_heads, head_dim), -5.0, dtype=dtype)])
    v = torch.cat([*new_v, torch.full((num_pad, num_kv_heads, head_dim), -5.0, dtype=dtype)])
    out = backend.forward(q.to(device), k.to(device), v.to(device), cache, md, scale)
    return out, md, cache, full_k, full_v, queries, tables, scale


def check_against_reference(backend: AttentionBackend, requests, atol=1e-5, **kwargs):
    """``run_case`` then compare every request's rows with ``naive_attention`` (``atol`` and
    ``rtol`` both ``atol``) and check that padded rows are zeros."""
    out, md, cache, full_k, full_v, queries, tables, scale = run_case(backend, requests, **kwargs)
    starts = md.query_start_loc.tolist()
    for i, (query_len, seq_len) in enumerate(requests):
        expected = naive_attention(queries[i], full_k[i], full_v[i], seq_len - query_len, scale)
        got = out[starts[i] : starts[i + 1]].double().cpu()
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    assert torch.all(out[md.num_actual_tokens :] == 0), "padded rows must be zeros"
    return out, md, cache, full_k, full_v, tables
