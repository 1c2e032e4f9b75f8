"""Per-step attention metadata for a flattened batch of tokens over a paged KV cache (DESIGN.md §3.2).

One engine step runs B requests; request i contributes its next ``query_len[i]`` tokens (a decode
is 1, a prefill chunk more), which are the LAST ``query_len[i]`` positions of its ``seq_len[i]``::

    request i:  | cached / earlier context (seq_len - query_len) | query tokens (query_len) |
                0                                                                   seq_len - 1
    flattened:  [ req 0 queries | req 1 queries | ... | padding (slot -1) ]
                ^query_start_loc[0]=0  ^query_start_loc[1]   ^num_actual_tokens

Token at position ``pos`` of request i lives in KV slot
``block_table[i, pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one step needs; built once per step, shared by all layers.

    Fields (B = number of requests, T = number of tokens after padding):

    - ``num_actual_tokens``: real tokens; rows ``[num_actual_tokens, T)`` are padding.
    - ``max_query_len`` / ``max_seq_len``: maxima over the batch, in tokens.
    - ``query_start_loc``: int32 [B+1], prefix sums of the query lengths (``cu_seqlens_q``).
    - ``seq_lens``: int32 [B], tokens of each request after this step (context + queries).
    - ``slot_mapping``: int64 [T], KV slot of each token; -1 for padding (never written).
    - ``block_table``: int32 [B, max_blocks], each request's block ids, right-padded with 0.
    - ``query_start_loc_cpu`` / ``seq_lens_cpu`` / ``block_table_cpu``: host copies of the three
      above (the same tensors on CPU), so that backends planning on the host don't synchronise
      with the device to read them.
    - ``derived``: what a backend computes from these once per step and reuses in every layer
      (e.g. the torch backend's decode buckets), keyed by the backend; starts empty.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table_cpu: torch.Tensor
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_reqs(self) -> int:
        """Number of requests (B) in the step."""
        return self.seq_lens_cpu.shape[0]

    @property
    def num_tokens(self) -> int:
        """Number of token rows after padding (T)."""
        return self.slot_mapping.shape[0]


def build_attention_metadata(
    query_lens: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    block_tables: Sequence[Sequence[int]] | np.ndarray,
    block_size: int,
    pad_to: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Build one step's ``AttentionMetadata`` and the token ``positions``.

    Args:
        query_lens: tokens computed this step per request (>= 1 each).
        seq_lens: total tokens per request after this step (>= its query_len).
        block_tables: per request, its block ids in order (a list of lists, ragged), or an int
            array [B, max_blocks] already padded. Each must cover ``ceil(seq_len / block_size)``
            blocks.
        block_size: tokens per KV block.
        pad_to: pad the token dimension to this many rows (CUDA-graph bucket); padded rows get
            slot -1 and position 0. ``None`` means no padding.
        device: where the tensors go (the ``*_cpu`` copies stay on the host).

    Returns:
        ``(metadata, positions)`` with positions int64 [T]: for request i,
        ``seq_len - query_len .. seq_len - 1``.

    Raises:
        ValueError: mismatched lengths, an empty batch, a query_len < 1 or > seq_len, a block
            table too short for its seq_len, or ``pad_to`` smaller than the number of tokens.

    Vectorised with numpy (no per-token Python): slots are computed as
    ``block_table[req, pos // B] * B + pos % B`` over a ``np.repeat`` of request indices. Most of
    the time goes to flattening the ragged lists: an engine that keeps its block tables in a
    persistent int32 array can pass that array instead and skip the flattening.
    """
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    num_reqs = q.shape[0]
    if num_reqs == 0:
        raise ValueError("empty batch: query_lens has no requests")
    if s.shape[0] != num_reqs or len(block_tables) != num_reqs:
        raise ValueError(
            f"query_lens ({num_reqs}), seq_lens ({s.shape[0]}) and block_tables ({len(block_tables)}) "
            "must have one entry per request"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    bad = np.flatnonzero((q < 1) | (q > s))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {i}: query_len {q[i]} must be in [1, seq_len={s[i]}]")

    table, row_lens = _padded_block_table(block_tables, num_reqs)
    needed = -(-s // block_size)
    short = np.flatnonzero(row_lens < needed)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"request {i}: block table has {row_lens[i]} blocks, seq_len {s[i]} needs {needed[i]} "
            f"of {block_size} tokens"
        )

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(q, out=query_start_loc[1:])
    num_actual = int(query_start_loc[-1])
    num_tokens = num_actual if pad_to is None else pad_to
    if num_tokens < num_actual:
        raise ValueError(f"pad_to {pad_to} is smaller than the {num_actual} tokens of the batch")

    req = np.repeat(np.arange(num_reqs), q)
    positions = np.zeros(num_tokens, dtype=np.int64)
    pos = positions[:num_actual]
    np.subtract(np.arange(num_actual, dtype=np.int64), query_start_loc[:-1][req], out=pos)
    pos += (s - q)[req]
    slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
    slot_mapping[:num_actual] = table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size

    seq_lens_np = s.astype(np.int32)
    qsl_cpu = torch.from_numpy(query_start_loc)
    seq_lens_cpu = torch.from_numpy(seq_lens_np)
    table_cpu = torch.from_numpy(table)
    metadata = AttentionMetadata(
        num_actual_tokens=num_actual,
        max_query_len=int(q.max()),
        query_start_loc=qsl_cpu.to(device),
        max_seq_len=int(s.max()),
        seq_lens=seq_lens_cpu.to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        block_table=table_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        block_table_cpu=table_cpu,
    )
    return metadata, torch.from_numpy(positions).to(device)


def _padded_block_table(
    block_tables: Sequence[Sequence[int]] | np.ndarray, num_reqs: int
) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [B, max_blocks] table right-padded with 0, int64 [B] number of real blocks per row)."""
    if isinstance(block_tables, np.ndarray):
        if block_tables.ndim != 2:
            raise ValueError(f"block_tables array must be 2-D [B, max_blocks], got shape {block_tables.shape}")
        row_lens = np.full(num_reqs, block_tables.shape[1], dtype=np.int64)
        return np.ascontiguousarray(block_tables, dtype=np.int32), row_lens
    row_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_reqs)
    max_blocks = int(row_lens.max())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(row_lens.sum()))
    table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    # Row-major boolean assignment fills each row's first row_lens[i] cells, in order.
    table[np.arange(max_blocks) < row_lens[:, None]] = flat
    return table, row_lens


def cuda_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded decode batch sizes (``pad_to`` values) a CUDA-graph runner captures: the ladder
    1, 2, 4, 8, 16, 24, ... (vLLM's default: then every multiple of 8) up to the first rung that
    holds ``max_num_seqs``. E.g. 3 -> (1, 2, 4); 20 -> (1, 2, 4, 8, 16, 24).

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= max_num_seqs:
            return tuple(sizes)
    raise AssertionError("unreachable")


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_reqs``; None when none does."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None
