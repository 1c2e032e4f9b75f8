"""``kvroute generate``: a small client of the router's public API, streaming to the terminal.

    GenerateRequest(text | chat, sampling, cache_salt) ──GenerationService.GenerateStream──▶ router
    deltas' text ──▶ stdout as they arrive
    last delta   ──▶ one summary line on stderr: finish reason, usage (prompt / completion / cached
                     tokens), the routing (replica, predicted cached tokens, policy) and timings

Failures become one readable line naming the target and what to do about it (no traceback);
:func:`describe_rpc_error` is shared with ``kvroute bench``. Imports grpc and the generated code only.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

import grpc

from kvroute import responses
from kvroute.responses import MD_PREDICTED, MD_REPLICA
from kvroute.tls import open_channel
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc

DEFAULT_TARGET = "127.0.0.1:50050"

FINISH_REASONS = {gen_pb.FINISH_REASON_UNSPECIFIED: "unfinished", **responses.FINISH_REASONS}


def parse_target(target: str) -> str:
    """``host:port`` checked for shape (``[::1]:50050`` for IPv6).

    Raises:
        ValueError: not ``host:port`` with a port in 1..65535 (the message names ``--target``).
    """
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--target: expected HOST:PORT (e.g. {DEFAULT_TARGET}), got {target!r}")
    return target


def describe_rpc_error(err: grpc.RpcError, target: str) -> str:
    """One line for a failed call to the router at ``target``: the status, the server's message,
    and a hint for the statuses a user can act on."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else "") or ""
    name = code.name if code is not None else "ERROR"
    if code == grpc.StatusCode.UNAVAILABLE:
        if "replica" in details:  # the router answered: it has nowhere to send the request
            return (f"UNAVAILABLE: the router at {target} has no replica to send the request to: {details}."
                    " Are the replicas up and heartbeating (kvroute up prints their logs)?")
        return (f"UNAVAILABLE: cannot reach a router at {target} ({details}). Is the cluster up"
                " (`kvroute up`)? Point at another one with --target HOST:PORT.")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"DEADLINE_EXCEEDED: no complete answer from {target} within the deadline (--timeout)."
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"INVALID_ARGUMENT: the request was refused: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return f"RESOURCE_EXHAUSTED: the cluster is overloaded ({details}); retry later or send less at once."
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"UNIMPLEMENTED: {target} does not serve this method; is it a kvroute router? ({details})"
    return f"{name}: {details or 'the call failed'} (router {target})"


@dataclass
class StreamResult:
    """What one streamed generation ended with (``final`` is None when the stream ended early)."""

    text: str
    final: gen_pb.GenerateResponse | None
    ttft_s: float | None
    total_s: float


def build_request(
    text: str, *, chat: bool = False, max_tokens: int | None = None, temperature: float | None = None,
    cache_salt: str = "", ignore_eos: bool = False, seed: int | None = None,
) -> gen_pb.GenerateRequest:
    """A GenerateRequest for ``text`` (as one user message when ``chat``); unset fields keep the
    engine's defaults."""
    sampling = gen_pb.SamplingParams(ignore_eos=ignore_eos)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    req = gen_pb.GenerateRequest(sampling=sampling, cache_salt=cache_salt)
    if chat:
        req.chat.messages.add(role="user", content=text)
    else:
        req.text = text
    return req


def stream_generate(
    target: str, request: gen_pb.GenerateRequest, *, timeout: float | None = None, out: TextIO | None = None,
    credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
) -> StreamResult:
    """Stream ``request`` from the router at ``target``, writing each delta's text to ``out``;
    over TLS with ``credentials`` (kvroute.tls.channel_credentials), else plaintext; ``server_name``:
    the name the router's certificate is checked against (default: the ``target`` host).

    Raises:
        grpc.RpcError: the call failed (see :func:`describe_rpc_error`).
    """
    t0 = time.perf_counter()
    ttft = None
    final = None
    parts: list[str] = []
    with open_channel(target, credentials, server_name=server_name) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        call = stub.GenerateStream(request, timeout=timeout)
        for resp in call:
            if ttft is None:
                ttft = time.perf_counter() - t0
            if resp.text:
                parts.append(resp.text)
                if out is not None:
                    out.write(resp.text)
                    out.flush()
            if resp.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                final = resp
        trailers = dict(call.trailing_metadata() or ())
    if final is not None and not final.HasField("routing") and MD_REPLICA in trailers:
        # Behind a gateway the picker reports its pick in the trailers (router.picker).
        final.routing.replica_id = trailers[MD_REPLICA]
        final.routing.predicted_cached_tokens = int(trailers.get(MD_PREDICTED, "0") or 0)
    return StreamResult("".join(parts), final, ttft, time.perf_counter() - t0)


def summary_line(result: StreamResult) -> str:
    """``[finish length | tokens: prompt 9, completion 16, cached 0 | replica-0 (127.0.0.1:50101),
    predicted cached 0, policy kvroute | ttft 31 ms, total 140 ms]``"""
    f = result.final
    timing = f"ttft {_ms(result.ttft_s)}, total {_ms(result.total_s)}"
    if f is None:
        return f"[the stream ended without a final message | {timing}]"
    u, r = f.usage, f.routing
    parts = [
        f"finish {FINISH_REASONS.get(f.finish_reason, str(f.finish_reason))}"
        + (f" ({f.stop_str!r})" if f.WhichOneof("matched_stop") == "stop_str" else "")
        + (f" (token {f.stop_token_id})" if f.WhichOneof("matched_stop") == "stop_token_id" else ""),
        f"tokens: prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_tokens}",
    ]
    if f.HasField("routing"):  # behind a gateway only the pick and its prediction come (the trailers)
        where = f"{r.replica_id or 'a replica'} ({r.replica_address})" if r.replica_address else \
            f"{r.replica_id or 'a replica'} (via a gateway)"
        parts.append(f"{where}, predicted cached {r.predicted_cached_tokens}"
                     + (f", policy {r.policy}" if r.policy else ""))
    parts.append(timing)
    return "[" + " | ".join(parts) + "]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def generate_main(
    target: str, text: str, *, chat: bool = False, max_tokens: int | None = None, temperature: float | None = None,
    cache_salt: str = "", ignore_eos: bool = False, seed: int | None = None, timeout: float | None = None,
    out: TextIO | None = None, err: TextIO | None = None, credentials: grpc.ChannelCredentials | None = None,
    server_name: str = "",
) -> int:
    """``kvroute generate``: 0 on a finished stream, 1 on an RPC failure (one line on ``err``), 130
    on Ctrl-C (nothing more is printed: the text streamed so far is all the user gets);
    ``credentials``: TLS to the router (``--tls-ca-file`` ...), its certificate checked against
    ``server_name`` (``--tls-server-name``; default: the ``target`` host)."""
    out = out or sys.stdout
    err = err or sys.stderr
    request = build_request(text, chat=chat, max_tokens=max_tokens, temperature=temperature,
                            cache_salt=cache_salt, ignore_eos=ignore_eos, seed=seed)
    try:
        result = stream_generate(target, request, timeout=timeout, out=out, credentials=credentials,
                                 server_name=server_name)
    except grpc.RpcError as e:
        out.flush()
        err.write(("\n" if out is err else "") + f"kvroute generate: {describe_rpc_error(e, target)}\n")
        return 1
    except KeyboardInterrupt:  # leaving the channel's `with` has cancelled the call
        return 130
    out.write("\n")
    out.flush()
    err.write(summary_line(result) + "\n")
    err.flush()
    return 0 if result.final is not None else 1


__all__ = [
    "DEFAULT_TARGET", "StreamResult", "build_request", "describe_rpc_error", "generate_main", "parse_target",
    "stream_generate", "summary_line",
]
