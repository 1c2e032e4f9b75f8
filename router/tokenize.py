"""Prompts to token ids exactly as the replicas compute them (DESIGN.md §5). Torch-free.

    GenerateRequest / ScoreRequest ── prompt oneof ──▶ PromptTokenizer.token_ids ──▶ list[int]
       text       encode(text, add_special_tokens=True)          (the tokenizer's BOS rule)
       chat       encode(apply_chat_template(messages, add_generation_prompt=True),
                         add_special_tokens=False)                 (the template writes BOS itself)
       token_ids  as given, checked against the model's vocab_size

This mirrors ``replica.service.prompt_of`` / ``ReplicaFrontend._tokens_of`` and
``LLMEngine.make_request`` line for line: the ids the router hashes must be the ids the replica
computes, or prefix matches silently turn into misses. Errors are the replica's too, with the same
field names (``prompt``, ``prompt.chat``, ``prompt.token_ids``) and messages.

The tokenizer must come from the replicas' model folder: ``--model``, or the default model the
replicas generate (``{model_cache_dir}/kvroute-tiny-llama``). The router never generates it (that
needs torch): when it is missing, :func:`resolve_model_dir` says to pass ``--model``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.model_folder import ModelLoadError, read_json_file
from kvroute.tokenizer import TOKENIZER_FILENAME, ChatTemplateError, Tokenizer

# replica.model.default_model.DEFAULT_MODEL_DIRNAME, not imported (that module imports torch);
# tests/test_router_chat.py pins the two equal.
DEFAULT_MODEL_DIRNAME = "kvroute-tiny-llama"
DEFAULT_MODEL_CACHE_DIR = "~/.cache/kvroute/models"


class InvalidRequestError(ValueError):
    """A request the router refuses before routing it. ``str(err)`` is ``"{field}: {reason}"``, the
    gRPC status message (INVALID_ARGUMENT), as on the replica."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def resolve_model_dir(model: str, model_cache_dir: str = "") -> Path:
    """The model folder whose tokenizer the router uses: ``model``, else the replicas' generated
    default model in ``model_cache_dir`` (default ``~/.cache/kvroute/models``), as
    ``replica.server.resolve_model_dir`` resolves it.

    Raises:
        ModelLoadError: the folder has no ``tokenizer.json`` (with what to do about it).
    """
    if model:
        path = Path(model).expanduser()
        if not (path / TOKENIZER_FILENAME).is_file():
            raise ModelLoadError(f"model: {path} has no {TOKENIZER_FILENAME} (is it a Hugging Face model folder?)",
                                 path=path)
        return path
    cache = Path(model_cache_dir or DEFAULT_MODEL_CACHE_DIR).expanduser()
    path = cache / DEFAULT_MODEL_DIRNAME
    if not (path / TOKENIZER_FILENAME).is_file():
        raise ModelLoadError(
            f"model: the default model {path} does not exist yet (a replica generates it on its first start);"
            " start a replica with the same --model-cache-dir first, or pass --model with the replicas' model folder",
            path=path,
        )
    return path


class PromptTokenizer:
    """The replicas' tokenizer plus the model facts the router checks prompts against.

    Immutable; ``token_ids`` is safe from any thread.

    Args:
        tokenizer: the model folder's tokenizer.
        vocab_size: the model's ``vocab_size`` (config.json; may exceed the tokenizer's).
        model_name: the folder name (what ``GetModelInfo`` reports without a replica).
        max_model_len: the model's ``max_position_embeddings`` (replicas may hold less).
    """

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, model_name: str = "", max_model_len: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.max_model_len = max_model_len

    @classmethod
    def from_folder(cls, folder: str | Path) -> PromptTokenizer:
        """Load a model folder's tokenizer and ``config.json`` facts.

        Raises:
            ModelLoadError: a required file is missing or malformed.
        """
        folder = Path(folder)
        tok = Tokenizer.from_folder(folder)
        config: dict[str, Any] = read_json_file(folder / "config.json", folder) if (folder / "config.json").is_file() else {}
        vocab = config.get("vocab_size")
        vocab_size = max(int(vocab), tok.vocab_size) if isinstance(vocab, int) else tok.vocab_size
        max_len = config.get("max_position_embeddings")
        return cls(tok, vocab_size=vocab_size, model_name=folder.name,
                   max_model_len=int(max_len) if isinstance(max_len, int) else 0)

    def token_ids(self, request: Any) -> list[int]:
        """The prompt of a ``GenerateRequest`` or ``ScoreRequest`` (same ``prompt`` oneof) as ids.

        Raises:
            InvalidRequestError: ``prompt`` (none set, or empty), ``prompt.chat`` (no message, or
                the template refused the conversation), ``prompt.token_ids`` (an id outside the
                vocabulary).
        """
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("prompt", "must contain at least one token")
            ids = self.tokenizer.encode(request.text, add_special_tokens=True)
        elif kind == "chat":
            ids = self.chat_ids([{"role": m.role, "content": m.content} for m in request.chat.messages])
        else:
            ids = list(request.token_ids.ids)
            self.check_ids(ids)
        if not ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        return ids

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation rendered with the chat template, encoded without adding special tokens
        (the template writes BOS; adding it again would double it)."""
        if not messages:
            raise InvalidRequestError("prompt.chat", "must contain at least one message")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        except ChatTemplateError as e:
            raise InvalidRequestError("prompt.chat", str(e)) from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: Sequence[int]) -> None:
        """Every id in ``[0, vocab_size)`` (the replica's message for the first that is not)."""
        vocab = self.vocab_size
        if ids and max(ids) >= vocab:  # ids are uint32 on the wire: never negative
            i, tok = next((i, t) for i, t in enumerate(ids) if t >= vocab)
            raise InvalidRequestError("prompt.token_ids", f"token id {tok!r} at index {i} is out of vocabulary [0, {vocab})")


__all__ = ["DEFAULT_MODEL_DIRNAME", "InvalidRequestError", "PromptTokenizer", "resolve_model_dir"]
