"""TorchAttentionBackend against a naive reference: full causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

import replica.attention.torch_backend as torch_backend  # noqa: E402
from replica.attention import (
    TorchAttentionBackend,
    allocate_kv_caches,
    build_attention_metadata,
    kv_cache_block_bytes,
    kv_cache_shape,
    select_backend,
    write_kv_cache,
)
from tests.replica.attention import reference
from tests.replica.attention.reference import SENTINEL
from tests.support import one_torch_thread  # noqa: F401  (an autouse fixture)

DECODE_PATHS = ["gather", "cpu_kernel"] if torch_backend._cpu_paged is not None else ["gather"]


@pytest.fixture(autouse=True, params=DECODE_PATHS)
def decode_path(request, monkeypatch):
    """Every test runs on both CPU decode paths: gather + SDPA, and the compiled paged kernel
    (replica/attention/_cpu_paged.c) when it was built."""
    if request.param == "gather":
        monkeypatch.setattr(torch_backend, "_cpu_paged", None)
    return request.param


def run_case(requests, **kwargs):
    return reference.run_case(TorchAttentionBackend(), requests, **kwargs)


def check_against_reference(requests, atol=1e-5, **kwargs):
    return reference.check_against_reference(TorchAttentionBackend(), requests, atol=atol, **kwargs)


def test_pure_decode_batch_matches_naive_attention():
    check_against_reference([(1, 1), (1, 5), (1, 8), (1, 13), (1, 33)])


def test_mixed_prefill_decode_and_chunked_prefill_with_padding_matches_naive_attention():
    requests = [(1, 9), (7, 7), (3, 11), (1, 4), (16, 16), (5, 21)]
    check_against_reference(requests, pad_to=40)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1), (8, 2)])
def test_gqa_and_mha_head_layouts_match_naive_attention(num_heads, num_kv_heads):
    check_against_reference([(1, 6), (4, 10), (3, 3)], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=3)


def test_block_size_one_and_sixteen_match_naive_attention():
    check_against_reference([(2, 5), (1, 3)], block_size=1, num_blocks=32)
    check_against_reference([(20, 37), (1, 17), (1, 16)], block_size=16, num_blocks=16)


def test_bfloat16_matches_naive_attention_loosely():
    check_against_reference([(1, 9), (6, 14)], dtype=torch.bfloat16, atol=3e-2, pad_to=8)


def test_cache_holds_every_token_at_its_slot_and_padding_writes_nothing():
    requests = [(1, 9), (7, 7), (3, 11)]
    block_size = 4
    _, md, cache, full_k, full_v, tables = check_against_reference(requests, pad_to=16, block_size=block_size)
    written = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool)
    flat = cache.view(2, -1, *cache.shape[3:])
    for (_, seq_len), table, k, v in zip(requests, tables, full_k, full_v, strict=True):
        for pos in range(seq_len):
            slot = table[pos // block_size] * block_size + pos % block_size
            assert torch.equal(flat[0, slot], k[pos])
            assert torch.equal(flat[1, slot], v[pos])
            written[slot] = True
    # Everything else, the last block included (where a -1 slot would land if used as an index),
    # still holds the sentinel.
    assert torch.all(flat[:, ~written] == SENTINEL)


def test_write_kv_cache_skips_interior_padding_slots():
    cache = torch.zeros(kv_cache_shape(4, 2, 1, 2))
    key = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    write_kv_cache(key, -key, cache, torch.tensor([5, -1, 2]))
    flat = cache.view(2, 8, 1, 2)
    assert flat[0, 5].tolist() == [[1.0, 2.0]]
    assert flat[0, 2].tolist() == [[5.0, 6.0]]
    assert flat[1, 2].tolist() == [[-5.0, -6.0]]
    assert int((flat != 0).any(-1).any(-1).sum()) == 4  # two slots, K and V


def test_kv_cache_sizing_helpers():
    assert kv_cache_shape(10, 16, 4, 32) == (2, 10, 16, 4, 32)
    # 2 (K, V) * 16 tokens * 4 heads * 32 dims * 2 bytes * 4 layers
    assert kv_cache_block_bytes(16, 4, 32, torch.bfloat16, 4) == 2 * 16 * 4 * 32 * 2 * 4
    caches = allocate_kv_caches(3, 5, 16, 4, 32, torch.float32, "cpu")
    assert len(caches) == 3
    assert all(c.shape == (2, 5, 16, 4, 32) and not c.any() for c in caches)


def test_select_backend_on_cpu_is_torch_and_rejects_unknown_names():
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", "xformers")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cpu", "flash_attn")


# ---------------------------------------------------------------------------------------------
# batched decodes (one gather + SDPA per length bucket) against the per-request references


def _random_decode_case(seed: int, num_reqs: int, max_len: int, block_size: int, num_blocks: int):
    """Random (query_len, seq_len) requests, mostly decodes with a few prefill chunks among them
    (so decode rows are not contiguous), lengths from 1 to max_len."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_reqs,), generator=gen).tolist()
    chunk = torch.randint(0, 4, (num_reqs,), generator=gen).tolist()
    requests = [(min(s, 3) if c == 0 else 1, s) for s, c in zip(lens, chunk, strict=True)]
    assert sum(-(-s // block_size) for _, s in requests) <= num_blocks - 2
    return requests


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4), (6, 3), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_decodes_on_random_block_tables_match_naive_attention(num_heads, num_kv_heads, block_size):
    requests = _random_decode_case(
        seed=block_size + num_heads, num_reqs=12, max_len=70, block_size=block_size, num_blocks=1024
    )
    num_tokens = sum(q for q, _ in requests)
    check_against_reference(
        requests, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, num_blocks=1024,
        pad_to=num_tokens + 5,
    )  # fmt: skip


def test_batched_bfloat16_decodes_with_a_mask_match_naive_attention_loosely():
    check_against_reference([(1, 9), (1, 3), (5, 14), (1, 30)], dtype=torch.bfloat16, atol=3e-2, pad_to=12)


def test_batched_decodes_equal_one_request_at_a_time():
    # The batch (padded, masked, in length buckets) against the same backend fed one request per
    # call (no padding, no mask): the same numbers up to float32 rounding.
    requests = [(1, 3), (1, 40), (1, 17), (1, 64), (1, 1), (1, 33), (1, 16)]
    out, md, cache, full_k, full_v, queries, tables, scale = run_case(requests, block_size=4, num_blocks=128)
    backend = TorchAttentionBackend()
    for i, (_, seq_len) in enumerate(requests):
        one, _ = build_attention_metadata([1], [seq_len], [tables[i]], 4)
        got = backend.forward(queries[i], full_k[i][-1:], full_v[i][-1:], cache, one, scale)
        torch.testing.assert_close(out[i : i + 1], got, atol=1e-6, rtol=1e-6)


def test_decodes_of_very_different_lengths_split_into_buckets_and_still_match(monkeypatch):
    import replica.attention.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "_BUCKET_OVERHEAD_BYTES", 1)  # one bucket per distinct length
    requests = [(1, 50), (1, 2), (4, 9), (1, 31), (1, 2), (1, 50), (1, 7)]
    _, md, cache, *_ = check_against_reference(requests, block_size=4, num_blocks=64, pad_to=16)
    plan = torch_backend.build_decode_plan(md, cache, torch.float32)
    assert plan.prefill_reqs == (2,)
    assert len(plan.buckets) == 4  # 2, 7, 31 and 50 tokens
    rows = []
    for bucket in plan.buckets:
        r = bucket.rows
        rows += list(range(r.start, r.stop)) if isinstance(r, slice) else r.tolist()
    decode_rows = [0, 1, 6, 7, 8, 9]  # query rows of the six decodes (request 2 takes rows 2..5)
    assert sorted(rows) == decode_rows


def test_decode_bucket_capped_by_bytes_still_matches(monkeypatch):
    import replica.attention.torch_backend as torch_backend

    # 2 heads of 8 dims, block_size 4: a block pair is 2 * 4 * 2 * 8 * 4 = 512 bytes; a cap of 8
    # blocks forces one bucket per request or two.
    monkeypatch.setattr(torch_backend, "_MAX_BUCKET_BYTES", 8 * 512)
    requests = [(1, 13), (1, 14), (1, 15), (1, 16), (1, 5)]
    _, md, cache, *_ = check_against_reference(requests, block_size=4, num_blocks=64)
    plan = torch_backend.build_decode_plan(md, cache, torch.float32)
    assert all(b.num_reqs * b.num_blocks <= 8 for b in plan.buckets)
    assert sum(b.num_reqs for b in plan.buckets) == len(requests)


def test_block_table_cells_past_a_rows_blocks_are_never_read():
    # An engine may pass a persistent table whose rows are longer than each request needs; the
    # cells past a row's blocks name blocks that hold NaN here, and must not reach the output.
    block_size, num_blocks = 4, 32
    requests = [(1, 5), (1, 9), (1, 2)]
    out, md, cache, full_k, full_v, queries, tables, scale = run_case(requests, block_size=block_size,
                                                                      num_blocks=num_blocks)  # fmt: skip
    poisoned = [b for b in range(1, num_blocks) if all(b not in t for t in tables)][:3]
    cache[:, poisoned] = float("nan")
    table = torch.full((len(requests), 6), poisoned[0], dtype=torch.int32).numpy()
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
        table[i, len(t) :] = poisoned[i % len(poisoned)]
    md2, _ = build_attention_metadata([1, 1, 1], [s for _, s in requests], table, block_size)
    q = torch.cat(queries)
    k = torch.stack([fk[-1] for fk in full_k])
    v = torch.stack([fv[-1] for fv in full_v])
    got = TorchAttentionBackend().forward(q, k, v, cache, md2, scale)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, out, atol=1e-6, rtol=1e-6)


def test_decode_plan_is_built_once_per_step_and_shared_by_every_layer():
    requests = [(1, 6), (3, 3), (1, 11)]
    out, md, cache, *_ = run_case(requests)
    assert len(md.derived) == 1
    plan = next(iter(md.derived.values()))
    second = cache.clone()
    q, kv = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    TorchAttentionBackend().forward(q, kv, kv, second, md, 0.3)
    assert len(md.derived) == 1 and next(iter(md.derived.values())) is plan


def test_pure_decode_step_with_uniform_lengths_needs_no_mask_and_no_zero_fill():
    import replica.attention.torch_backend as torch_backend

    requests = [(1, 12), (1, 12), (1, 12)]
    _, md, cache, *_ = check_against_reference(requests)
    plan = torch_backend.build_decode_plan(md, cache, torch.float32)
    assert plan.decodes_cover_all_rows
    assert len(plan.buckets) == 1 and plan.buckets[0].mask is None
    assert plan.buckets[0].rows == slice(0, 3)


@pytest.mark.skipif("cpu_kernel" not in DECODE_PATHS, reason="replica.attention._cpu_paged not built")
def test_cpu_kernel_rejects_out_of_range_input_naming_it_and_writes_nothing():
    import numpy as np

    from replica.attention import _cpu_paged

    H, Hkv, D, B, NB = 4, 2, 8, 4, 6
    out = np.full((2, H, D), 9.0, dtype=np.float32)
    q = np.ones((2, H, D), dtype=np.float32)
    kv = np.zeros((2, NB, B, Hkv, D), dtype=np.float32)
    table = np.array([[1, 2], [3, 4]], dtype=np.int32)
    lens = np.array([5, 8], dtype=np.int32)
    rows, reqs = np.array([0, 1]), np.array([0, 1])

    def call(**kw):
        a = dict(out=out, q=q, kv=kv, table=table, lens=lens, rows=rows, reqs=reqs)
        a.update(kw)
        _cpu_paged.paged_decode(*a.values(), H, Hkv, D, B, 0.5)

    cases = [
        ({"table": np.array([[1, 2], [3, NB]], dtype=np.int32)}, "block_table"),
        ({"table": np.array([[1, 2], [3, -1]], dtype=np.int32)}, "block_table"),
        ({"lens": np.array([5, 9], dtype=np.int32)}, "seq_lens"),
        ({"lens": np.array([0, 8], dtype=np.int32)}, "seq_lens"),
        ({"rows": np.array([0, 2])}, "rows"),
        ({"reqs": np.array([0, 2])}, "reqs"),
        ({"kv": np.zeros((2, NB, B, Hkv, D + 1), dtype=np.float32)}, "kv_cache"),
        ({"q": np.ones((2, H, D), dtype=np.float64)}, "query"),
        ({"table": table.astype(np.int64)}, "block_table"),
    ]
    for kw, field in cases:
        with pytest.raises(ValueError, match=field):
            call(**kw)
        assert (out == 9.0).all()
    call()  # the valid call: uniform keys -> each output row is the mean of its values (zeros)
    assert (out == 0).all()
    with pytest.raises(ValueError, match="num_heads"):
        _cpu_paged.paged_decode(out, q, kv, table, lens, rows, reqs, 3, 2, D, B, 0.5)


def test_cpu_kernel_can_be_turned_off_or_demanded():
    assert TorchAttentionBackend(cpu_kernel=False).cpu_kernel is False
    if torch_backend._cpu_paged is None:
        with pytest.raises(ImportError, match="_cpu_paged"):
            TorchAttentionBackend(cpu_kernel=True)
    else:
        assert TorchAttentionBackend().cpu_kernel is True


@pytest.mark.skipif("cpu_kernel" not in DECODE_PATHS, reason="replica.attention._cpu_paged not built")
def test_cpu_kernel_split_over_threads_gives_the_single_thread_result(decode_path):
    """With torch on several threads the decodes are split over kernel workers: same numbers."""
    if decode_path != "cpu_kernel":
        pytest.skip("the kernel path only")
    requests = [(1, n) for n in (3, 40, 17, 64, 1, 33, 16, 9, 50, 12, 7, 70)]
    single, *_ = run_case(requests, block_size=4, num_blocks=256, pad_to=15)
    torch.set_num_threads(3)  # the module fixture restores 1 afterwards
    try:
        threaded, md, *_ = run_case(requests, block_size=4, num_blocks=256, pad_to=15)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(single, threaded)
    check_against_reference(requests, block_size=4, num_blocks=256)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 40, 3])
def test_decodes_match_naive_attention_for_each_head_dim(head_dim):
    # 32/64/128 take the kernel's specialised loops, 40 and 3 the generic one (3: shorter than a
    # vector, every product in the scalar tail).
    requests = [(1, 5), (1, 37), (1, 16), (3, 20), (1, 64)]
    check_against_reference(requests, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, pad_to=10)
