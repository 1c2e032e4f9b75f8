"""The router's vLLM upstream (router/vllm_upstream.py): the completions body it sends and the
deltas it makes of vLLM's stream. The chunks are vLLM 0.32's ``/v1/completions`` stream with
``return_token_ids`` and ``stream_options.include_usage`` as captured in tests/data/vllm_http/
(its README says how); the expected deltas are worked by hand from them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from router.vllm_upstream import CompletionStream, completions_body

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_http"


def test_the_body_sends_token_ids_and_only_the_sampling_fields_that_were_set():
    request = rep_pb.ReplicaGenerateRequest(
        request_id="r1", token_ids=[5, 6, 7], cache_salt="tenant-a",
        sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"], stop_token_ids=[2], ignore_eos=True,
                                       repetition_penalty=1.1, frequency_penalty=0.5))
    assert completions_body("tiny", request) == {
        "model": "tiny", "prompt": [5, 6, 7], "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True, "max_tokens": 4, "temperature": 0.0, "stop": ["\n"], "stop_token_ids": [2],
        "ignore_eos": True, "cache_salt": "tenant-a", "repetition_penalty": 1.1, "frequency_penalty": 0.5,
    }
    bare = completions_body("tiny", rep_pb.ReplicaGenerateRequest(token_ids=[1]))
    assert bare == {"model": "tiny", "prompt": [1], "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True}  # vLLM's defaults are the replica's: nothing else is sent


def captured(name: str) -> list[dict]:
    lines = (DATA / name).read_text().splitlines()
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_a_captured_stream_becomes_deltas_whose_last_carries_finish_reason_and_usage():
    meta = json.loads((DATA / "meta.json").read_text())
    parser = CompletionStream("r1")
    deltas = [d for chunk in captured("stream_max_tokens.sse") for d in parser.feed(chunk)]
    assert [d.request_id for d in deltas] == ["r1"] * len(deltas)
    # Every generated token once, in order, and its text (vLLM's own non-streamed answer).
    assert [t for d in deltas for t in d.token_ids] == meta["max_tokens"]["token_ids"]
    assert "".join(d.text for d in deltas) == meta["max_tokens"]["text"]
    final = deltas[-1]
    assert [d.finish_reason for d in deltas[:-1]] == [gen_pb.FINISH_REASON_UNSPECIFIED] * (len(deltas) - 1)
    assert final.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        meta["max_tokens"]["prompt_tokens"], len(meta["max_tokens"]["token_ids"]))
    # The non-streamed copy ran first and stored the prompt's full blocks: 70 // 32 = 2 blocks.
    assert final.usage.cached_tokens == len(meta["max_tokens"]["prompt"]) // 32 * meta["max_tokens"]["block_size"]
    assert parser.end() == []  # the stream's end after the usage chunk adds nothing


def test_a_stop_string_is_the_final_deltas_matched_stop():
    parser = CompletionStream("r2")
    deltas = [d for chunk in [
        {"id": "c", "choices": [{"index": 0, "text": "ab", "token_ids": [10, 11], "finish_reason": None}]},
        {"id": "c", "choices": [{"index": 0, "text": "", "token_ids": [12], "finish_reason": "stop",
                                 "stop_reason": "\n"}]},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 3, "total_tokens": 67,
                                             "prompt_tokens_details": {"cached_tokens": 32}}},
    ] for d in parser.feed(chunk)]
    assert [list(d.token_ids) for d in deltas] == [[10, 11], [12]]
    assert deltas[-1].stop_str == "\n" and deltas[-1].finish_reason == gen_pb.FINISH_REASON_STOP
    assert (deltas[-1].usage.prompt_tokens, deltas[-1].usage.completion_tokens, deltas[-1].usage.cached_tokens) == (
        64, 3, 32)


def test_a_stop_token_is_the_final_deltas_matched_stop_and_a_stream_without_usage_still_ends():
    parser = CompletionStream("r3")
    assert parser.feed({"choices": [{"index": 0, "text": "", "token_ids": [2], "finish_reason": "stop",
                                     "stop_reason": 2}]}) == []  # held for the usage chunk
    (final,) = parser.end()
    assert final.stop_token_id == 2 and list(final.token_ids) == [2]


def test_an_error_event_or_a_stream_that_never_finishes_is_an_error_with_a_status():
    with pytest.raises(grpc.aio.AioRpcError) as err:
        CompletionStream("r4").feed({"error": {"message": "max_tokens: too large", "type": "BadRequestError",
                                               "code": 400}})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == "max_tokens: too large"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        CompletionStream("r5").end()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
