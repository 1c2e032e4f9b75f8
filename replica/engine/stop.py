"""When a request is finished: the stop rules, checked after every appended output token.

Order (vLLM v1: the engine core's ``check_stop`` for tokens, then the output processor's stop
strings, which override a length finish of the same step)::

    n >= min_tokens and last == EOS (unless ignore_eos)  -> STOP,   matched_stop = EOS id
    n >= min_tokens and last in stop_token_ids           -> STOP,   matched_stop = that id
    a stop string matched (IncrementalDetokenizer)       -> STOP,   matched_stop = the string
    n >= max_tokens (effective, includes max_model_len)  -> LENGTH, matched_stop = None

Per step, for each request that sampled a token ``tok`` (detokenizer optional: without one there
are no stop strings)::

    req.output_token_ids.append(tok)
    text = detok.update([tok])
    finished, reason, matched = check_stop(req.output_token_ids, params, eos_token_id=eos,
                                           max_tokens=req.max_tokens,
                                           matched_stop_str=detok.matched_stop)
    if finished:
        text += detok.finish()  # held text of a request that did not end on a stop string
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from replica.engine.params import EosTokenIds, FinishReason, SamplingParams, eos_token_set


class StopCheck(NamedTuple):
    """Outcome of ``check_stop``; unpacks as ``(finished, finish_reason, matched_stop)``.

    ``matched_stop`` is the stop string (``str``), the EOS or stop token id (``int``), or
    ``None`` (not finished, or finished by length) -- the ``oneof matched_stop`` of the API.
    """

    finished: bool
    finish_reason: FinishReason | None
    matched_stop: str | int | None


NOT_FINISHED = StopCheck(False, None, None)


def check_stop(
    output_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_token_id: EosTokenIds,
    max_tokens: int,
    matched_stop_str: str | None = None,
) -> StopCheck:
    """Decide whether a request is finished after its newest token (order in the module docstring).

    Args:
        output_token_ids: every output token so far, the newest last.
        params: the request's sampling params.
        eos_token_id: the model's EOS id, or a collection of them (any one finishes the request
            and is reported as the matched stop), or ``None`` when it has none.
        max_tokens: the *effective* budget, ``validate_request``'s return value
            (``min(params.max_tokens, max_model_len - prompt_len)``).
        matched_stop_str: ``IncrementalDetokenizer.matched_stop`` after this step's ``update``.

    Returns:
        A ``StopCheck``. Pure: changes nothing.
    """
    n = len(output_token_ids)
    if n == 0:
        return NOT_FINISHED
    last = output_token_ids[-1]
    if n >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_set(eos_token_id):
            return StopCheck(True, FinishReason.STOP, last)
        if last in params.stop_token_ids:
            return StopCheck(True, FinishReason.STOP, last)
    if matched_stop_str is not None:
        return StopCheck(True, FinishReason.STOP, matched_stop_str)
    if n >= max_tokens:
        return StopCheck(True, FinishReason.LENGTH, None)
    return NOT_FINISHED
