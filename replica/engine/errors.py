"""Typed errors of the engine. Pure Python (no torch), so the service boundary can import them cheaply.

Errors are raised where the problem is found and mapped to gRPC status codes at one boundary
(``replica.wire.classify_error``): ``InvalidRequestError`` -> ``INVALID_ARGUMENT``, any other
``EngineError`` -> ``INTERNAL``. Nothing in the engine calls ``context.abort`` itself.
"""

from __future__ import annotations

from kvroute.prompt import InvalidRequestError as RequestError


class EngineError(Exception):
    """Base of every error the engine raises on purpose (as opposed to a bug)."""


class InvalidRequestError(EngineError, RequestError):
    """A request the engine refuses before it touches any state: a bad prompt or a bad sampling value.

    :class:`kvroute.prompt.InvalidRequestError` (the router and the replica frontend raise that
    one) as an ``EngineError``: ``field`` names the offending request field with the public API's
    spelling (``"prompt"``, ``"max_tokens"``, ``"prompt.token_ids"``, ``"stop_token_ids"``, ...);
    ``reason`` says what is wrong in words a client can act on. ``str(err)`` is
    ``"{field}: {reason}"``, which is also the gRPC status message; both survive pickling.

    A ``ValueError`` (through its base) so that callers which only know "bad value" still catch it.
    """
