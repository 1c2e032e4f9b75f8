"""Config parsing (``ModelConfig``) and the ``ModelLoadError`` of each way a folder can be wrong:
every message names the file, the folder, the weights or the setting at fault."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from replica.model import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, load_model_folder


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
