"""kvroute.openai_api: OpenAI bodies become SamplingParams, bad values are refused naming the field."""

from __future__ import annotations

import pytest

from kvroute.openai_api import sampling_from_body
from kvroute.prompt import InvalidRequestError
from kvroute.sampling import sampling_params_from_proto, validate_request
from kvroute.v1 import generation_pb2 as gen_pb


def refusal(body: dict, *, chat: bool = False) -> str:
    with pytest.raises(InvalidRequestError) as info:
        sampling_from_body(body, chat=chat)
    return str(info.value)


@pytest.mark.parametrize("value", [-5, -1, 0])
def test_every_max_tokens_below_one_gets_the_same_message(value):
    assert refusal({"max_tokens": value}) == f"max_tokens: must be at least 1, got {value}"
    assert refusal({"max_completion_tokens": value}, chat=True) == \
        f"max_completion_tokens: must be at least 1, got {value}"


def test_the_grpc_path_refuses_max_tokens_zero_with_the_http_message():
    params = sampling_params_from_proto(gen_pb.SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError) as info:
        validate_request([1, 2], params, vocab_size=10, max_model_len=100)
    assert str(info.value) == "max_tokens: must be at least 1, got 0"


def test_min_tokens_and_seed_may_be_zero_but_not_negative():
    sp = sampling_from_body({"min_tokens": 0, "seed": 0}, chat=False)
    assert sp.min_tokens == 0 and sp.seed == 0
    assert refusal({"min_tokens": -1}) == "min_tokens: must be at least 0, got -1"
    assert refusal({"seed": -1}) == "seed: must be at least 0, got -1"


@pytest.mark.parametrize(("body", "message"), [
    ({"logprobs": True}, "logprobs: not supported by this server"),
    ({"logprobs": 1}, "logprobs: not supported by this server"),
    ({"top_logprobs": 3}, "top_logprobs: not supported by this server"),
    ({"echo": True}, "echo: not supported by this server"),
    ({"use_beam_search": True}, "use_beam_search: not supported by this server"),
    ({"length_penalty": 0.5}, "length_penalty: only 1 or 1.0 is supported by this server, got 0.5"),
    ({"guided_regex": "a+"}, "guided_regex: not supported by this server"),
    ({"tools": [{"type": "function"}]}, "tools: not supported by this server"),
    ({"n": 2}, "n: only 1 is supported by this server, got 2"),
    ({"best_of": 3}, "best_of: only 1 is supported by this server, got 3"),
])
def test_unsupported_values_are_refused_in_words(body, message):
    assert refusal(body) == message


def test_the_supported_values_of_unsupported_fields_pass():
    sampling_from_body({"n": 1, "logprobs": False, "echo": False, "tools": [], "use_beam_search": False,
                        "skip_special_tokens": True}, chat=False)


def test_the_penalties_reach_the_wire_as_given():
    sp = sampling_from_body({"repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 1}, chat=True)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.1, -0.5, 1.0)
    assert not sampling_from_body({}, chat=True).HasField("repetition_penalty")  # unset: the default
