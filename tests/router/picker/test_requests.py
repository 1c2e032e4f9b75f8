"""router.picker.requests: the prompt of a buffered body, gRPC-framed or OpenAI JSON (no I/O)."""

from __future__ import annotations

import json

import pytest

from kvroute.prompt import InvalidRequestError
from kvroute.v1 import generation_pb2 as gen_pb
from router.picker.requests import generate_request, grpc_message, is_generation

STREAM = "/kvroute.v1.GenerationService/GenerateStream"
GRPC = "application/grpc"


def frame(msg: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(msg).to_bytes(4, "big") + msg


def test_a_framed_generate_request_comes_back_as_sent():
    req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[5, 6, 7]), cache_salt="t",
                                 sampling=gen_pb.SamplingParams(max_tokens=3))
    assert generate_request(STREAM, GRPC, frame(req.SerializeToString())) == req
    assert generate_request("/kvroute.v1.GenerationService/Generate", "application/grpc+proto",
                            frame(req.SerializeToString())) == req


@pytest.mark.parametrize(("body", "says"), [
    (b"\x00\x00\x00", "5 header bytes"),
    (frame(b"abc", flag=1), "compressed"),
    (frame(b"abc") + b"x", "the gRPC frame says 3 bytes, the body has 4"),
    (frame(b"\xff\xff"), "not a GenerateRequest"),
])
def test_a_bad_grpc_body_is_refused_naming_request(body, says):
    with pytest.raises(InvalidRequestError) as err:
        generate_request(STREAM, GRPC, body)
    assert err.value.field == "request" and says in err.value.reason


def test_the_grpc_path_needs_a_grpc_content_type():
    with pytest.raises(InvalidRequestError, match="content-type 'application/json'"):
        generate_request(STREAM, "application/json", frame(b""))


def test_openai_bodies_become_the_requests_the_openai_api_makes():
    chat = generate_request("/v1/chat/completions", "application/json", json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "cache_salt": "a"}).encode())
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "hi")]
    assert chat.sampling.max_tokens == 4 and chat.cache_salt == "a"
    completion = generate_request("/v1/completions", "application/json", b'{"model": "m", "prompt": [1, 2, 3]}')
    assert list(completion.token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize(("body", "field"), [
    (b"{not json", "request"),
    (b"[1, 2]", "request"),
    (b'{"prompt": ["a", "b"]}', "prompt"),  # one call goes to one endpoint
    (b'{"prompt": 7}', "prompt"),
])
def test_a_bad_openai_body_is_refused_naming_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        generate_request("/v1/completions", "application/json", body)
    assert err.value.field == field


def test_only_the_generation_paths_carry_a_prompt():
    assert is_generation(STREAM) and is_generation("/v1/chat/completions")
    assert not is_generation("/kvroute.v1.GenerationService/GetModelInfo")
    assert grpc_message(frame(b"xyz")) == b"xyz"
