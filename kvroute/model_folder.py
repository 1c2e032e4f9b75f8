"""Reading a Hugging Face model folder: the error type and the JSON files (shared, torch-free).

The replica's model loader and the tokenizer (used by the router too) both read model folders;
every failure is a ``ModelLoadError`` naming the file and the folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A model folder can't be turned into a model: a missing file, an unsupported architecture or
    RoPE type, a malformed ``config.json``, or weights that don't fit the architecture.

    The message names what is wrong and where (file and folder); ``path`` is the file or folder
    concerned when there is one.
    """

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


def read_json_file(path: Path, folder: Path) -> dict[str, Any]:
    """Parse a JSON object file of a model folder; ``ModelLoadError`` names the file and the folder
    when it is missing or malformed."""
    if not path.is_file():
        raise ModelLoadError(f"model folder {folder} has no {path.name}", path=path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path.name} in model folder {folder} is not valid JSON: {exc}", path=path) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} in model folder {folder} is not a JSON object", path=path)
    return data
