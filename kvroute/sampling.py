"""Per-request sampling parameters and the request's validation (vLLM v1 ``SamplingParams`` semantics):
the one definition the router and the replica both check a request with (DESIGN.md §3.3, §5).

Pure Python (no torch). The router validates a request with :func:`validate_request` against the
model limits the replicas' heartbeats report before it picks a replica; the replica's engine validates it again
with the same function before the engine sees it. A failure is an ``InvalidRequestError`` naming
the field (the INVALID_ARGUMENT message on either side).

Length rule. The model holds at most ``max_model_len`` tokens (prompt + output), so a request needs
``len(prompt) + 1 <= max_model_len`` (at least one output token must fit; vLLM admits
``len(prompt) == max_model_len`` and produces one token whose KV is never stored, we refuse it), and
its effective output budget is::

    effective_max_tokens = min(max_tokens, max_model_len - len(prompt))

``max_tokens`` above ``max_model_len`` can never be met and is refused (naming ``max_tokens``), as
vLLM refuses it; one within it that the prompt leaves no room for is clamped, as vLLM does.
:data:`ROOM_LEFT` (the largest ``max_tokens``) asks for the room left, whatever it is: the OpenAI
chat API's default when a body names no ``max_tokens``.

A request that reaches the effective budget finishes with ``FinishReason.LENGTH`` whichever of the
two limits was hit, exactly as vLLM's ``check_stop`` does with ``num_tokens >= max_model_len or
num_output_tokens >= max_tokens``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.prompt import InvalidRequestError
from kvroute.v1 import generation_pb2 as gen_pb

MAX_SEED = 2**64 - 1
"""The largest ``seed``: the public API carries it as a uint64."""
MAX_MAX_TOKENS = 2**32 - 1
"""The largest ``max_tokens`` the public API can carry (a uint32)."""
ROOM_LEFT = MAX_MAX_TOKENS
"""``max_tokens`` meaning "as many as fit in ``max_model_len`` after the prompt" (vLLM's default for
a chat request without ``max_tokens``; never refused for exceeding ``max_model_len``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; defaults are vLLM's.

    - ``max_tokens``: output tokens at most (before the ``max_model_len`` clamp, see module doc).
    - ``min_tokens``: EOS and ``stop_token_ids`` are masked out of the logits, and stop strings
      are not matched, until this many tokens have been generated.
    - ``temperature``: 0 means greedy (argmax, ties to the lowest token id); otherwise logits
      are divided by it (values in ``(0, 0.01)`` are raised to 0.01 by the sampler, as vLLM does,
      to keep the softmax finite).
    - ``top_p``: nucleus sampling, in ``(0, 1]``; 1 is off.
    - ``top_k``: keep the k most likely tokens; ``-1`` or ``0`` is off.
    - ``min_p``: drop tokens whose probability is below ``min_p * max_prob``; 0 is off.
    - ``seed``: when set, the request samples from its own generator seeded with it, so the same
      seed gives the same tokens whatever else is in the batch.
    - ``stop``: strings matched on the detokenized output; the output is truncated before the
      match (vLLM's ``include_stop_str_in_output=False``).
    - ``stop_token_ids``: token ids that finish the request (reported as the matched stop).
    - ``ignore_eos``: keep generating after EOS (only ``max_tokens`` and the other stops end it).
    - ``repetition_penalty``: > 0, 1 is off; every token seen in the prompt or the output has its
      logit divided by it when positive and multiplied by it otherwise (vLLM's, after CTRL,
      Keskar et al. 2019).
    - ``presence_penalty``: in ``[-2, 2]``, 0 is off; subtracted from the logit of every token the
      output holds (OpenAI's definition, as vLLM applies it).
    - ``frequency_penalty``: in ``[-2, 2]``, 0 is off; subtracted once per occurrence in the output.

    ``stop`` and ``stop_token_ids`` accept any iterable (a lone string is one stop string) and are
    stored as tuples so the object stays hashable. Construction does not validate; call
    ``validate`` or ``validate_request``.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits (the sampler then needs the token ids)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering is on (``top_k >= 1``)."""
        return self.top_k >= 1

    def validate(self, vocab_size: int) -> None:
        """Check every field against vLLM's rules and the model's vocabulary.

        Args:
            vocab_size: number of token ids of the model; valid ids are ``[0, vocab_size)``.

        Raises:
            InvalidRequestError: naming the first bad field: ``max_tokens`` < 1, ``min_tokens`` < 0
                or > ``max_tokens``, ``temperature`` < 0 or not finite, ``top_p`` outside
                ``(0, 1]``, ``top_k`` < -1, ``min_p`` outside ``[0, 1]``, ``seed`` outside
                ``[0, 2**64)``, an empty ``stop`` string, a ``stop_token_ids`` entry outside the
                vocabulary, ``repetition_penalty`` not > 0, ``presence_penalty`` or
                ``frequency_penalty`` outside ``[-2, 2]`` (vLLM's ranges), or a value of the wrong type.
        """
        _require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be at least 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        _require_number("temperature", self.temperature)
        # NaN fails every comparison, so test finiteness first: a NaN temperature would poison the
        # whole batch's softmax.
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        _require_number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):  # also false for NaN
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 or 0 (off) or at least 1, got {self.top_k}")
        _require_number("min_p", self.min_p)
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not (0 <= self.seed <= MAX_SEED):
                raise InvalidRequestError("seed", f"must be in [0, 2**64), got {self.seed}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise InvalidRequestError("stop", f"entry {i} must be a string, got {type(s).__name__}")
            if not s:
                raise InvalidRequestError("stop", f"entry {i} is an empty string")
        for i, tok in enumerate(self.stop_token_ids):
            _require_int("stop_token_ids", tok)
            if not (0 <= tok < vocab_size):
                raise InvalidRequestError(
                    "stop_token_ids",
                    f"unknown stop token {tok} at index {i} (vocabulary is [0, {vocab_size}))",
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a bool, got {type(self.ignore_eos).__name__}")
        _require_number("repetition_penalty", self.repetition_penalty)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidRequestError(
                "repetition_penalty", f"must be greater than 0 (1 = off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            if not (-2.0 <= value <= 2.0):  # also false for NaN
                raise InvalidRequestError(name, f"must be in [-2, 2] (0 = off), got {value}")


def effective_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """The output budget of a request: ``min(params.max_tokens, max_model_len - prompt_len)``.

    Reaching it finishes the request with ``FinishReason.LENGTH`` (see the module docstring). The
    result is at least 1 for any request that passed ``validate_request``.
    """
    return min(params.max_tokens, max_model_len - prompt_len)


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    check_ids: bool = True,
) -> int:
    """Validate a whole request (prompt + sampling params) before it reaches the engine; the router
    calls it too, before it picks a replica, against the model limits the replicas' heartbeats report.

    Args:
        prompt_token_ids: the prompt as token ids.
        params: the request's sampling parameters.
        vocab_size: number of token ids of the model.
        max_model_len: most tokens (prompt + output) one sequence may hold.
        check_ids: False when the caller has checked the ids against ``vocab_size`` already (the
            router's ``PromptTokenizer.token_ids``): the per-token loop is skipped.

    Returns:
        The effective ``max_tokens`` (``effective_max_tokens``), which the engine passes to
        ``check_stop``.

    Raises:
        InvalidRequestError: ``prompt`` when the prompt is empty or leaves no room for one output
            token (``len(prompt) + 1 > max_model_len``; the message gives both lengths);
            ``prompt.token_ids`` for the first id outside ``[0, vocab_size)`` (index and value in the
            message); otherwise whatever ``SamplingParams.validate`` raises.
    """
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise InvalidRequestError("prompt", "must contain at least one token")
    if prompt_len + 1 > max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"is {prompt_len} tokens, but the model holds at most {max_model_len} tokens and at least "
            f"one output token must fit (prompt length must be at most {max_model_len - 1})",
        )
    for i, tok in enumerate(prompt_token_ids if check_ids else ()):
        # `type(tok) is int` first: plain ints are the norm, and the two isinstance checks (an ABC
        # lookup for numbers.Integral) dominated this loop on long prompts.
        if (type(tok) is int or (not isinstance(tok, bool) and isinstance(tok, numbers.Integral))) and (
            0 <= tok < vocab_size
        ):
            continue
        raise InvalidRequestError(
            "prompt.token_ids",
            f"token id {tok!r} at index {i} is out of vocabulary [0, {vocab_size})",
        )
    params.validate(vocab_size)
    if max_model_len < params.max_tokens < ROOM_LEFT:
        raise InvalidRequestError(
            "max_tokens",
            f"must be at most max_model_len={max_model_len} (the model's context), got {params.max_tokens}; "
            "request fewer output tokens",
        )
    return effective_max_tokens(params, prompt_len, max_model_len)


def _require_int(field: str, value: object) -> None:
    # bool is an int subclass; True as max_tokens is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(field, f"must be an integer, got {type(value).__name__}")


def _require_number(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(field, f"must be a number, got {type(value).__name__}")


OPTIONAL_PROTO_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                         "repetition_penalty", "presence_penalty", "frequency_penalty")
"""The ``SamplingParams`` proto fields that may be unset (then the default holds), in wire order."""


def sampling_params_from_proto(msg: gen_pb.SamplingParams | None) -> SamplingParams:
    """The ``SamplingParams`` of a proto message (None: the defaults); unset optional fields keep
    the defaults. Values are taken as they are: range checks are :meth:`SamplingParams.validate`'s."""
    if msg is None:
        return SamplingParams()
    kwargs: dict[str, Any] = {}
    for name in OPTIONAL_PROTO_FIELDS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return SamplingParams(
        **kwargs, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos
    )


__all__ = [
    "MAX_MAX_TOKENS",
    "MAX_SEED",
    "OPTIONAL_PROTO_FIELDS",
    "ROOM_LEFT",
    "SamplingParams",
    "effective_max_tokens",
    "sampling_params_from_proto",
    "validate_request",
]
