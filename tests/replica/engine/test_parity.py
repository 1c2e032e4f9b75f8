"""The engine end to end against transformers: greedy outputs token-identical to
``LlamaForCausalLM.generate(do_sample=False)`` and every sampled-row logit within 1e-4, for
requests of mixed lengths that arrive at different steps under a token budget small enough to
chunk every long prefill (DESIGN.md §3.2). Once for the default Llama checkpoint, once for a tiny
random Qwen2 checkpoint (q/k/v bias, tied embeddings).
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from replica.engine.config import EngineConfig  # noqa: E402
from replica.engine.engine import LLMEngine  # noqa: E402
from replica.engine.params import SamplingParams  # noqa: E402

torch.set_num_threads(1)

PROMPT_LENS = (5, 37, 120, 300)
MAX_NEW_TOKENS = 12
BUDGET = 64  # max_num_batched_tokens: the 120- and 300-token prompts are prefilled in chunks
LOGIT_ATOL = 1e-4
# Arrival schedule: (requests added, then steps run before the next arrival).
ARRIVALS = (((0, 1), 2), ((2,), 3), ((3,), 0))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def random_prompts(vocab: int, special_ids: set[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.tensor([t for t in range(vocab) if t not in special_ids])
    return [normal[torch.randint(len(normal), (n,), generator=gen)].tolist() for n in PROMPT_LENS]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the raw logits each one was chosen from (one prompt, no padding)."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits]


def run_engine_staggered(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int):
    """Add prompts per ARRIVALS, step to completion; returns (tokens per prompt from the streamed
    outputs, logits of every sampled row per prompt, per-step scheduled token counts)."""
    logits_by_req: dict[str, list[torch.Tensor]] = defaultdict(list)
    execute = engine.runner.execute

    def capturing_execute(sched):
        logits = execute(sched)
        sampled = [s.request.request_id for s in sched.scheduled if s.samples]
        for rid, row in zip(sampled, logits, strict=True):
            logits_by_req[rid].append(row.clone())
        return logits

    engine.runner.execute = capturing_execute
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    streamed: dict[str, list[int]] = defaultdict(list)
    scheduled: list[tuple[int, int]] = []  # (total, prefill) tokens per step

    def step() -> None:
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
        scheduled.append((engine.last_step.num_scheduled_tokens, engine.last_step.num_prefill_tokens))

    for idxs, steps_after in ARRIVALS:
        for i in idxs:
            engine.add_request(prompts[i], params, request_id=f"p{i}")
        for _ in range(steps_after):
            step()
    while engine.has_unfinished_requests():
        step()
    rids = [f"p{i}" for i in range(len(prompts))]
    return [streamed[r] for r in rids], [logits_by_req[r] for r in rids], scheduled


def assert_engine_matches_transformers(
    model_dir: Path, hf_model, prompts: list[list[int]], eos_ids: set[int]
):
    engine = LLMEngine(
        model_dir, EngineConfig(device="cpu", num_blocks=64, max_num_batched_tokens=BUDGET, torch_threads=1)
    )
    tokens, logits, scheduled = run_engine_staggered(engine, prompts, MAX_NEW_TOKENS)

    # The budget really chunked the prefills: no step over 64 tokens, and full-budget prefill steps.
    assert max(total for total, _ in scheduled) == BUDGET
    assert sum(prefill for _, prefill in scheduled) == sum(PROMPT_LENS)
    assert sum(1 for total, prefill in scheduled if prefill and total == BUDGET) >= 300 // BUDGET

    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        # transformers stops at EOS, the engine (ignore_eos) does not: compare up to transformers' end.
        assert len(tokens[i]) == len(logits[i]) == MAX_NEW_TOKENS
        assert tokens[i][: len(ref_tokens)] == ref_tokens, f"prompt {i} ({len(prompt)} tokens)"
        if len(ref_tokens) < MAX_NEW_TOKENS:
            assert ref_tokens[-1] in eos_ids
        # Row 0 is the prefill's last position (after chunking), the rest are decodes.
        for j, (ours, ref) in enumerate(zip(logits[i], ref_logits, strict=False)):
            diff = (ours - ref).abs().max().item()
            assert diff < LOGIT_ATOL, (
                f"prompt {i} ({len(prompt)} tokens), sampled row {j}: max |diff| {diff:.2e}"
            )
    assert engine.is_idle() and engine.usage == 0.0


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_special_ids(default_model_dir) -> set[int]:
    tok = json.loads((default_model_dir / "tokenizer.json").read_text())
    return {t["id"] for t in tok["added_tokens"]}


def test_default_model_staggered_chunked_greedy_matches_transformers(default_model_dir, default_special_ids):
    cfg = json.loads((default_model_dir / "config.json").read_text())
    hf_model = transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(cfg["vocab_size"], default_special_ids, seed=0)
    eos = {cfg["eos_token_id"]} | set(
        json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"]
    )
    assert_engine_matches_transformers(default_model_dir, hf_model, prompts, eos)


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory, default_model_dir):
    """A tiny random Qwen2 (q/k/v bias randomised: transformers initialises biases to 0, which would
    hide a loader that drops them), tied embeddings, the default model's tokenizer."""
    cfg = json.loads((default_model_dir / "config.json").read_text())
    config = transformers.Qwen2Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=cfg["bos_token_id"],
        eos_token_id=cfg["eos_token_id"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf_model = transformers.Qwen2ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf_model.model.embed_tokens.weight.normal_(0.0, 0.3, generator=gen)  # spread logits: no near-ties
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    folder = tmp_path_factory.mktemp("qwen2-tiny")
    hf_model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, folder / name)
    return folder, hf_model


def test_qwen2_with_qkv_bias_staggered_chunked_greedy_matches_transformers(
    qwen2_checkpoint, default_special_ids
):
    folder, hf_model = qwen2_checkpoint
    prompts = random_prompts(hf_model.config.vocab_size, default_special_ids, seed=1)
    assert_engine_matches_transformers(folder, hf_model, prompts, {hf_model.config.eos_token_id})


def test_repetition_penalty_greedy_matches_transformers_and_changes_the_output(default_model_dir, default_special_ids):
    """vLLM's repetition penalty is transformers' RepetitionPenaltyLogitsProcessor (over prompt and
    output tokens): the engine's penalised greedy tokens equal ``generate(repetition_penalty=...)``."""
    cfg = json.loads((default_model_dir / "config.json").read_text())
    hf_model = transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(cfg["vocab_size"], default_special_ids, seed=3)[:2]
    prompts.append(prompts[0][:5] * 8)  # a repeating prompt, whose continuation the penalty must change
    engine = LLMEngine(default_model_dir, EngineConfig(device="cpu", num_blocks=64, torch_threads=1))
    new = 16
    changed = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
        (plain,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        (ours,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                                                           repetition_penalty=1.8))
        assert ours.output_token_ids == ref
        changed += plain.output_token_ids != ours.output_token_ids
    assert changed  # the penalty is applied, not ignored
