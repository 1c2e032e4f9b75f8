"""The messages between the server process (``core_client``) and the engine process (``core_proc``).

Two one-way pipes. The server sends lists of ops (all that were queued, in one message); the
engine process answers once at startup (:class:`Ready` or :class:`StartFailed`), then with one
:class:`StepOutputs` per step or idle tick that has anything to say, a :class:`CallResult` per
:class:`CallEngine`, and :class:`Died` when its step loop crashes. Everything here pickles; the
ops and replies are named tuples (a tuple's pickling cost, no more).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvroute.engine_info import EngineInfo

if TYPE_CHECKING:
    from replica.engine.engine import LLMEngine, RequestOutput
    from replica.engine.request import Request

EngineFactory = Callable[[], "LLMEngine"]
"""Builds the engine in the engine process (a module-level function or a ``functools.partial`` of one)."""
StepHookFactory = Callable[["LLMEngine"], Callable[["LLMEngine"], Any]]
"""``factory(engine) -> hook``, called in the engine process; ``hook(engine)`` runs after every step
and idle tick and returns a picklable report or None (nothing new); ``hook.close()``, if it has
one, runs when the engine process stops."""


# -- server process -> engine process ---------------------------------------------------------
class AddRequest(NamedTuple):
    """Queue a request validated in the server process."""

    request: Request


class AbortRequest(NamedTuple):
    """Abort a request (idempotent)."""

    request_id: str


class CallEngine(NamedTuple):
    """Run ``pickle.loads(fn)(engine)`` between steps and answer with a :class:`CallResult`."""

    call_id: int
    fn: bytes


class CallHook(NamedTuple):
    """Run ``pickle.loads(fn)(step_hook)`` before the next step (fire-and-forget)."""

    fn: bytes


class Shutdown(NamedTuple):
    """Stop the step loop; the hook is closed and the process exits."""


# -- engine process -> server process ---------------------------------------------------------
class Ready(NamedTuple):
    """The engine is built: what it is (the server validates requests and answers GetModelInfo with it)."""

    info: EngineInfo


class StartFailed(NamedTuple):
    """Building the engine or its step hook raised ``error`` (the server raises it again)."""

    error: BaseException


class StepOutputs(NamedTuple):
    """One step's (or idle tick's) news: request outputs; per-request errors raised by ``add``;
    ``admitted`` = (request id, num_cached_tokens) for each request the scheduler admitted for the
    first time; the step hook's report (or None)."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, BaseException]]
    admitted: list[tuple[str, int]]
    report: Any


class CallResult(NamedTuple):
    """The answer to a :class:`CallEngine`: ``value`` is the result, or the exception when not ``ok``."""

    call_id: int
    ok: bool
    value: Any


class Died(NamedTuple):
    """The step loop crashed (``reason`` is the exception's repr); the process exits after it."""

    reason: str


__all__ = [
    "AbortRequest",
    "AddRequest",
    "CallEngine",
    "CallHook",
    "CallResult",
    "Died",
    "EngineFactory",
    "Ready",
    "Shutdown",
    "StartFailed",
    "StepHookFactory",
    "StepOutputs",
]
