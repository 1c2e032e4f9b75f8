"""A prompt to token ids: the one definition the router, the replica frontend and the engine use
(DESIGN.md §3.3, §5). Torch-free.

    GenerateRequest / ScoreRequest ── prompt oneof ──▶ prompt_ids ──▶ list[int]
       text       text_ids: encode(text, add_special_tokens=True)      (the tokenizer's BOS rule)
       chat       chat_ids: encode(apply_chat_template(messages, add_generation_prompt=True),
                                   add_special_tokens=False)             (the template writes BOS itself)
       token_ids  as given (the vocabulary check is the caller's: the engine's validation on a
                  replica, :meth:`PromptTokenizer.check_ids` on the router)

The ids the router hashes must be the ids the replica computes, or prefix matches silently turn
into misses; both call these functions, with the tokenizer of the same model folder. A refused
prompt raises :class:`InvalidRequestError` naming the field (``prompt``, ``prompt.chat``,
``prompt.token_ids``): the gRPC status message, INVALID_ARGUMENT, on either side.

The model folder: ``--model``, or the default model the replicas generate
(``{model_cache_dir}/kvroute-tiny-llama``, :func:`default_model_dir`). The router never generates
it (that needs torch): when it is missing, :func:`resolve_model_dir` says to pass ``--model``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute.model_folder import ModelLoadError, read_json_file
from kvroute.tokenizer import TOKENIZER_FILENAME, ChatTemplateError, Tokenizer

DEFAULT_MODEL_DIRNAME = "kvroute-tiny-llama"
"""The folder (and served model) name of the default model ``replica.model.default_model`` generates."""
DEFAULT_MODEL_CACHE_DIR = "~/.cache/kvroute/models"
"""Where the default model lives unless ``model_cache_dir`` says otherwise."""


class InvalidRequestError(ValueError):
    """A request refused before anything is done with it: a bad prompt or a bad request value.

    ``field`` names the offending request field with the public API's spelling (``"prompt"``,
    ``"prompt.chat"``, ``"max_tokens"``, ...); ``reason`` says what is wrong in words a client can
    act on. ``str(err)`` is ``"{field}: {reason}"``, the INVALID_ARGUMENT status message. Survives
    pickling with both (process pipes).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.field, self.reason))


class UnknownModelError(LookupError):
    """A request names a model this server does not serve: NOT_FOUND (HTTP 404), message
    ``"model: 'x' is not served here (this server serves 'y')"``."""


def check_model(asked: object, served: str) -> None:
    """Refuse a request naming another model than ``served`` (the OpenAI body's ``model``, the
    ``GenerateRequest.model`` field); an empty or missing name means the served one.

    Raises:
        UnknownModelError: ``asked`` is set and is not ``served``.
    """
    if asked not in (None, "", served):
        raise UnknownModelError(f"model: {asked!r} is not served here (this server serves {served!r})")


def default_model_dir(model_cache_dir: str = "") -> Path:
    """The default model's folder in ``model_cache_dir`` (empty: :data:`DEFAULT_MODEL_CACHE_DIR`),
    ``~`` expanded; it may not exist yet."""
    return Path(model_cache_dir or DEFAULT_MODEL_CACHE_DIR).expanduser() / DEFAULT_MODEL_DIRNAME


def resolve_model_dir(model: str, model_cache_dir: str = "") -> Path:
    """An existing model folder whose tokenizer a torch-free process uses: ``model``, else the
    replicas' generated default model (:func:`default_model_dir`).

    Raises:
        ModelLoadError: ``model`` does not exist or is not a folder, or the folder has no
            ``tokenizer.json`` (with what to do about it).
    """
    if model:
        path = Path(model).expanduser()
        if not path.is_dir():
            what = "is not a folder" if path.exists() else "does not exist"
            raise ModelLoadError(f"model: {path} {what} (a Hugging Face model folder)", path=path)
        if not (path / TOKENIZER_FILENAME).is_file():
            raise ModelLoadError(f"model: {path} has no {TOKENIZER_FILENAME} (is it a Hugging Face model folder?)",
                                 path=path)
        return path
    path = default_model_dir(model_cache_dir)
    if not (path / TOKENIZER_FILENAME).is_file():
        raise ModelLoadError(
            f"model: the default model {path} does not exist yet (a replica generates it on its first start);"
            " start a replica with the same --model-cache-dir first, or pass --model with the replicas' model folder",
            path=path,
        )
    return path


def text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A text prompt's ids: ``encode(text, add_special_tokens=True)`` (the tokenizer's BOS rule).

    Raises:
        InvalidRequestError: ``prompt`` when ``text`` is empty (it would encode to a lone BOS).
    """
    if not text:
        raise InvalidRequestError("prompt", "must contain at least one token")
    return tokenizer.encode(text, add_special_tokens=True)


def chat_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A conversation rendered with the chat template (``add_generation_prompt=True``), encoded
    without adding special tokens (the template writes BOS; adding it again would double it).

    Raises:
        InvalidRequestError: ``prompt.chat`` when there is no message or the template refuses the
            conversation (its message).
    """
    if not messages:
        raise InvalidRequestError("prompt.chat", "must contain at least one message")
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    except ChatTemplateError as e:
        raise InvalidRequestError("prompt.chat", str(e)) from e
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer: Tokenizer, request: Any) -> list[int]:
    """The ``prompt`` oneof of a ``GenerateRequest`` or ``ScoreRequest`` as token ids (the table
    in the module docstring). ``token_ids`` are returned unchecked against the vocabulary.

    Raises:
        InvalidRequestError: ``prompt`` (none set, or no token), ``prompt.chat`` (see :func:`chat_ids`).
    """
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")
    if kind == "text":
        ids = text_ids(tokenizer, request.text)
    elif kind == "chat":
        ids = chat_ids(tokenizer, [{"role": m.role, "content": m.content} for m in request.chat.messages])
    else:
        ids = list(request.token_ids.ids)
    if not ids:
        raise InvalidRequestError("prompt", "must contain at least one token")
    return ids


class PromptTokenizer:
    """A model folder's tokenizer plus the model facts a process without the engine (the router)
    checks prompts against. Immutable; ``token_ids`` is safe from any thread.

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

    def token_ids(self, request: Any, vocab_size: int | None = None) -> list[int]:
        """:func:`prompt_ids`, with given ``token_ids`` checked against the vocabulary
        (``vocab_size``: the one to check against, default the model folder's).

        Raises:
            InvalidRequestError: as :func:`prompt_ids`; ``prompt.token_ids`` for an id outside the
                vocabulary.
        """
        ids = prompt_ids(self.tokenizer, request)
        if request.WhichOneof("prompt") == "token_ids":
            self.check_ids(ids, vocab_size)
        return ids

    def check_ids(self, ids: Sequence[int], vocab_size: int | None = None) -> None:
        """Every id in ``[0, vocab_size)`` (default the model folder's ``vocab_size``; the replica
        engine's message for the first that is not)."""
        vocab = self.vocab_size if vocab_size is None else vocab_size
        if ids and max(ids) >= vocab:  # ids are uint32 on the wire: never negative
            i, tok = next((i, t) for i, t in enumerate(ids) if t >= vocab)
            raise InvalidRequestError("prompt.token_ids", f"token id {tok!r} at index {i} is out of vocabulary [0, {vocab})")


__all__ = [
    "DEFAULT_MODEL_CACHE_DIR",
    "DEFAULT_MODEL_DIRNAME",
    "InvalidRequestError",
    "PromptTokenizer",
    "UnknownModelError",
    "chat_ids",
    "check_model",
    "default_model_dir",
    "prompt_ids",
    "resolve_model_dir",
    "text_ids",
]
