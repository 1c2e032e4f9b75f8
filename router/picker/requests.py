"""What the picker reads from a buffered request body: the prompt, as the ``GenerateRequest`` the
proxy would have been given. No I/O.

    :path /kvroute.v1.GenerationService/Generate | /GenerateStream
          body = one gRPC length-prefixed message (gRPC over HTTP/2):
          ┌──────────┬────────────────────┬──────────────────────────┐
          │ 1 byte   │ 4 bytes big-endian │ length bytes             │
          │ flag 0/1 │ length             │ GenerateRequest protobuf │
          └──────────┴────────────────────┴──────────────────────────┘
    :path /v1/completions         body = OpenAI JSON ─▶ kvroute.openai_api.completion_requests (one prompt)
    :path /v1/chat/completions    body = OpenAI JSON ─▶ kvroute.openai_api.chat_request

Anything else (GetModelInfo, other services) is no generation: the picker routes it to any
routable replica without a prompt (:func:`is_generation` is False).
"""

from __future__ import annotations

import json
import struct

from google.protobuf.message import DecodeError

from kvroute.openai_api import chat_request, completion_requests
from kvroute.prompt import InvalidRequestError
from kvroute.v1 import generation_pb2 as gen_pb

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
GRPC_GENERATION_PATHS = frozenset({f"/{GENERATION_SERVICE}/Generate", f"/{GENERATION_SERVICE}/GenerateStream"})
OPENAI_COMPLETIONS = "/v1/completions"
OPENAI_CHAT = "/v1/chat/completions"
_FRAME_HEADER = struct.Struct(">BI")  # compressed flag, message length


def is_generation(path: str) -> bool:
    """Whether a call on ``path`` (``:path`` without the query) carries a prompt to route by."""
    return path in GRPC_GENERATION_PATHS or path in (OPENAI_COMPLETIONS, OPENAI_CHAT)


def is_grpc(content_type: str) -> bool:
    return content_type.startswith("application/grpc")


def grpc_message(body: bytes) -> bytes:
    """The one message of a unary / server-streaming call's request body (its gRPC frame removed).

    Raises:
        InvalidRequestError: ``request``: no complete frame, a compressed one (the picker cannot
            decompress it; the gateway passes ``grpc-accept-encoding`` through), or bytes after it.
    """
    if len(body) < _FRAME_HEADER.size:
        raise InvalidRequestError("request", f"a gRPC frame needs 5 header bytes, the body has {len(body)}")
    flag, length = _FRAME_HEADER.unpack_from(body)
    if flag != 0:
        raise InvalidRequestError("request", "compressed gRPC messages are not accepted by the endpoint picker")
    end = _FRAME_HEADER.size + length
    if len(body) != end:
        raise InvalidRequestError("request", f"the gRPC frame says {length} bytes, the body has {len(body) - _FRAME_HEADER.size}")
    return body[_FRAME_HEADER.size:end]


def generate_request(path: str, content_type: str, body: bytes) -> gen_pb.GenerateRequest:
    """The ``GenerateRequest`` of a generation call's buffered body (the module docstring's table).

    Raises:
        InvalidRequestError: a body that does not parse (``request``), an OpenAI body the
            OpenAI API refuses (its field), or an OpenAI batch of several prompts (``prompt``:
            one call goes to one endpoint).
    """
    if path in GRPC_GENERATION_PATHS:
        if not is_grpc(content_type):
            raise InvalidRequestError("request", f"content-type {content_type!r} is not application/grpc")
        try:
            return gen_pb.GenerateRequest.FromString(grpc_message(body))
        except DecodeError as e:
            raise InvalidRequestError("request", f"not a GenerateRequest: {e}") from e
    try:
        parsed = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError("request", f"the body is not JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise InvalidRequestError("request", "the body must be a JSON object")
    if path == OPENAI_CHAT:
        return chat_request(parsed)
    requests = completion_requests(parsed)
    if len(requests) != 1:
        raise InvalidRequestError("prompt", f"one prompt per call through a gateway (got {len(requests)})")
    return requests[0]


__all__ = ["GRPC_GENERATION_PATHS", "OPENAI_CHAT", "OPENAI_COMPLETIONS", "generate_request", "grpc_message",
           "is_generation", "is_grpc"]
