"""Hypothesis strategies of hostile gRPC requests, shared by the router's and the replica's request
conversion fuzz tests (``from tests.support_fuzz import generate_requests``)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvroute.v1 import generation_pb2 as gen_pb

FUZZ_EXAMPLES = 150
"""Examples per request fuzz test (bounded: the suite's time)."""

_f32 = st.floats(width=32)  # NaN and infinities included


@st.composite
def sampling(draw) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(
        stop=draw(st.lists(st.text(max_size=6), max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
    )
    for name, values in (("max_tokens", st.integers(0, 2**32 - 1)), ("min_tokens", st.integers(0, 2**32 - 1)),
                         ("temperature", _f32), ("top_p", _f32), ("top_k", st.integers(-2**31, 2**31 - 1)),
                         ("min_p", _f32), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(msg, name, draw(values))
    return msg


@st.composite
def _built(draw) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(request_id=draw(st.text(max_size=8)), cache_salt=draw(st.text(max_size=8)))
    kind = draw(st.sampled_from(["none", "text", "token_ids", "chat"]))
    if kind == "text":
        req.text = draw(st.text(max_size=40))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=40)))
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.text(max_size=10), st.text(max_size=20)), max_size=3)):
            req.chat.messages.add(role=role, content=content)
        if not req.chat.messages:
            req.chat.SetInParent()
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    return req


def _parsed(data: bytes) -> gen_pb.GenerateRequest | None:
    try:
        return gen_pb.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: gRPC refuses these bytes before a servicer
        return None


generate_requests = st.one_of(
    _built(),
    st.binary(max_size=64).map(_parsed).filter(lambda r: r is not None),
)
"""GenerateRequests as a hostile client can send them: any field values, or any bytes that parse."""
