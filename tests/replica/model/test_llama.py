"""LlamaModel + loader + default model against transformers (the numerics reference).

Prefill logits must match transformers to 1e-4 and greedy decoding through the paged KV cache
(metadata builder + a block allocator written here) must be token-identical to
``generate(do_sample=False)``, for the default model and for tiny random Qwen2 / Mistral / Llama
checkpoints with bias, tied embeddings, RoPE scaling and sharded weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from replica.attention import allocate_kv_caches, build_attention_metadata  # noqa: E402
from replica.model import (  # noqa: E402
    DEFAULT_MODEL_DIRNAME,
    SUPPORTED_ARCHITECTURES,
    LlamaModel,
    ModelConfig,
    ModelLoadError,
    ensure_default_model,
    load_model_folder,
)
from replica.model.default_model import build_default_model_files  # noqa: E402
from replica.model.llama import linear_t, rope_inv_freq  # noqa: E402

PROMPTS = [
    "The harbour town woke before the sun.",
    "A",
    "Good writing is clear and direct. Say what you mean in as few words as you can, and choose the plain "
    "word over the fancy one. Read your sentences aloud; if you run out of breath, the sentence is too long.",
    "Zebras quietly juggle 42 émigré pianos — 🎹!",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # These models are tiny: with two OpenMP threads on a busy 2-core machine every matmul waits
    # on a barrier (measured 5 s vs 0.1 s for the decode test). Restored afterwards.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models") / DEFAULT_MODEL_DIRNAME)


@pytest.fixture(scope="session")
def ours_default(default_model_dir):
    return load_model_folder(default_model_dir)


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def prompt_ids(ours_default) -> list[list[int]]:
    return [ours_default.tokenizer.encode(p) for p in PROMPTS]


# ---------------------------------------------------------------------------------------------
# a minimal paged runner: block allocator + per-step metadata, as the engine will do it


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


# ---------------------------------------------------------------------------------------------
# the default model


def test_default_model_prefill_logits_match_transformers(ours_default, hf_default, prompt_ids):
    assert_prefill_matches(ours_default.model, hf_default, prompt_ids)


def test_default_model_paged_greedy_decode_is_token_identical_to_transformers_generate(
    ours_default, hf_default, prompt_ids
):
    outputs, _ = paged_greedy(ours_default.model, prompt_ids, 24)
    assert all(len(set(o)) > 5 for o in outputs), "the default model should not collapse onto one token"
    assert_decode_matches(ours_default.model, hf_default, prompt_ids, 24)


def test_default_model_never_greedily_emits_eos(ours_default, prompt_ids):
    outputs, _ = paged_greedy(ours_default.model, prompt_ids[:2], 48)
    eos = set(ours_default.tokenizer.eos_token_ids)
    assert eos and not eos.intersection(outputs[0] + outputs[1])


def test_default_model_shape_is_small_llama_with_gqa(ours_default, default_model_dir):
    cfg = ours_default.model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("LlamaForCausalLM", 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (8, 4, 688)
    assert cfg.vocab_size == ours_default.tokenizer.vocab_size
    assert cfg.max_position_embeddings == 4096 and not cfg.tie_word_embeddings
    num_params = sum(p.numel() for p in ours_default.model.parameters())
    assert 1_000_000 < num_params < 10_000_000


def test_hugging_face_named_weights_are_views_of_transposed_buffers(ours_default, default_model_dir):
    from safetensors.torch import load_file

    model = ours_default.model
    params = dict(model.named_parameters())
    checkpoint = load_file(default_model_dir / "model.safetensors")
    assert set(params) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(params[name], tensor), name
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    views = [
        (attn.q_proj, attn.qkv_weight_t), (attn.k_proj, attn.qkv_weight_t), (attn.v_proj, attn.qkv_weight_t),
        (attn.o_proj, attn.o_weight_t), (mlp.gate_proj, mlp.gate_weight_t), (mlp.up_proj, mlp.up_weight_t),
        (mlp.down_proj, mlp.down_weight_t), (model.lm_head, model.lm_head_weight_t),
    ]  # fmt: skip
    for linear, buffer in views:
        # [in, out] row-major, one copy: the [out, in] parameter is a view into it
        assert buffer.is_contiguous() and buffer.shape[0] == linear.in_features
        assert linear.weight.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert attn.qkv_weight_t.shape[1] == attn.q_proj.out_features + 2 * attn.k_proj.out_features


@pytest.mark.parametrize("rows", [1, 8, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_t_on_a_transposed_weight_computes_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    got = linear_t(x, weight.t().contiguous(), bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-6, atol=1e-5)


def test_default_model_generation_is_byte_identical(default_model_dir):
    again = build_default_model_files()
    assert again == build_default_model_files()
    for name, data in again.items():
        assert (default_model_dir / name).read_bytes() == data, name
    # Another process too (hash-map iteration order there differs: BPE training must not depend on it).
    code = (
        "import hashlib, json; from replica.model.default_model import build_default_model_files as b; "
        "print(json.dumps({k: hashlib.sha256(v).hexdigest() for k, v in b().items()}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {k: hashlib.sha256(v).hexdigest() for k, v in again.items()}


def test_ensure_default_model_keeps_an_existing_folder_and_fills_an_empty_one(default_model_dir, tmp_path):
    before = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(default_model_dir) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == before

    empty = tmp_path / "mounted"
    empty.mkdir()
    ensure_default_model(empty)
    assert sorted(p.name for p in empty.iterdir()) == sorted(build_default_model_files())

    cluttered = tmp_path / "cluttered"
    cluttered.mkdir()
    (cluttered / "notes.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="notes.txt"):
        ensure_default_model(cluttered)


# ---------------------------------------------------------------------------------------------
# tiny random Hugging Face checkpoints: Qwen2 (qkv bias, tied), Mistral, Llama with RoPE scaling


def _randomise_biases_and_norms(model, seed: int) -> None:
    # transformers initialises biases to 0 and norms to 1, which would hide a loader that drops them.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VARIANTS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, max_position_embeddings=512)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=256, max_position_embeddings=512)),
    "llama_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(max_position_embeddings=512, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}),
    ),
    "llama3_rope_attention_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            max_position_embeddings=512,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_yarn_rope_sharded": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_model_dir):
    """kind -> (folder, transformers model); each built on first use, then cached."""
    built: dict[str, tuple[Path, object]] = {}

    def get(kind: str) -> tuple[Path, object]:
        if kind not in built:
            config_cls, model_cls, extra = VARIANTS[kind]
            vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
            config = getattr(transformers, config_cls)(vocab_size=vocab, **TINY, **extra)
            with torch.random.fork_rng():
                torch.manual_seed(0)
                hf_model = getattr(transformers, model_cls)(config).eval()
            _randomise_biases_and_norms(hf_model, seed=1)
            folder = tmp_path_factory.mktemp(kind)
            hf_model.save_pretrained(folder, max_shard_size="200KB" if "sharded" in kind else "50GB")
            for name in TOKENIZER_FILES:
                shutil.copy(default_model_dir / name, folder / name)
            built[kind] = (folder, hf_model)
        return built[kind]

    return get


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_tiny_checkpoints_load_and_match_transformers_prefill_and_paged_decode(tiny_checkpoint, prompt_ids, kind):
    folder, hf_model = tiny_checkpoint(kind)
    if "sharded" in kind:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    ours = load_model_folder(folder).model
    assert_prefill_matches(ours, hf_model, prompt_ids)
    assert_decode_matches(ours, hf_model, prompt_ids[:3], 10)


def test_qwen2_config_implies_qkv_bias_and_ties_embeddings(tiny_checkpoint):
    folder, _ = tiny_checkpoint("qwen2")
    model = load_model_folder(folder).model
    assert model.config.attention_bias and not model.config.o_proj_bias
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head_weight_t is None  # a tied head is not copied into a transposed buffer


def test_mistral_sliding_window_caps_max_model_len(tiny_checkpoint):
    folder, _ = tiny_checkpoint("mistral")
    config = ModelConfig.from_folder(folder)
    assert config.architecture == "MistralForCausalLM"
    assert config.max_model_len == 256


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 4096,
         "beta_fast": 16, "mscale": 0.707, "mscale_all_dim": 0.707},
    ],  # fmt: skip
)
def test_rope_inverse_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=dict(rope)
    )
    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    ours = ModelConfig.from_dict(json.loads(hf_config.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    got, scale = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(scale, expected_scale, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------
# config parsing and load errors


def _llama_config(**overrides) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    return base | overrides


def test_config_defaults_and_v4_rope_scaling_spelling():
    cfg = ModelConfig.from_dict(
        _llama_config(
            eos_token_id=[7, 9, 7],
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
            torch_dtype="bfloat16",
        )
    )
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.num_queries_per_kv == 1
    assert cfg.eos_token_ids == (7, 9)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 2.0)
    assert cfg.torch_dtype == "bfloat16"
    assert not cfg.attention_bias and not cfg.o_proj_bias and cfg.sliding_window is None


def test_config_llama_attention_bias_covers_o_proj_and_qwen2_only_qkv():
    llama = ModelConfig.from_dict(_llama_config(attention_bias=True, eos_token_id=3))
    assert llama.attention_bias and llama.o_proj_bias and llama.eos_token_ids == (3,)
    qwen = ModelConfig.from_dict(_llama_config(architectures=["Qwen2ForCausalLM"], sliding_window=64))
    assert qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.sliding_window is None  # use_sliding_window is off


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"vocab_size": None}, "'vocab_size' is missing"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
    ],
)
def test_bad_configs_raise_model_load_error(overrides, message):
    raw = {k: v for k, v in _llama_config(**overrides).items() if v is not None}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(raw)


def test_unsupported_architecture_message_names_it_and_the_supported_ones(tmp_path, default_model_dir):
    folder = _linked_copy(default_model_dir, tmp_path / "gpt2")
    raw = json.loads((default_model_dir / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(raw | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as err:
        load_model_folder(folder)
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
def test_missing_file_message_names_the_file_and_the_folder(tmp_path, default_model_dir, missing):
    folder = _linked_copy(default_model_dir, tmp_path / "partial", skip=missing)
    with pytest.raises(ModelLoadError) as err:
        load_model_folder(folder)
    assert missing in str(err.value)
    assert str(folder) in str(err.value)


def test_missing_shard_listed_in_the_index_is_named(tmp_path, default_model_dir):
    folder = _linked_copy(default_model_dir, tmp_path / "sharded", skip="model.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002.safetensors"):
        load_model_folder(folder)


def test_missing_and_unexpected_weights_are_listed(tmp_path, default_model_dir):
    from safetensors.torch import load_file, save_file

    folder = _linked_copy(default_model_dir, tmp_path / "bad_weights", skip="model.safetensors")
    weights = load_file(default_model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.9.extra.weight"] = torch.zeros(2)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        load_model_folder(folder)
    message = str(err.value)
    assert "missing [model.layers.1.mlp.up_proj.weight]" in message
    assert "unexpected [model.layers.9.extra.weight]" in message
    assert "model.norm.weight (3,) (expected (256,))" in message


def _linked_copy(src: Path, dst: Path, skip: str | None = None) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != skip:
            os.symlink(f, dst / f.name)
    return dst


# ---------------------------------------------------------------------------------------------
# the tokenizer wrapper against transformers' AutoTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": " A memo of keys and values.\n"},
        {"role": "user", "content": "And a prefix? <|eot_id|> é 🎹"},
    ],
    [{"role": "system", "content": "Only a system prompt."}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours_default, hf_tokenizer, add_generation_prompt):
    for conversation in CONVERSATIONS:
        ours = ours_default.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        theirs = hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
        assert ours_default.tokenizer.encode(ours, add_special_tokens=False) == hf_tokenizer(
            ours, add_special_tokens=False
        ).input_ids


def test_chat_template_rejects_unknown_roles_like_transformers(ours_default, hf_tokenizer):
    from replica.model import ChatTemplateError

    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant"):
        ours_default.tokenizer.apply_chat_template(bad)
    with pytest.raises(Exception, match="roles must be system, user or assistant"):
        hf_tokenizer.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(ours_default, hf_tokenizer, add_special_tokens):
    tok = ours_default.tokenizer
    texts = [*PROMPTS, "", " leading space", "<|begin_of_text|>inline special<|eot_id|>", "line\n\n  tabs\t."]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_tokenizer_special_ids(ours_default, hf_tokenizer):
    tok = ours_default.tokenizer
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_ids[0] == hf_tokenizer.eos_token_id
    assert tok.eos_token_ids == (hf_tokenizer.eos_token_id, hf_tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    assert tok.vocab_size == len(hf_tokenizer)
    assert tok.encode("x")[0] == tok.bos_token_id
    assert "raise_exception" in (tok.chat_template or "")


def test_tokenizer_module_imports_no_torch():
    code = "import sys, kvroute.tokenizer, kvroute.model_folder; assert 'torch' not in sys.modules, 'torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "flags",
    [{}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}, {"add_eos_token": True}],
    ids=["absent", "no_bos", "bos_and_eos", "eos_only"],
)
def test_tokenizer_json_alone_decides_bos_and_eos_like_transformers(tmp_path, default_model_dir, flags):
    from replica.model import Tokenizer

    raw = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("add_bos_token", "add_eos_token")} | flags
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(raw))
    ours = Tokenizer.from_folder(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("plain text", ""):
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
