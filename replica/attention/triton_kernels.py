"""The Triton kernels of the ``triton`` backend: the paged KV cache write and paged attention.

Imported only by ``replica.attention.triton_backend``, lazily (this module imports ``triton`` at
the top). Both kernels read the cache in place, token by token, through the block table: a token
at position ``pos`` of request ``r`` lives at block ``block_table[r, pos // BLOCK_SIZE]``, offset
``pos % BLOCK_SIZE``, so any block size works (1, 16, 256 ...) and no K/V is ever gathered.

Attention is one launch for a whole step (prefill, chunked prefill and decode mixed), over the grid
``(num_reqs, num_kv_heads, query tiles)``. A program holds a tile of ``BLOCK_M`` query rows of
one request and one KV head, where row ``m`` is query token ``m // GROUP`` and query head
``kv_head * GROUP + m % GROUP`` (GQA: the group's heads share each K/V tile they load, so a decode
reads its KV once per KV head). It streams K/V in tiles of ``BLOCK_N`` positions with the online
softmax of FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact
Attention with IO-Awareness", Algorithm 1), accumulating in float32. The causal mask is aligned
bottom-right: query token ``i`` of a request with ``query_len`` queries over ``seq_len`` keys sits
at position ``seq_len - query_len + i`` and sees keys ``0 ..`` that position.

Everything the kernels read per step comes from device tensors (query_start_loc, seq_lens,
block_table, slot_mapping); host integers only shape the grid. That is what lets a decode step be
captured in a CUDA graph and replayed with new contents in the same buffers: a request padded in
with ``seq_len`` 0 attends nothing and gets zeros, a slot of -1 is never written.
"""

from __future__ import annotations

import triton
import triton.language as tl

# exp(x) = exp2(x * log2(e)): the kernel folds log2(e) into the softmax scale.
LOG2E = 1.4426950408889634


@triton.jit
def write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(num_tokens, BLOCK_T), num_kv_heads): one program stores the K and V of one KV
    head for ``BLOCK_T`` tokens at their slots; a slot < 0 (padding) stores nothing."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (slot >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    safe = tl.where(slot >= 0, slot, 0)
    dst = (safe // BLOCK_SIZE) * stride_c_block + (safe % BLOCK_SIZE) * stride_c_tok + head * stride_c_head
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64[:, None] * stride_k_tok + head * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + t64[:, None] * stride_v_tok + head * stride_v_head + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst[:, None] + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst[:, None] + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Grid (num_reqs, num_kv_heads, cdiv(max_query_len * GROUP, BLOCK_M)); module docstring.
    ``qk_scale`` is the softmax scale times log2(e). Writes every row of its tile that is a real
    query of the request (zeros when the request has no keys, i.e. ``seq_len`` 0). ``DOT_FP32``:
    both matmuls in float32 whatever the input dtype (the interpreter's ``tl.dot`` on bfloat16
    is wrong in triton 3.9; on a GPU the matmuls run in the input dtype)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_valid = q_idx < query_len
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :], other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = context_len + q_idx

    # The keys this tile needs: up to the position of its last real query, 0 for an empty tile.
    last_q = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, query_len - 1)
    kv_end = tl.minimum(seq_len, context_len + last_q + 1)
    kv_end = tl.where(tile * BLOCK_M < query_len * GROUP, kv_end, 0)

    # A finite floor instead of -inf keeps fully masked rows at exp2(-inf - floor) = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        n_valid = n < kv_end
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        offs = block * stride_c_block + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        k = tl.load(k_cache_ptr + offs[None, :] + d[:, None], mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :] & row_valid[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None]).to(q.dtype)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :],
    )
