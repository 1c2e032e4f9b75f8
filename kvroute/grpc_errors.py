"""The one boundary where typed errors become gRPC status codes (grpc.aio servers).

A servicer method raises typed exceptions (or :class:`RpcError` for a status decided on the spot);
:func:`error_boundary` wraps the method -- unary or server-streaming -- and turns whatever escapes
into ``context.abort(code, message)`` through a *classifier* the process supplies::

    classify(exc) -> (grpc.StatusCode, message) | None      # None: not ours -> INTERNAL, logged

Cancellation (client cancel, deadline expiry) is never caught: ``asyncio.CancelledError`` passes
through so that grpc reports CANCELLED / DEADLINE_EXCEEDED and the method's ``finally`` blocks
release what the call held. Streaming methods' generators are closed explicitly (``aclosing``)
so that cleanup runs at once, not when the garbage collector finds it.

Request bytes that do not parse as the method's message are a client error too: the servicers
registered with :func:`add_servicer` get an :class:`UndecodableRequest` instead of a traceback in
grpc's own handler, and the boundary answers INVALID_ARGUMENT ``"request: not a valid <message>
(...)"`` with one WARNING line.

The same mapping, as (status name, message), is what a call's metrics and spans record:
:func:`call_outcome` (a cancelled handler reads as DEADLINE_EXCEEDED once the deadline has passed,
else CANCELLED).

Imports no replica or router code: each side passes its own classifier.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

Classifier = Callable[[BaseException], "tuple[grpc.StatusCode, str] | None"]


class RpcError(Exception):
    """End the call with ``code`` and ``message`` (raised by servicers, mapped by the boundary)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class UndecodableRequest:
    """What a method registered with :func:`add_servicer` receives for request bytes that do not
    parse as its ``message`` (full name); ``error`` is the parser's reason."""

    __slots__ = ("message", "error")

    def __init__(self, message: str, error: str) -> None:
        self.message = message
        self.error = error

    def refusal(self) -> tuple[grpc.StatusCode, str]:
        return grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {self.message} ({self.error})"


def _tolerant_parser(cls: type) -> Callable[[bytes], object]:
    parse, name = cls.FromString, cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as e:
            return UndecodableRequest(name, str(e))

    return deserialize


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Register ``servicer``'s methods for ``service`` (a protobuf service descriptor), as the
    generated ``add_<Service>Servicer_to_server`` does, except that undecodable request bytes reach
    the method as an :class:`UndecodableRequest` (which :func:`error_boundary` refuses).

    Raises:
        AttributeError: ``servicer`` lacks one of the service's methods.
    """
    handlers = {}
    for m in service.methods:
        kind = _HANDLER_KINDS[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = kind(
            getattr(servicer, m.name),
            request_deserializer=_tolerant_parser(message_factory.GetMessageClass(m.input_type)),
            response_serializer=message_factory.GetMessageClass(m.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _refuse_undecodable(request: UndecodableRequest, context: grpc.aio.ServicerContext):
    code, message = request.refusal()
    log.warning("refused a call from %s: %s", context.peer(), message)
    return context.abort(code, message)


def _classified(exc: BaseException, classify: Classifier | None) -> tuple[grpc.StatusCode, str] | None:
    """The status an exception maps to: an :class:`RpcError`'s own, else the classifier's (None: a bug)."""
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    return classify(exc) if classify is not None else None


def _status_of(exc: BaseException, classify: Classifier | None) -> tuple[grpc.StatusCode, str]:
    mapped = _classified(exc, classify)
    if mapped is not None:
        return mapped
    log.exception("unhandled error in a gRPC method", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def deadline_expired(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call's deadline has passed (False for a call without one)."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def call_outcome(
    exc: BaseException, context: grpc.aio.ServicerContext | None, classify: Classifier | None = None
) -> tuple[str, str]:
    """(status name, message) of a call that ended with ``exc``, for its metrics and spans.

    ``asyncio.CancelledError`` / ``GeneratorExit`` (the handler was cancelled, or abandoned
    mid-stream): ``DEADLINE_EXCEEDED`` when the deadline of ``context`` has passed (None: a call
    without one), else ``CANCELLED``. Otherwise
    what :func:`error_boundary` makes of it: an :class:`RpcError`'s status, the classifier's, or
    ``INTERNAL``.
    """
    if not isinstance(exc, Exception):
        if context is not None and deadline_expired(context):
            return "DEADLINE_EXCEEDED", "deadline expired"
        return "CANCELLED", "cancelled by the client"
    mapped = _classified(exc, classify)
    if mapped is None:
        return "INTERNAL", f"{type(exc).__name__}: {exc}"
    return mapped[0].name, mapped[1]


def error_boundary(classify: Classifier | None = None) -> Callable:
    """Decorator for servicer methods ``(self, request, context)`` that maps escaping exceptions
    to a status with ``classify``: an ``async def`` coroutine (unary), an async generator, or a
    plain ``def`` returning an async iterator (both server-streaming; the iterator is closed at
    once when the call ends)."""

    def decorate(fn: Callable) -> Callable:
        if not inspect.iscoroutinefunction(fn):  # an async generator, or a def returning an iterator

            @functools.wraps(fn)
            async def stream(self, request, context):
                if type(request) is UndecodableRequest:
                    await _refuse_undecodable(request, context)
                try:
                    async with contextlib.aclosing(fn(self, request, context)) as gen:
                        async for item in gen:
                            yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001 - this is the boundary
                    await context.abort(*_status_of(exc, classify))

            return stream

        @functools.wraps(fn)
        async def unary(self, request, context):
            if type(request) is UndecodableRequest:
                await _refuse_undecodable(request, context)
            try:
                return await fn(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the boundary
                await context.abort(*_status_of(exc, classify))

        return unary

    return decorate


__all__ = [
    "Classifier", "RpcError", "UndecodableRequest", "add_servicer", "call_outcome", "deadline_expired", "error_boundary",
]
