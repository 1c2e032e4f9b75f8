"""The tokenizer wrapper (``kvroute.tokenizer.Tokenizer``) against transformers' AutoTokenizer on
the default model: chat template, encode / decode, special ids, BOS / EOS flags."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from kvroute.tokenizer import ChatTemplateError, Tokenizer  # noqa: E402
from tests.replica.model._support import PROMPTS  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


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
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, add_generation_prompt):
    for conversation in CONVERSATIONS:
        ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        theirs = hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
        assert tokenizer.encode(ours, add_special_tokens=False) == hf_tokenizer(
            ours, add_special_tokens=False
        ).input_ids


def test_chat_template_rejects_unknown_roles_like_transformers(tokenizer, hf_tokenizer):
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="roles must be system, user or assistant"):
        tokenizer.apply_chat_template(bad)
    with pytest.raises(Exception, match="roles must be system, user or assistant"):
        hf_tokenizer.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    tok = tokenizer
    texts = [*PROMPTS, "", " leading space", "<|begin_of_text|>inline special<|eot_id|>", "line\n\n  tabs\t."]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_tokenizer_special_ids(tokenizer, hf_tokenizer):
    tok = tokenizer
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_ids[0] == hf_tokenizer.eos_token_id
    assert tok.eos_token_ids == (hf_tokenizer.eos_token_id, hf_tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    assert tok.vocab_size == len(hf_tokenizer)
    assert tok.encode("x")[0] == tok.bos_token_id
    assert "raise_exception" in (tok.chat_template or "")


def test_tokenizer_module_imports_no_torch():
    code = "import sys, kvroute.tokenizer, kvroute.model_folder; assert 'torch' not in sys.modules, 'torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "flags",
    [{}, {"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}, {"add_eos_token": True}],
    ids=["absent", "no_bos", "bos_and_eos", "eos_only"],
)
def test_tokenizer_json_alone_decides_bos_and_eos_like_transformers(tmp_path, default_model_dir, flags):
    raw = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("add_bos_token", "add_eos_token")} | flags
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(raw))
    ours = Tokenizer.from_folder(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("plain text", ""):
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
