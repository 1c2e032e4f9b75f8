"""The OpenAI-compatible HTTP front (DESIGN.md §3.3): one Starlette app over a process's own
request path, served by uvicorn on the process's event loop. The router and the replicas each
supply an :class:`OpenAIBackend` (``router.http_api``, ``replica.http_api``); this module knows
neither side.

    POST /v1/completions | /v1/chat/completions
      body ─▶ kvroute.openai_api (shape; 400 naming the field) ─▶ model check (404)
        ─▶ backend.stream(GenerateRequest, HttpCallContext) per prompt   (the gRPC front's path:
           the same validation, admission, routing; statuses from the backend's classifier)
        ─▶ first delta of every prompt (errors before it: an HTTP status, OpenAI's error JSON)
        ─▶ stream: SSE chunks ... [usage chunk] ``data: [DONE]``  |  else: one JSON body
    GET /v1/models, /health (200, or 503 with the reason), /metrics (the process's Prometheus registry)

A call's trailing metadata (the router's ``x-kvroute-replica`` and predicted cached tokens) become
response headers. A client that disconnects cancels the call: the backend's stream is closed,
which aborts the engine request (and frees its blocks) as a gRPC cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import anyio
import grpc
import uvicorn
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute.grpc_errors import call_outcome
from kvroute.openai_api import (
    Shaper,
    chat_request,
    completion_requests,
    error_response,
    wants_usage_in_stream,
)
from kvroute.process import dial_target
from kvroute.prompt import InvalidRequestError, check_model
from kvroute.responses import concat_deltas
from kvroute.telemetry import Telemetry, end_http_span, start_http_span
from kvroute.tls import ServerTlsFiles
from kvroute.v1 import generation_pb2 as gen_pb

log = logging.getLogger(__name__)

# The name of the request path's span under the HTTP SERVER span (an INTERNAL one: routing and
# proxying in the router, queue / prefill / decode in the replica).
GENERATE_SPAN = "kvroute.generate"


class HttpCallContext:
    """The part of a ``grpc.aio.ServicerContext`` the request paths read, for one HTTP call: the
    request headers as invocation metadata (W3C trace context), no deadline, and the trailing
    metadata the path sets (returned as response headers)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], trace_context: Any = None) -> None:
        self._metadata = metadata  # the request headers, names lower-cased (:func:`header_metadata`)
        self.trailing: tuple[tuple[str, str], ...] = ()
        # The HTTP SERVER span's context (kvroute.telemetry.call_context): the request path's span
        # is its child. None: no span (the path reads the headers' trace context).
        self.trace_context = trace_context

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple(metadata)


def header_metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """HTTP request headers as gRPC invocation metadata (names lower-cased)."""
    return tuple((k.lower(), v) for k, v in headers.items())


class OpenAIBackend(Protocol):
    """What a process serves the HTTP API with."""

    def model(self) -> tuple[str, int]:
        """(served model name, max_model_len). Raises RpcError UNAVAILABLE while loading."""

    def stream(self, request: gen_pb.GenerateRequest, context: HttpCallContext, *, method: str, operation: str
               ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The process's request path for one request (what its gRPC GenerateStream runs)."""

    def classify(self, exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
        """The process's gRPC error classifier (``error_boundary``'s)."""

    def unready_reason(self) -> str | None:
        """None when the process can serve requests, else why not (``/health`` answers 503)."""


class _Disconnected(Exception):
    """The client went away before the response started."""


async def _until_disconnect(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``await work``, cancelled (and :class:`_Disconnected` raised) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise _Disconnected
    return task.result()


async def _each(aws: list[Awaitable[Any]]) -> list[Any]:
    """Every awaitable's result; the first failure cancels the others and is raised as it is."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(a) for a in aws]  # type: ignore[arg-type]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def _first(stream: AsyncIterator[gen_pb.GenerateResponse]) -> gen_pb.GenerateResponse | None:
    return await anext(stream, None)


async def _merged(heads: list[gen_pb.GenerateResponse | None], streams: list[AsyncIterator[gen_pb.GenerateResponse]]
                  ) -> AsyncIterator[tuple[int, gen_pb.GenerateResponse]]:
    """(prompt index, response) of every stream, as they come; ``heads`` are their first items."""
    for i, head in enumerate(heads):
        if head is not None:
            yield i, head
    if len(streams) == 1:
        async for resp in streams[0]:
            yield 0, resp
        return
    pending = {asyncio.ensure_future(_first(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                resp = task.result()
                if resp is not None:
                    yield i, resp
                    pending[asyncio.ensure_future(_first(streams[i]))] = i
    finally:
        with anyio.CancelScope(shield=True):  # a disconnect cancels us: the cleanup must still run
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


async def _ending(body: AsyncIterator[Any], span: Any, status: int) -> AsyncIterator[Any]:
    """``body``, then the end of the request's HTTP span (however the stream ends)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        end_http_span(span, status)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class OpenAIApp:
    """The Starlette app of one process (``.app``) over its :class:`OpenAIBackend`.

    Args:
        backend: the process's request path.
        telemetry: the process's telemetry, whose Prometheus registry ``GET /metrics`` serves
            (None, or no registry: 404).
    """

    def __init__(self, backend: OpenAIBackend, *, telemetry: Telemetry | None = None) -> None:
        self.backend = backend
        self.telemetry = telemetry
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    def _error(self, exc: BaseException, *, chat: bool) -> JSONResponse:
        code, message = call_outcome(exc, None, self.backend.classify)
        status, body = error_response(code, message, chat=chat)
        return JSONResponse(body, status_code=status)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        """One completions / chat completions call, inside its HTTP SERVER span when the process
        traces (the span ends with the response: after the last SSE event when streamed)."""
        span = None
        if self.telemetry is not None and self.telemetry.tracing:
            span = start_http_span(self.telemetry.tracer("kvroute.http"), request.method, request.url.path,
                                   request.url.scheme, request.headers, request.client.host if request.client else "")
        try:
            response = await self._respond(request, chat=chat, span=span)
        except BaseException:
            if span is not None:
                end_http_span(span, 500)
            raise
        if span is not None:
            if isinstance(response, StreamingResponse):
                response.body_iterator = _ending(response.body_iterator, span, response.status_code)
            else:
                end_http_span(span, response.status_code)
        return response

    async def _respond(self, request: Request, *, chat: bool, span: Any) -> Response:
        streams: list[AsyncIterator[gen_pb.GenerateResponse]] = []
        trace_context = trace.set_span_in_context(span) if span is not None else None
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise InvalidRequestError("body", f"not valid JSON: {e}") from e
            if not isinstance(body, dict):
                raise InvalidRequestError("body", "must be a JSON object")
            requests = [chat_request(body)] if chat else completion_requests(body)
            model, _ = self.backend.model()
            check_model(body.get("model"), model)
            metadata = header_metadata(request.headers)  # once: every prompt of a batch shares it
            contexts = [HttpCallContext(metadata, trace_context) for _ in requests]
            method = GENERATE_SPAN
            operation = "chat" if chat else "text_completion"
            streams = [self.backend.stream(r, c, method=method, operation=operation)
                       for r, c in zip(requests, contexts, strict=True)]
            if not body.get("stream"):
                finals = await _unless_disconnected(request, _each([concat_deltas(s) for s in streams]))
                shaper = Shaper(chat=chat, model=model, request_id=finals[0].request_id)
                return JSONResponse(shaper.body(finals), headers=dict(contexts[0].trailing))
            heads = await _unless_disconnected(request, _each([_first(s) for s in streams]))
        except _Disconnected:
            await self._close(streams)
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - this is the HTTP boundary
            await self._close(streams)
            return self._error(exc, chat=chat)
        rid = next((h.request_id for h in heads if h is not None), "")
        shaper = Shaper(chat=chat, model=model, request_id=rid)
        events = self._events(shaper, heads, streams, wants_usage_in_stream(body), chat=chat)
        return StreamingResponse(events, media_type="text/event-stream", headers=dict(contexts[0].trailing))

    @staticmethod
    async def _close(streams: list[AsyncIterator[gen_pb.GenerateResponse]]) -> None:
        with anyio.CancelScope(shield=True):
            for s in streams:
                await s.aclose()  # type: ignore[attr-defined]

    async def _events(self, shaper: Shaper, heads: list[gen_pb.GenerateResponse | None],
                      streams: list[AsyncIterator[gen_pb.GenerateResponse]], include_usage: bool, *, chat: bool
                      ) -> AsyncIterator[str]:
        """The SSE body: one chunk per delta, the usage chunk if asked, ``data: [DONE]``. An error
        after the first chunk (the status line is sent) becomes an error event before ``[DONE]``."""
        finals: list[gen_pb.GenerateResponse] = []
        started: set[int] = set()
        try:
            async with contextlib.aclosing(_merged(heads, streams)) as merged:
                async for i, resp in merged:
                    yield _sse(shaper.chunk(i, resp, first=i not in started, include_usage=include_usage))
                    started.add(i)
                    if resp.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                        finals.append(resp)
            if include_usage:
                yield _sse(shaper.usage_chunk(finals))
        except Exception as exc:  # noqa: BLE001 - the status is sent: the error goes in the stream
            code, message = call_outcome(exc, None, self.backend.classify)
            yield _sse(error_response(code, message, chat=chat)[1])
        finally:
            await self._close(streams)
        yield "data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        try:
            model, max_len = self.backend.model()
        except Exception as exc:  # noqa: BLE001 - this is the HTTP boundary
            return self._error(exc, chat=False)
        card = {"id": model, "object": "model", "created": 0, "owned_by": "kvroute", "root": model,
                "max_model_len": max_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        reason = self.backend.unready_reason()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        text = self.telemetry.prometheus_text() if self.telemetry is not None else ""
        if not text:
            status, body = error_response("NOT_FOUND", "metrics: this process exports no Prometheus metrics"
                                          " (metrics_port -1)", chat=False)
            return JSONResponse(body, status_code=status)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process's main owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn serving ``app`` as a task of the running event loop.

    The constructor binds and listens (connections queue until uvicorn accepts them), so the port
    is known, and a taken one fails, before anything starts; ``port`` = 0 picks a free one (read
    back from ``.port``). ``start`` serves; ``stop(grace)`` lets responses in progress finish for
    ``grace`` seconds. ``name`` is what the log line calls the process. ``tls``: serve https with
    these files (kvroute.tls.server_tls_files; a client CA = client certificates required).

    Raises (constructor):
        RuntimeError: the port cannot be bound (the message names the setting ``http_port``).
    """

    def __init__(self, app: Any, host: str, port: int, *, name: str, tls: ServerTlsFiles | None = None) -> None:
        self.app = app
        self.name = name
        self.tls = tls
        try:
            self._sock = socket.create_server((host or "0.0.0.0", port), backlog=1024)
        except OSError as e:
            raise RuntimeError(f"http_port: cannot bind {host}:{port}: {e}") from e
        self.port: int = self._sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://{dial_target(host, self.port)}/v1"
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Serve on the bound socket (a task of the running loop)."""
        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {"ssl_certfile": self.tls.cert_file, "ssl_keyfile": self.tls.key_file}
            if self.tls.client_ca_file:
                tls |= {"ssl_ca_certs": self.tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, **tls)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"{self.name} http")
        log.info("%s: OpenAI-compatible HTTP API on %s", self.name, self.url)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, give responses in progress ``grace`` seconds, then close them. Idempotent."""
        if self._server is None or self._task is None:
            self._sock.close()
            return
        self._server.config.timeout_graceful_shutdown = max(int(grace), 0) or None
        self._server.should_exit = True
        if grace <= 0:
            self._server.force_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace + 5.0)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._server = None


__all__ = ["HttpCallContext", "HttpServer", "OpenAIApp", "OpenAIBackend"]
