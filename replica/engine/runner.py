"""The model runner: turns a SchedulerOutput into one forward pass and the logits to sample."""

from __future__ import annotations

import torch

from replica.attention import allocate_kv_caches, build_attention_metadata
from replica.engine.cuda_graphs import DecodeCudaGraphs
from replica.engine.scheduler import SchedulerOutput
from replica.model.llama import LlamaModel


class ModelRunner:
    """Owns the model and its paged KV cache (one tensor per layer), plus the optional CPU tier.

    ``execute`` builds the step's flattened input (each scheduled request's tokens
    ``[start, start + n)``), its attention metadata, runs the model and returns the logits of the
    last position of every request whose chunk reaches the end of its tokens. With
    ``cuda_graph_sizes`` (CUDA, a graph-safe backend) decode steps replay captured graphs
    (``replica.engine.cuda_graphs``); ``max_model_len`` sizes their block table.
    """

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        cpu_offload_blocks: int = 0,
        cuda_graph_sizes: tuple[int, ...] = (),
        max_model_len: int = 0,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_caches(
            cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device
        )
        self.cpu_caches = (
            allocate_kv_caches(
                cfg.num_hidden_layers, cpu_offload_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
                "cpu",
            )
            if cpu_offload_blocks
            else []
        )
        self.num_copies = 0
        self.graphs = (
            DecodeCudaGraphs(model, self.kv_caches, block_size, max_model_len, cuda_graph_sizes)
            if cuda_graph_sizes
            else None
        )
        self.num_graph_steps = 0

    def copy_block(self, direction: str, src: int, dst: int) -> None:
        """The KV manager's copy callback: ``to_cpu`` GPU block src -> CPU slot dst, ``to_gpu`` back."""
        for gpu, cpu in zip(self.kv_caches, self.cpu_caches, strict=True):
            if direction == "to_cpu":
                cpu[:, dst].copy_(gpu[:, src])
            elif direction == "to_gpu":
                gpu[:, dst].copy_(cpu[:, src])
            else:
                raise ValueError(f"direction: expected to_cpu or to_gpu, got {direction!r}")
        self.num_copies += 1

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns float32 logits [num_sampling_requests, vocab] in the order of
        ``[s for s in sched.scheduled if s.samples]``."""
        scheduled = sched.scheduled
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        rows: list[int] = []  # the last row of each request that samples
        num_tokens = 0
        for s in scheduled:
            n, start, all_ids = s.num_scheduled_tokens, s.start, s.request.all_token_ids
            if n == 1:
                token_ids.append(all_ids[start])
            else:
                token_ids += all_ids[start : start + n]
            num_tokens += n
            query_lens.append(n)
            seq_lens.append(start + n)
            block_tables.append(s.block_ids)
            if start + n == len(all_ids):  # s.samples, inlined
                rows.append(num_tokens - 1)
        meta, positions = build_attention_metadata(
            query_lens, seq_lens, block_tables, self.block_size, device=self.device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64).to(self.device)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not rows:
            return torch.empty((0, self.model.config.vocab_size), dtype=torch.float32, device=self.device)
        if len(rows) == num_tokens:  # a pure decode step: every row samples, in order
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
