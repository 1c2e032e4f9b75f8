"""A Llama checkpoint of any shape with random weights, written as a Hugging Face folder (no
download): the default model's tokenizer files, a ``config.json`` with the given shape, and one
safetensors shard per layer (plus one for the embeddings, final norm and LM head) with an index.

The parameter names and shapes come from ``LlamaModel`` itself, built on the meta device from the
config, so the folder always loads. Weights are drawn on ``device`` (a GPU draws 8B parameters in
a moment) in ``dtype``: projections N(0, 0.02), norms 1.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from replica.model.config import ModelConfig
from replica.model.default_model import ensure_default_model
from replica.model.llama import LlamaModel
from replica.model.loader import INDEX_FILENAME

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class LlamaShape:
    """The config.json fields that set a Llama's size."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 500000.0


# Llama 3.1 8B's shape (its config.json).
LLAMA_8B = LlamaShape(4096, 14336, 32, 32, 8, 128256, 8192)
# The same proportions, small enough for a CPU dry run.
LLAMA_TINY = LlamaShape(256, 512, 2, 8, 2, 1024, 2048)


def write_synthetic_llama(
    folder: Path, shape: LlamaShape, *, dtype: torch.dtype, device: str, seed: int = 0, tokenizer_dir: Path | None = None
) -> int:
    """Write the checkpoint into ``folder`` (created; must not exist) and return its weight bytes.
    ``tokenizer_dir``: a default-model folder to take the tokenizer files from (default: generate
    one next to ``folder``).

    Raises:
        FileExistsError: ``folder`` exists.
    """
    folder.mkdir(parents=True)
    tokenizer_src = tokenizer_dir or ensure_default_model(folder.parent / f".{folder.name}-tokenizer")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_src / name, folder / name)
    base = json.loads((tokenizer_src / "config.json").read_text())
    config = {**base, **shape.__dict__, "head_dim": shape.hidden_size // shape.num_attention_heads,
              "torch_dtype": str(dtype).removeprefix("torch."), "rope_scaling": None}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with torch.device("meta"):
        params = dict(LlamaModel(ModelConfig.from_folder(folder)).named_parameters())
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: dict[str, list[str]] = {}
    for name in params:
        parts = name.split(".")
        key = f"layer-{int(parts[2]):03d}" if parts[:2] == ["model", "layers"] else "other"
        shards.setdefault(key, []).append(name)
    weight_map, total = {}, 0
    for key, names in shards.items():
        tensors = {}
        for name in names:
            shape_ = tuple(params[name].shape)
            if name.endswith("norm.weight"):
                t = torch.ones(shape_, dtype=dtype, device=device)
            else:
                t = (torch.randn(shape_, generator=gen, dtype=torch.float32, device=device) * 0.02).to(dtype)
            tensors[name] = t.cpu()
            total += t.numel() * t.element_size()
        file = f"model-{key}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILENAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total
