"""Typed errors of the engine. Pure Python (no torch), so the service boundary can import them cheaply.

Errors are raised where the problem is found and mapped to gRPC status codes at one boundary (the
replica service): ``InvalidRequestError`` -> ``INVALID_ARGUMENT``, any other ``EngineError`` ->
``INTERNAL``. Nothing in the engine calls ``context.abort`` itself.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose (as opposed to a bug)."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before it touches any state: a bad prompt or a bad sampling value.

    ``field`` names the offending request field with the public API's spelling (``"prompt"``,
    ``"max_tokens"``, ``"prompt.token_ids"``, ``"stop_token_ids"``, ...); ``reason`` says what is
    wrong in words a client can act on. ``str(err)`` is ``"{field}: {reason}"``, which is also the
    gRPC status message.

    Subclasses ``ValueError`` so that callers which only know "bad value" still catch it.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self):  # keep (field, reason) across pickling (process pools, multiprocessing)
        return (type(self), (self.field, self.reason))
