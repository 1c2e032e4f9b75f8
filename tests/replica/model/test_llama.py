"""LlamaModel on the default model against transformers (the numerics reference).

Prefill logits must match transformers to 1e-4 and greedy decoding through the paged KV cache
(``_support.PagedRunner``) must be token-identical to ``generate(do_sample=False)``. Tiny random
Qwen2 / Mistral / Llama checkpoints are in test_checkpoints.py, config parsing and load errors in
test_config.py, the tokenizer in tests/kvroute/test_tokenizer.py, the default model's files in
test_default_model.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from replica.model.llama import linear_t  # noqa: E402
from tests.replica.model._support import assert_decode_matches, assert_prefill_matches, paged_greedy  # noqa: E402


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
    assert cfg.max_position_embeddings == 8192 and not cfg.tie_word_embeddings
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
