"""Tiny random Hugging Face checkpoints against transformers: Qwen2 (qkv bias, tied embeddings),
Mistral (sliding window), Llama with linear / llama3 / yarn RoPE scaling, attention bias and sharded
weights; and the RoPE inverse frequencies against transformers' for each scaling."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from replica.model import ModelConfig, load_model_folder  # noqa: E402
from replica.model.rope import rope_inv_freq  # noqa: E402
from tests.replica.model._support import (  # noqa: E402
    TOKENIZER_FILES,
    assert_decode_matches,
    assert_prefill_matches,
)


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
