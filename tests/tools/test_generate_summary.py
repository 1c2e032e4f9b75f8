"""``kvroute generate``'s summary line, from hand-built final messages: a router's full routing,
and the pick alone that comes back through a gateway (the trailers carry no policy, no address)."""

from __future__ import annotations

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute_tools.client import StreamResult, summary_line


def _final(**routing) -> gen_pb.GenerateResponse:
    final = gen_pb.GenerateResponse(finish_reason=gen_pb.FINISH_REASON_LENGTH)
    final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens = 9, 16, 0
    final.routing.SetInParent()
    for name, value in routing.items():
        setattr(final.routing, name, value)
    return final


def test_a_routers_answer_names_the_replica_its_address_and_the_policy():
    final = _final(replica_id="replica-0", replica_address="127.0.0.1:50101", predicted_cached_tokens=16,
                   policy="kvroute")
    assert summary_line(StreamResult("x", final, 0.031, 0.140)) == (
        "[finish length | tokens: prompt 9, completion 16, cached 0 | replica-0 (127.0.0.1:50101), predicted cached"
        " 16, policy kvroute | ttft 31 ms, total 140 ms]")


def test_through_a_gateway_it_says_so_instead_of_question_marks():
    final = _final(replica_id="replica-0", predicted_cached_tokens=0)
    assert summary_line(StreamResult("x", final, 0.031, 0.140)) == (
        "[finish length | tokens: prompt 9, completion 16, cached 0 | replica-0 (via a gateway), predicted cached 0"
        " | ttft 31 ms, total 140 ms]")
