"""The one error type of model loading. Pure Python: the tokenizer (torch-free) raises it too."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(Exception):
    """A model folder can't be turned into a model: a missing file, an unsupported architecture or
    RoPE type, a malformed ``config.json``, or weights that don't fit the architecture.

    The message names what is wrong and where (file and folder); ``path`` is the file or folder
    concerned when there is one.
    """

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
