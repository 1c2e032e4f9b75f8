"""Load a Hugging Face model folder into a ``LlamaModel`` and its ``Tokenizer``.

Folder contents read: ``config.json``, the weights (``model.safetensors.index.json`` and its
shards, else ``model.safetensors``, else every ``*.safetensors`` but Mistral's
``consolidated*.safetensors``), ``tokenizer.json``, ``tokenizer_config.json`` (and optionally
``chat_template.jinja``, ``special_tokens_map.json``, ``generation_config.json``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from kvroute.model_folder import ModelLoadError, read_json_file
from kvroute.tokenizer import Tokenizer
from replica.attention.backend import AttentionBackend
from replica.attention.selector import select_backend
from replica.model.config import ModelConfig
from replica.model.llama import LlamaModel

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LoadedModel(NamedTuple):
    """What ``load_model_folder`` returns; unpacks as ``model, tokenizer``."""

    model: LlamaModel
    tokenizer: Tokenizer


def load_model_folder(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    *,
    attn_backend: str | AttentionBackend = "auto",
    block_size: int | None = None,
) -> LoadedModel:
    """Load the model (in eval mode, no grads, on ``device`` in ``dtype``) and its tokenizer.

    Args:
        path: the model folder.
        device: where the weights go.
        dtype: floating dtype of the weights, or ``"auto"`` for the config's ``torch_dtype``
            (float32 when it has none), or one of ``"float32" / "float16" / "bfloat16"``.
        attn_backend: an ``AttentionBackend``, or a name for ``select_backend``
            (``auto`` / ``torch`` / ``flash_attn`` / ``triton``).
        block_size: the KV block size, so that ``auto`` only picks a backend that supports it.

    Raises:
        ModelLoadError: the folder or a required file is missing (the message names the file and
            the folder), the architecture or a config field is unsupported, the tokenizer has more
            ids than the model's vocabulary, or the weights don't match the architecture.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist or is not a directory", path=folder)
    config = ModelConfig.from_folder(folder)
    files = safetensors_files(folder)
    tokenizer = Tokenizer.from_folder(folder)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"model folder {folder}: tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{config.vocab_size}",
            path=folder,
        )
    dtype = _resolve_dtype(dtype, config, folder)
    device = torch.device(device)
    backend = (
        select_backend(device, attn_backend, block_size=block_size, dtype=dtype)
        if isinstance(attn_backend, str)
        else attn_backend
    )
    # Built on the meta device: no memory is allocated (or randomly initialised) for weights that
    # the checkpoint replaces right after.
    with torch.device("meta"):
        model = LlamaModel(config, backend)
    model.load_weights(_read_tensors(files, device, dtype), source=str(folder))
    model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder, in load order; ``ModelLoadError`` names the missing file."""
    index_path = folder / INDEX_FILENAME
    if index_path.is_file():
        weight_map = read_json_file(index_path, folder).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{INDEX_FILENAME} in model folder {folder} has no weight_map", path=index_path)
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(
                    f"model folder {folder} has no {file.name} (a shard listed in {INDEX_FILENAME})", path=file
                )
        return files
    single = folder / SINGLE_FILENAME
    if single.is_file():
        return [single]
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(
            f"model folder {folder} has no {SINGLE_FILENAME} (nor {INDEX_FILENAME} or other *.safetensors)",
            path=single,
        )
    return files


def _read_tensors(files: list[Path], device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of ``files`` read by safetensors straight onto ``device`` (no host copy of the
    model on the way to a GPU), floating ones then cast to ``dtype`` there."""
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
        except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
            raise ModelLoadError(f"{file.name} in model folder {file.parent} is not a safetensors file: {exc}",
                                 path=file) from exc  # fmt: skip
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                yield name, tensor.to(dtype=target_dtype)


def _resolve_dtype(dtype: torch.dtype | str, config: ModelConfig, folder: Path) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ModelLoadError(
            f"model folder {folder}: dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}", path=folder
        )
    return _DTYPES[name]
