"""A routed request served by a stock vLLM server (DESIGN.md §3.4): the replica's stream, spoken
over vLLM's OpenAI API.

The router has already tokenized the prompt with the model folder vLLM serves (same tokenizer and
chat template), so every request, chat included, goes to vLLM as token ids on ``/v1/completions``::

    ReplicaGenerateRequest ─▶ POST http://{address}/v1/completions
        {"model", "prompt": [ids], sampling fields that were set, "cache_salt", "stream": true,
         "stream_options": {"include_usage": true}, "return_token_ids": true}
    SSE chunks ─▶ GenerateResponse deltas (token_ids, text); the finishing chunk's finish_reason and
        stop_reason, with the usage chunk's prompt/completion/cached tokens, make the last delta

Statuses are the replica's: an HTTP error before the stream (or an error event in it) raises
``grpc.aio.AioRpcError`` with the gRPC code of that HTTP status and vLLM's message, so the proxy
retries an UNAVAILABLE (connection refused, 503) on another replica before the first token and
passes every other status through. Closing the iterator (client cancel, deadline) closes the HTTP
connection, and vLLM aborts the request and frees its blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc

from kvroute.sampling import OPTIONAL_PROTO_FIELDS, ROOM_LEFT
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb

_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_FINISH = {"stop": gen_pb.FINISH_REASON_STOP, "length": gen_pb.FINISH_REASON_LENGTH,
           "abort": gen_pb.FINISH_REASON_ABORT}
_CONNECT_TIMEOUT_S = 5.0


def upstream_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a replica would have answered with: ``code`` and ``details``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def completions_body(model: str, request: rep_pb.ReplicaGenerateRequest) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body for ``request`` (a streaming one, with token ids and usage).

    Only the sampling fields the request set are sent: the others take vLLM's defaults, which are
    the replica's (kvroute.sampling)."""
    body: dict[str, Any] = {"model": model, "prompt": list(request.token_ids), "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if request.HasField("sampling"):
        s = request.sampling
        for name in OPTIONAL_PROTO_FIELDS:  # vLLM's completions API takes each under the same name
            if s.HasField(name):
                body[name] = getattr(s, name)
        if body.get("max_tokens") == ROOM_LEFT:  # vLLM's spelling of the room left: null
            body["max_tokens"] = None
        if s.stop:
            body["stop"] = list(s.stop)
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.ignore_eos:
            body["ignore_eos"] = True
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    return body


def _message(payload: Any, fallback: str) -> str:
    """The message of an OpenAI/vLLM error body (``{"error": {"message"}}``, FastAPI's ``detail``)."""
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            if isinstance(msg, str) and msg:
                return msg
        if isinstance(err, str) and err:
            return err
    return fallback


class CompletionStream:
    """Turns vLLM's completion chunks (parsed SSE ``data`` objects) into GenerateResponse deltas.

    Feed each chunk to :meth:`feed`; it returns the deltas to yield now. The finishing delta is
    held until the usage chunk (or the stream's end, :meth:`end`) so that it carries the usage.

    Raises (from :meth:`feed`):
        grpc.aio.AioRpcError: an error event in the stream (its code from the event's HTTP code).
    """

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._final: gen_pb.GenerateResponse | None = None
        self._done = False  # the finishing delta has been returned

    def feed(self, chunk: dict[str, Any]) -> list[gen_pb.GenerateResponse]:
        if "error" in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {}
            code = _HTTP_TO_GRPC.get(err.get("code") if isinstance(err.get("code"), int) else 500,
                                     grpc.StatusCode.INTERNAL)
            raise upstream_error(code, _message(chunk, "vLLM ended the stream with an error"))
        out = []
        for choice in chunk.get("choices") or ():
            delta = gen_pb.GenerateResponse(request_id=self._request_id, text=choice.get("text") or "",
                                            token_ids=choice.get("token_ids") or [])
            reason = choice.get("finish_reason")
            if reason is None:
                out.append(delta)
                continue
            delta.finish_reason = _FINISH.get(reason, gen_pb.FINISH_REASON_STOP)
            stop = choice.get("stop_reason")
            if isinstance(stop, str):
                delta.stop_str = stop
            elif isinstance(stop, int) and not isinstance(stop, bool):
                delta.stop_token_id = stop
            self._final = delta
        usage = chunk.get("usage")
        if isinstance(usage, dict) and self._final is not None:
            details = usage.get("prompt_tokens_details") or {}
            self._final.usage.CopyFrom(gen_pb.Usage(
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                cached_tokens=int(details.get("cached_tokens") or 0)))
            out.append(self._final)
            self._final, self._done = None, True
        return out

    def end(self) -> list[gen_pb.GenerateResponse]:
        """The held finishing delta when no usage chunk came; an error if none finished."""
        if self._final is not None:
            final, self._final, self._done = self._final, None, True
            return [final]
        if self._done:
            return []
        raise upstream_error(grpc.StatusCode.UNAVAILABLE, "vLLM closed the stream before the request finished")


class VllmUpstream:
    """The HTTP client the router serves vLLM replicas with (one connection pool per router).

    Args:
        ssl: the TLS context for ``https`` replicas (None: plaintext ``http``).
    """

    def __init__(self, ssl: Any = None) -> None:
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S))
        return self._session

    async def stream(self, address: str, model: str, request: rep_pb.ReplicaGenerateRequest, *,
                     timeout: float | None = None, headers: dict[str, str] | None = None,
                     ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Serve ``request`` on the vLLM server at ``address`` (``host:port``), as deltas.

        Args:
            model: the model name vLLM serves (its heartbeat's ``model``).
            timeout: seconds left of the caller's deadline (None: none).
            headers: extra request headers (trace context).

        Raises:
            grpc.aio.AioRpcError: vLLM's refusal or failure, as the replica's status.
        """
        scheme = "https" if self._ssl is not None else "http"
        url = f"{scheme}://{address}/v1/completions"
        hdrs = {"content-type": "application/json", **(headers or {})}
        if request.request_id:
            hdrs["x-request-id"] = request.request_id
        parser = CompletionStream(request.request_id)
        try:
            async with self._client().post(
                url, data=json.dumps(completions_body(model, request)), headers=hdrs,
                ssl=self._ssl if self._ssl is not None else True,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=_CONNECT_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        payload = json.loads(text)
                    except ValueError:
                        payload = text
                    code = _HTTP_TO_GRPC.get(resp.status, grpc.StatusCode.INTERNAL)
                    raise upstream_error(code, _message(payload, f"vLLM answered HTTP {resp.status}"))
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError as e:
                        raise upstream_error(grpc.StatusCode.INTERNAL, f"vLLM sent an undecodable chunk: {e}") from e
                    for delta in parser.feed(chunk):
                        yield delta
                for delta in parser.end():
                    yield delta
        except TimeoutError:
            raise upstream_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for vLLM") from None
        except aiohttp.ClientError as e:
            raise upstream_error(grpc.StatusCode.UNAVAILABLE, f"vLLM at {address}: {e}") from e

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


__all__ = ["CompletionStream", "VllmUpstream", "completions_body", "upstream_error"]
