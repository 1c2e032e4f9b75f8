"""Fixtures of the model tests: the default model (ours and transformers'), its tokenizer, the
prompts as token ids; every module runs torch on one thread (``tests.support.one_torch_thread``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replica.model import DEFAULT_MODEL_DIRNAME, ensure_default_model, load_model_folder
from tests.replica.model._support import PROMPTS
from tests.support import one_torch_thread  # noqa: F401  (an autouse fixture, for every module here)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models") / DEFAULT_MODEL_DIRNAME)


@pytest.fixture(scope="session")
def ours_default(default_model_dir):
    return load_model_folder(default_model_dir)


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompt_ids(ours_default) -> list[list[int]]:
    return [ours_default.tokenizer.encode(p) for p in PROMPTS]
