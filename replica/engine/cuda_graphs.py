"""Decode steps as CUDA graphs: one graph per padded batch size, captured at startup, replayed
with the step's tokens copied into the buffers the graph reads.

    startup:  for size in sizes, largest first (the smaller ones share its memory pool):
                 warm up the model on the static buffers, then capture model(...) into a graph
    a decode step of n requests (every query_len 1), n <= sizes[-1]:
                 size = the smallest captured size >= n
                 buffers[:n] <- the step's input_ids, positions, slot_mapping, seq_lens, block_table
                 buffers[n:size] <- padding: token 0, position 0, slot -1, seq_len 0
                 replay graph[size]; hidden[:n]

A padded request has ``seq_len`` 0 and slot -1: a graph-safe backend (``cuda_graph_safe``, e.g.
``triton``) writes nothing for it and returns zeros. The captured metadata says
``max_seq_len = max_model_len`` so that the rotary table covers every position a replay can ask
for, and the ``*_cpu`` host copies in it are placeholders: a graph-safe backend never reads them.
Capture and replay follow PyTorch's ``torch.cuda.graph`` (CUDA Graphs, PyTorch docs); the size
ladder is :func:`replica.attention.metadata.cuda_graph_sizes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica.attention import AttentionMetadata
from replica.attention.metadata import padded_batch_size
from replica.model.llama import LlamaModel


class DecodeBuffers:
    """The fixed tensors a captured decode graph reads, and how a step's inputs go into them.

    Args:
        sizes: ascending padded batch sizes.
        max_blocks: columns of the block table buffer (``cdiv(max_model_len, block_size)``).
        max_model_len: the ``max_seq_len`` the graph's metadata claims.
        device: where the buffers live.
    """

    def __init__(self, sizes: Sequence[int], max_blocks: int, max_model_len: int, device: torch.device) -> None:
        self.sizes = tuple(sizes)
        self.max_blocks = max_blocks
        self.max_model_len = max_model_len
        top = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slot_mapping = torch.full((top,), -1, **i64)
        self.query_start_loc = torch.arange(top + 1, **i32)
        self.seq_lens = torch.zeros(top, **i32)
        self.block_table = torch.zeros(top, max_blocks, **i32)

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata of a ``size``-request decode step over the buffers (host copies are
        placeholders: module docstring)."""
        return AttentionMetadata(
            num_actual_tokens=size, max_query_len=1, query_start_loc=self.query_start_loc[: size + 1],
            max_seq_len=self.max_model_len, seq_lens=self.seq_lens[:size], slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size], query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(size, dtype=torch.int32),
            block_table_cpu=torch.zeros(size, self.max_blocks, dtype=torch.int32),
        )

    def fits(self, metadata: AttentionMetadata) -> bool:
        """Every request a decode, no more requests than the largest size, no wider block table
        than the buffer."""
        return (
            metadata.max_query_len == 1
            and metadata.num_reqs <= self.sizes[-1]
            and metadata.num_tokens == metadata.num_reqs
            and metadata.block_table.shape[1] <= self.max_blocks
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> int:
        """Copy a decode step (``fits`` must hold; input_ids / positions int64 [n]) into the
        buffers, pad up to the next size (token 0, position 0, slot -1, seq_len 0) and return that
        size."""
        n = metadata.num_reqs
        size = padded_batch_size(n, self.sizes)
        width = metadata.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_table[:n, :width].copy_(metadata.block_table)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        return size


class DecodeCudaGraphs:
    """Captured decode graphs of ``model`` over ``kv_caches``.

    Args:
        model: the loaded model; its attention backend must be ``cuda_graph_safe``.
        kv_caches: the per-layer caches the graphs read and write (never reallocated after).
        block_size: tokens per KV block.
        max_model_len: the longest sequence a replay may carry (sizes the block table buffer).
        sizes: ascending padded batch sizes to capture.

    Raises:
        ValueError: the backend is not graph-safe, or ``sizes`` is empty.
    """

    def __init__(
        self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
        sizes: Sequence[int],
    ) -> None:  # fmt: skip
        if not getattr(model.attn_backend, "cuda_graph_safe", False):
            raise ValueError(f"attention backend {model.attn_backend.name!r} cannot run under CUDA graphs")
        if not sizes:
            raise ValueError("sizes: no batch size to capture")
        device = kv_caches[0].device
        self.buffers = buffers = DecodeBuffers(sizes, -(-max_model_len // block_size), max_model_len, device)
        self.sizes = buffers.sizes
        # Held so that it outlives the graphs (they read it by address); it has max_model_len rows,
        # so no later step regrows it.
        self._rope_table = model.rotary_emb.table(max_model_len, device, model.model.embed_tokens.weight.dtype)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                args = (buffers.input_ids[:size], buffers.positions[:size], kv_caches, buffers.metadata(size))
                model(*args)  # warm-up: kernels compiled, cuBLAS initialised
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[size] = model(*args)
                self._graphs[size] = graph
        torch.cuda.synchronize(device)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """Whether a step fits a captured graph (``DecodeBuffers.fits``)."""
        return self.buffers.fits(metadata)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this decode step (``can_run`` must hold): input_ids / positions
        int64 [n] -> final hidden states [n, hidden] (a view of the graph's output buffer, valid
        until the next replay)."""
        size = self.buffers.fill(input_ids, positions, metadata)
        self._graphs[size].replay()
        return self._outputs[size][: metadata.num_reqs]
