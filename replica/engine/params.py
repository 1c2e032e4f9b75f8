"""The engine's view of a request's parameters: the finish reasons and the EOS set.

``SamplingParams`` and the request's validation (:func:`validate_request`) are the contract the
router checks too, so they live in :mod:`kvroute.sampling` and are re-exported here for the engine.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection
from enum import StrEnum

from kvroute.sampling import SamplingParams, effective_max_tokens, validate_request


class FinishReason(StrEnum):
    """Why a request finished; the values are vLLM's / OpenAI's strings."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the server


EosTokenIds = int | Collection[int] | None
"""A model's EOS id, or all of them (Llama 3 lists several in ``generation_config.json``), or None."""


def eos_token_set(eos_token_id: EosTokenIds) -> frozenset[int]:
    """``eos_token_id`` (one id, several, or ``None``) as a frozenset of ids."""
    if eos_token_id is None:
        return frozenset()
    if type(eos_token_id) is frozenset:  # already one (check_stop runs per token per step)
        return eos_token_id
    if isinstance(eos_token_id, numbers.Integral):
        return frozenset((int(eos_token_id),))
    return frozenset(int(t) for t in eos_token_id)


__all__ = [
    "EosTokenIds",
    "FinishReason",
    "SamplingParams",
    "eos_token_set",
    "effective_max_tokens",
    "validate_request",
]
