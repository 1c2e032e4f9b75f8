"""What the model tests share: the prompts, and a minimal paged runner (block allocator + per-step
metadata, as the engine does it) with greedy decoding, compared against transformers."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from replica.attention import allocate_kv_caches, build_attention_metadata
from replica.model import LlamaModel

PROMPTS = [
    "The harbour town woke before the sun.",
    "A",
    "Good writing is clear and direct. Say what you mean in as few words as you can, and choose the plain "
    "word over the fancy one. Read your sentences aloud; if you run out of breath, the sentence is too long.",
    "Zebras quietly juggle 42 émigré pianos — 🎹!",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class Sequence:
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)


class PagedRunner:
    """Allocates blocks from a shuffled free list (so block tables are non-contiguous), builds
    metadata per step, pads the token count to a power of two, returns last-token logits."""

    def __init__(self, model: LlamaModel, *, block_size: int, num_blocks: int, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(
            cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu"
        )
        self.free_blocks = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free_blocks)

    def step(self, schedule: list[tuple[Sequence, int]]) -> torch.Tensor:
        query_lens, seq_lens, tables, input_ids = [], [], [], []
        for seq, num_new in schedule:
            seq_len = seq.num_computed + num_new
            while len(seq.block_table) * self.block_size < seq_len:
                seq.block_table.append(self.free_blocks.pop())
            query_lens.append(num_new)
            seq_lens.append(seq_len)
            tables.append(seq.block_table)
            input_ids += seq.tokens[seq.num_computed : seq_len]
        num_tokens = len(input_ids)
        pad_to = 1 << (num_tokens - 1).bit_length()
        md, positions = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, pad_to=pad_to)
        ids = torch.tensor(input_ids + [0] * (pad_to - num_tokens))
        with torch.inference_mode():
            hidden = self.model(ids, positions, self.kv_caches, md)
            logits = self.model.compute_logits(hidden[md.query_start_loc[1:].long() - 1])
        for seq, num_new in schedule:
            seq.num_computed += num_new
        return logits


def paged_greedy(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, *, block_size: int = 4):
    """Greedy decode all prompts together: step 1 prefills the first prompt whole and the others'
    first halves (chunked prefill), then the rest, then decodes; returns (new tokens, logits per
    step) per prompt."""
    runner = PagedRunner(model, block_size=block_size, num_blocks=256)
    seqs = [Sequence(list(p), len(p)) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    first = True
    while any(len(o) < max_new_tokens for o in outputs):
        schedule = []
        for i, seq in enumerate(seqs):
            if len(outputs[i]) >= max_new_tokens:
                continue
            remaining = len(seq.tokens) - seq.num_computed
            if first and i > 0 and remaining > 1:
                remaining = remaining // 2  # chunked prefill: the rest comes next step
            schedule.append((seq, remaining))
        first = False
        logits = runner.step(schedule)
        for row, (seq, _) in enumerate(schedule):
            if seq.num_computed < len(seq.tokens):
                continue  # mid-prefill chunk: nothing to sample
            i = seqs.index(seq)
            token = int(logits[row].argmax())
            outputs[i].append(token)
            step_logits[i].append(logits[row])
            seq.tokens.append(token)
    return outputs, step_logits


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int):
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # else ids equal to pad_token_id would be masked out
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), [x[0] for x in out.logits]


def our_prefill_logits(model: LlamaModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts in ONE step (a mixed prefill batch); logits at every position."""
    runner = PagedRunner(model, block_size=16, num_blocks=128, seed=1)
    lens = [len(p) for p in prompts]
    tables = []
    for n in lens:
        tables.append([runner.free_blocks.pop() for _ in range(-(-n // 16))])
    md, positions = build_attention_metadata(lens, lens, tables, 16, pad_to=sum(lens) + 3)
    ids = torch.tensor([t for p in prompts for t in p] + [0, 0, 0])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, runner.kv_caches, md))
    starts = md.query_start_loc.tolist()
    return [logits[starts[i] : starts[i + 1]] for i in range(len(prompts))]


def assert_prefill_matches(ours: LlamaModel, hf_model, prompts: list[list[int]]) -> None:
    got = our_prefill_logits(ours, prompts)
    with torch.inference_mode():
        for prompt, logits in zip(prompts, got, strict=True):
            expected = hf_model(torch.tensor([prompt])).logits[0].float()
            diff = (logits - expected).abs().max().item()
            assert diff < 1e-4, f"prompt of {len(prompt)} tokens: max |logit diff| {diff:.2e}"


def assert_decode_matches(ours: LlamaModel, hf_model, prompts: list[list[int]], max_new_tokens: int) -> None:
    outputs, step_logits = paged_greedy(ours, prompts, max_new_tokens)
    for prompt, tokens, logits in zip(prompts, outputs, step_logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(hf_model, prompt, max_new_tokens)
        assert tokens == hf_tokens
        for step, (a, b) in enumerate(zip(logits, hf_logits, strict=True)):
            diff = (a - b.float()).abs().max().item()
            assert diff < 1e-4, f"decode step {step}: max |logit diff| {diff:.2e}"
