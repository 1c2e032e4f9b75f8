"""Models: Hugging Face Llama-family folders (Llama, Mistral, Qwen2) in, a paged-attention
``LlamaModel`` and a ``Tokenizer`` out.

Consumes: a folder with ``config.json``, ``*.safetensors`` and ``tokenizer.json`` /
``tokenizer_config.json`` (``load_model_folder``); ``ensure_default_model`` generates the small
deterministic default checkpoint in that same format. Guarantees: weights load strictly by
Hugging Face name (any mismatch is a ``ModelLoadError`` naming it), the forward matches
transformers' numerics, and every failure to load is a ``ModelLoadError`` naming file and folder.

``config`` imports no torch (the tokenizer and the folder errors live in ``kvroute``, shared with
the router); the torch-based names below (``llama`` with ``rope``, ``loader``, ``default_model``)
are imported on first use.

Imports: ``kvroute`` (tokenizer, model-folder errors), ``replica.attention``, torch, safetensors,
tokenizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.model_folder import ModelLoadError
from kvroute.tokenizer import ChatTemplateError, Tokenizer
from replica.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

if TYPE_CHECKING:
    from replica.model.default_model import DEFAULT_MODEL_DIRNAME, ensure_default_model
    from replica.model.llama import LlamaModel
    from replica.model.loader import LoadedModel, load_model_folder

_LAZY = {
    "DEFAULT_MODEL_DIRNAME": "replica.model.default_model",
    "ensure_default_model": "replica.model.default_model",
    "LlamaModel": "replica.model.llama",
    "LoadedModel": "replica.model.loader",
    "load_model_folder": "replica.model.loader",
}

__all__ = [
    "DEFAULT_MODEL_DIRNAME",
    "SUPPORTED_ARCHITECTURES",
    "ChatTemplateError",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeScaling",
    "Tokenizer",
    "ensure_default_model",
    "load_model_folder",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'replica.model' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
