"""OpenAI's JSON <-> our types: the request and response shapes of the OpenAI-compatible HTTP API
(DESIGN.md §3.3), shared by the router's and the replicas' HTTP fronts (``kvroute.openai_http``).

    POST /v1/completions       body ──▶ completion_requests ──▶ [GenerateRequest]   (a batch: one per prompt)
    POST /v1/chat/completions  body ──▶ chat_request        ──▶ GenerateRequest (chat: the template's ids)
    GenerateResponse deltas ──▶ Shaper.chunk / Shaper.final / Shaper.body ──▶ OpenAI JSON
    (gRPC status name, message) ──▶ error_response ──▶ (HTTP status, OpenAI error JSON)

Only the JSON's *shape* is checked here (types, and what our wire cannot carry, like a negative
``max_tokens``): every value check is the one the gRPC API runs (``kvroute.prompt`` and the
engine's ``SamplingParams.validate``), so HTTP and gRPC refuse the same inputs with the same words.
Fields we do not implement and that change the answer (``logprobs``, ``n`` > 1, ``echo``, ...) are
refused naming the field; unknown fields are ignored, as OpenAI does. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.prompt import InvalidRequestError
from kvroute.responses import FINISH_REASONS
from kvroute.sampling import ROOM_LEFT
from kvroute.v1 import generation_pb2 as gen_pb

# Fields that would change the answer and that we do not implement: accepted only at these values.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "suffix": (None, ""),
    # vLLM's extensions that change the answer and that we do not implement
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}

# HTTP status and OpenAI error type of each gRPC status our calls end with.
_HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


def _get(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise InvalidRequestError(name, f"must be {what}, got {value!r}")
    if not isinstance(value, kind):
        raise InvalidRequestError(name, f"must be {what}, got {value!r}")
    return value


def _unsigned(body: Mapping[str, Any], name: str, field: str | None = None, *, least: int = 0) -> int | None:
    """An int the wire carries unsigned, refused here below ``least`` (a negative one cannot reach
    the engine; ``max_tokens`` passes ``least=1`` so that -5 and 0 get the engine's one message)."""
    value = _get(body, name, int, "an integer")
    if value is not None and value < least:
        raise InvalidRequestError(field or name, f"must be at least {least}, got {value}")
    return value


def _unsupported_reason(value: Any, allowed: tuple[Any, ...]) -> str:
    """In words: a feature whose only accepted values are "off" (False, 0, empty) is not supported;
    ``n``/``best_of`` name the one value accepted."""
    on = [a for a in allowed if a]
    if not on:
        return "not supported by this server"
    return f"only {' or '.join(repr(a) for a in on)} is supported by this server, got {value!r}"


def _check_supported(body: Mapping[str, Any]) -> None:
    for name, allowed in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
            raise InvalidRequestError(name, _unsupported_reason(value, allowed))
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") not in (None, "text")):
        raise InvalidRequestError("response_format", f"only {{'type': 'text'}} is supported, got {fmt!r}")


def sampling_from_body(body: Mapping[str, Any], *, chat: bool) -> gen_pb.SamplingParams:
    """The ``SamplingParams`` of a request body: ``max_tokens`` (chat: ``max_completion_tokens``
    first; a chat body without either gets :data:`kvroute.sampling.ROOM_LEFT`, the room the prompt
    leaves, as vLLM does; a completions body keeps OpenAI's and vLLM's 16), ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, the penalties
    (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``), ``stop``
    (a string or a list), ``stop_token_ids``, ``ignore_eos``; unset fields keep the engine's defaults.

    Raises:
        InvalidRequestError: a field of the wrong type (naming it); ``n`` > 1, ``logprobs`` and the
            other fields in ``_UNSUPPORTED`` at a value we do not implement.
    """
    _check_supported(body)
    sp = gen_pb.SamplingParams()
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    for name, field, least in ((max_name, "max_tokens", 1), ("min_tokens", "min_tokens", 0)):
        value = _unsigned(body, name, least=least)
        if value is not None:
            setattr(sp, field, value)
    if chat and not sp.HasField("max_tokens"):  # OpenAI's chat API has no 16-token default: the room left
        sp.max_tokens = ROOM_LEFT
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _get(body, name, (int, float), "a number")
        if value is not None:
            setattr(sp, name, float(value))
    top_k = _get(body, "top_k", int, "an integer")
    if top_k is not None:
        sp.top_k = top_k
    seed = _unsigned(body, "seed")
    if seed is not None:
        sp.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop", f"must be a string or a list of strings, got {stop!r}")
        sp.stop.extend(stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                     for i in stop_ids):
            raise InvalidRequestError("stop_token_ids", f"must be a list of token ids, got {stop_ids!r}")
        sp.stop_token_ids.extend(stop_ids)
    ignore_eos = _get(body, "ignore_eos", bool, "true or false")
    if ignore_eos is not None:
        sp.ignore_eos = ignore_eos
    return sp


def _base_request(body: Mapping[str, Any], *, chat: bool) -> gen_pb.GenerateRequest:
    salt = _get(body, "cache_salt", str, "a string")
    model = _get(body, "model", str, "a string")
    return gen_pb.GenerateRequest(sampling=sampling_from_body(body, chat=chat), cache_salt=salt or "",
                                  model=model or "")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def completion_requests(body: Mapping[str, Any]) -> list[gen_pb.GenerateRequest]:
    """``/v1/completions``: one ``GenerateRequest`` per prompt of ``prompt`` (a string, a list of
    token ids, or a list of either); an empty string or list reaches ``kvroute.prompt`` as it is
    (``prompt: must contain at least one token``).

    Raises:
        InvalidRequestError: ``prompt`` missing or of another shape, a negative token id, or a bad
            sampling field (:func:`sampling_from_body`).
    """
    base = _base_request(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of either"
                                            f" (got {type(prompt).__name__})")
    requests = []
    for p in prompts:
        req = gen_pb.GenerateRequest()
        req.CopyFrom(base)
        if isinstance(p, str):
            req.text = p
        else:
            if any(i < 0 for i in p):
                raise InvalidRequestError("prompt", f"token ids must be at least 0, got {min(p)}")
            req.token_ids.SetInParent()
            req.token_ids.ids.extend(p)
        requests.append(req)
    return requests


def _content(i: int, content: Any) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")


def chat_request(body: Mapping[str, Any]) -> gen_pb.GenerateRequest:
    """``/v1/chat/completions``: the ``chat`` prompt of ``messages`` (role + content; content a
    string or a list of text parts), rendered by ``kvroute.prompt.chat_ids`` where it is served.

    Raises:
        InvalidRequestError: ``messages`` not a list of {role, content}, or a bad sampling field.
    """
    req = _base_request(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequestError("messages", f"must be a list of messages (got {type(messages).__name__})")
    req.chat.SetInParent()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a string role")
        req.chat.messages.add(role=m["role"], content=_content(i, m.get("content", "")))
    return req


def wants_usage_in_stream(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage``: a last chunk with ``usage`` and no choices."""
    opts = body.get("stream_options")
    return isinstance(opts, Mapping) and bool(opts.get("include_usage"))


def usage_json(usage: gen_pb.Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` of ours, ``cached_tokens`` in ``prompt_tokens_details``."""
    return {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _sum_usage(finals: Sequence[gen_pb.GenerateResponse]) -> gen_pb.Usage:
    total = gen_pb.Usage()
    for f in finals:
        total.prompt_tokens += f.usage.prompt_tokens
        total.completion_tokens += f.usage.completion_tokens
        total.cached_tokens += f.usage.cached_tokens
    return total


def _stop_reason(resp: gen_pb.GenerateResponse) -> str | int | None:
    kind = resp.WhichOneof("matched_stop")
    return getattr(resp, kind) if kind is not None else None


class Shaper:
    """The OpenAI JSON of one call's responses: ``chat`` (``chat.completion[.chunk]``) or not
    (``text_completion``). ``id`` is the first prompt's request id with OpenAI's prefix."""

    def __init__(self, *, chat: bool, model: str, request_id: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, resp: gen_pb.GenerateResponse, *, chunk: bool, first: bool = False) -> dict[str, Any]:
        finish = FINISH_REASONS.get(resp.finish_reason)
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = _stop_reason(resp)  # vLLM's extension: the matched stop
        if not self.chat:
            choice["text"] = resp.text
        elif chunk:
            choice["delta"] = {"role": "assistant", "content": resp.text} if first else {"content": resp.text}
        else:
            choice["message"] = {"role": "assistant", "content": resp.text}
        return choice

    def chunk(self, index: int, resp: gen_pb.GenerateResponse, *, first: bool, include_usage: bool) -> dict[str, Any]:
        """One SSE event's JSON for a delta (or the final message) of prompt ``index``; with
        ``include_usage`` every chunk carries ``"usage": null`` as OpenAI's do."""
        out = self._envelope([self._choice(index, resp, chunk=True, first=first)], chunk=True)
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, finals: Sequence[gen_pb.GenerateResponse]) -> dict[str, Any]:
        """The last chunk of ``stream_options.include_usage``: no choices, the call's usage."""
        out = self._envelope([], chunk=True)
        out["usage"] = usage_json(_sum_usage(finals))
        return out

    def body(self, responses: Sequence[gen_pb.GenerateResponse]) -> dict[str, Any]:
        """The non-streaming answer: one choice per prompt (the concatenated responses), summed usage."""
        out = self._envelope([self._choice(i, r, chunk=False) for i, r in enumerate(responses)], chunk=False)
        out["usage"] = usage_json(_sum_usage(responses))
        return out


def openai_field(field: str, *, chat: bool) -> str:
    """The request field of ours (``prompt``, ``prompt.chat``, ``prompt.token_ids``, ``max_tokens``,
    ...) as the OpenAI body spells it (``messages`` for a chat prompt)."""
    if field in ("prompt", "prompt.chat", "prompt.token_ids"):
        return "messages" if chat else "prompt"
    return field


def error_response(code: str, message: str, *, chat: bool) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error JSON) of a call that ended with gRPC status ``code`` (its name)
    and ``message``. An INVALID_ARGUMENT (or NOT_FOUND) message ``"{field}: {reason}"`` gives ``param`` (the
    OpenAI spelling, :func:`openai_field`), and the message names it too."""
    status, kind = _HTTP_STATUS.get(code, (500, "internal_error"))
    param = None
    if code in ("INVALID_ARGUMENT", "NOT_FOUND") and ": " in message:
        field, reason = message.split(": ", 1)
        if field and " " not in field:
            param = openai_field(field, chat=chat)
            message = f"{param}: {reason}"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.lower()}}


__all__ = [
    "Shaper",
    "chat_request",
    "completion_requests",
    "error_response",
    "openai_field",
    "sampling_from_body",
    "usage_json",
    "wants_usage_in_stream",
]
