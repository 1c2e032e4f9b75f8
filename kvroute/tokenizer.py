"""Text <-> token ids and chat-template rendering for a Hugging Face model folder.

Deliberately free of torch (only ``tokenizers``, ``jinja2`` and ``json``): the router and the
replica turn prompts into ids with it, through ``kvroute.prompt``, so that the token ids the router
hashes are the ids the replica computes.

Reference semantics are transformers v5's fast tokenizer (``TokenizersBackend``):

- ``tokenizer.json`` is the tokenizer, and its post-processor alone decides which special tokens
  ``encode(add_special_tokens=True)`` adds (BOS for Llama 3 and Mistral, none for Qwen2).
  ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` are ignored, as transformers
  v5 ignores them whenever a ``tokenizer.json`` exists.
- The chat template comes from ``chat_template.jinja`` when present, else from
  ``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used).
  It is rendered in a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``,
  ``trim_blocks`` + ``lstrip_blocks``, loop controls) with ``raise_exception``, ``strftime_now``,
  a non-escaping ``tojson``, and the special tokens (``bos_token``, ``eos_token``, ...) in scope.
- A rendered chat normally starts with the BOS text already, so encode it with
  ``add_special_tokens=False`` (as ``apply_chat_template(tokenize=True)`` does).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvroute.model_folder import ModelLoadError, read_json_file

TOKENIZER_FILENAME = "tokenizer.json"
TOKENIZER_CONFIG_FILENAME = "tokenizer_config.json"
CHAT_TEMPLATE_FILENAME = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization: undo the spaces a WordPiece decoder puts before punctuation.
_CLEANUP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


class ChatTemplateError(ValueError):
    """The conversation can't be rendered: the model has no chat template, a message is not a
    mapping, or the template rejected the conversation (its ``raise_exception`` message)."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model-folder facts around it: special tokens, the EOS
    set, the BOS rule and the chat template.

    Immutable after construction; safe to share between threads for ``encode`` / ``decode`` /
    ``apply_chat_template`` (the backend tokenizer is only read).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        """``special_tokens`` maps ``bos_token`` / ``eos_token`` / ... to token strings;
        ``extra_eos_token_ids`` adds stop ids beyond ``eos_token`` (from ``generation_config.json``
        / ``config.json``). Raises ``ModelLoadError`` when the chat template does not compile."""
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._chat_template = chat_template
        self._template = _compile_chat_template(chat_template) if chat_template else None
        bos, eos = self._special_tokens.get("bos_token"), self._special_tokens.get("eos_token")
        self._bos_token_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        self._eos_token_ids = tuple(
            dict.fromkeys(([eos_id] if eos_id is not None else []) + [int(i) for i in extra_eos_token_ids])
        )
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load from a Hugging Face model folder: ``tokenizer.json`` and ``tokenizer_config.json``
        (required), ``chat_template.jinja``, ``special_tokens_map.json``, ``generation_config.json``
        and ``config.json`` (optional; the last two add EOS ids).

        Raises ``ModelLoadError`` naming the file and the folder when a required file is missing
        or a file is malformed.
        """
        folder = Path(folder)
        tok_path = folder / TOKENIZER_FILENAME
        if not tok_path.is_file():
            raise ModelLoadError(f"model folder {folder} has no {TOKENIZER_FILENAME}", path=tok_path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ModelLoadError(f"{TOKENIZER_FILENAME} in model folder {folder} is invalid: {exc}", path=tok_path) from exc
        tok_config = _read_json(folder / TOKENIZER_CONFIG_FILENAME, folder, required=True)
        special = {k: _token_content(v) for k, v in _read_json(folder / "special_tokens_map.json", folder).items()}
        special.update({k: _token_content(tok_config[k]) for k in _SPECIAL_TOKEN_KEYS if k in tok_config})
        special = {k: v for k, v in special.items() if k in _SPECIAL_TOKEN_KEYS and v}

        template_path = folder / CHAT_TEMPLATE_FILENAME
        if template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(tok_config.get("chat_template"))

        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(folder / name, folder).get("eos_token_id")
            extra_eos += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        try:
            return cls(
                backend,
                special_tokens=special,
                chat_template=chat_template,
                extra_eos_token_ids=extra_eos,
                clean_up_tokenization_spaces=bool(tok_config.get("clean_up_tokenization_spaces", False)),
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"model folder {folder}: {exc}", path=folder) from exc

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token``, or ``None`` when the model has none."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: ``eos_token`` first, then those of ``generation_config.json`` and
        ``config.json``, without duplicates."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template, or ``None``."""
        return self._chat_template

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` / ``eos_token`` / ... -> token string (the variables the template sees)."""
        return dict(self._special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs ``tokenizer.json``'s post-processor
        (which adds BOS for Llama-style models; see the module doc)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, chat markers) dropped when asked."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation (``[{"role": ..., "content": ...}, ...]``) to the prompt text.

        Keys whose value is ``None`` are dropped from messages first (as transformers does).
        ``template_kwargs`` are extra template variables and override the special tokens.
        Raises ``ChatTemplateError`` when there is no template, a message is not a mapping, or
        the template raises.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{i}] is a {type(message).__name__}, not a mapping")
            chat.append({k: v for k, v in message.items() if v is not None})
        variables = {**self._special_tokens, **template_kwargs}
        try:
            return self._template.render(
                messages=chat,
                tools=list(tools) if tools is not None else None,
                documents=list(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
    transformers); here it just renders its body, so such templates still compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Chat templates ship with model folders from the Hub: untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc


def _token_content(value: Any) -> str | None:
    # Older configs store special tokens as {"content": "<s>", "__type": "AddedToken", ...}.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return None


def _read_json(path: Path, folder: Path, *, required: bool = False) -> dict[str, Any]:
    if not required and not path.is_file():
        return {}
    return read_json_file(path, folder)
