"""kvroute.sampling: SamplingParams defaults, request validation (every error names its field; the
router and the replica both call it) and the length clamp."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from kvroute.prompt import InvalidRequestError
from kvroute.sampling import ROOM_LEFT, SamplingParams, effective_max_tokens, validate_request

VOCAB = 100
MAX_MODEL_LEN = 32


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 0, 1.0, 1.0, -1, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, (), (), False)
    assert not p.is_greedy and not p.top_k_enabled
    p.validate(VOCAB)


def test_stop_fields_are_stored_as_tuples_and_a_lone_string_is_one_stop():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert p.stop == ("a", "b") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="###").stop == ("###",)
    hash(p)  # frozen and hashable


def test_invalid_request_error_formats_field_and_reason():
    err = InvalidRequestError("top_p", "must be in (0, 1], got 2")
    assert str(err) == "top_p: must be in (0, 1], got 2"
    assert (err.field, err.reason) == ("top_p", "must be in (0, 1], got 2")
    assert isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert (again.field, again.reason, str(again)) == (err.field, err.reason, str(err))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > default max_tokens=16
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop_token_ids": (5, VOCAB)}, "stop_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
    ],
)
def test_each_bad_sampling_value_is_rejected_naming_its_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        validate_request([1, 2, 3], SamplingParams(**kwargs), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 1e-6},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"top_k": 10_000},  # larger than the vocabulary: off
        {"min_p": 1.0},
        {"min_tokens": 16},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"stop_token_ids": (0, VOCAB - 1)},
        {"max_tokens": 1},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 2.5},
        {"presence_penalty": -2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    validate_request([1], SamplingParams(**kwargs), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)


def test_unknown_stop_token_message_names_the_token():
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids: unknown stop token 100 at index 1"):
        SamplingParams(stop_token_ids=(5, 100)).validate(VOCAB)


def test_empty_prompt_is_rejected_as_prompt():
    with pytest.raises(InvalidRequestError) as info:
        validate_request([], SamplingParams(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    assert info.value.field == "prompt"


def test_prompt_that_leaves_no_room_for_one_token_is_rejected_with_both_lengths():
    validate_request([1] * (MAX_MODEL_LEN - 1), SamplingParams(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(InvalidRequestError) as info:
        validate_request([1] * MAX_MODEL_LEN, SamplingParams(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    assert info.value.field == "prompt"
    assert str(MAX_MODEL_LEN) in info.value.reason and str(MAX_MODEL_LEN - 1) in info.value.reason


@pytest.mark.parametrize(("ids", "index", "value"), [([1, 2, VOCAB, -1], 2, VOCAB), ([-1, 5], 0, -1)])
def test_out_of_vocabulary_prompt_token_names_first_bad_index_and_value(ids, index, value):
    with pytest.raises(InvalidRequestError) as info:
        validate_request(ids, SamplingParams(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    assert info.value.field == "prompt.token_ids"
    assert f"token id {value} at index {index}" in info.value.reason


def test_prompt_checks_come_before_sampling_checks():
    with pytest.raises(InvalidRequestError) as info:
        validate_request([VOCAB], SamplingParams(top_p=0.0), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    assert info.value.field == "prompt.token_ids"


def test_numpy_prompt_ids_are_accepted():
    ids = np.arange(5, dtype=np.int64)
    assert validate_request(ids, SamplingParams(), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == 16


def test_effective_max_tokens_is_clamped_to_the_room_left_in_the_model():
    params = SamplingParams(max_tokens=16)
    assert validate_request([1] * 10, params, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == 16
    assert validate_request([1] * 20, params, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == 12
    assert validate_request([1] * 31, params, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == 1
    assert effective_max_tokens(params, prompt_len=20, max_model_len=MAX_MODEL_LEN) == 12


def test_max_tokens_above_max_model_len_is_refused_and_room_left_takes_what_fits():
    with pytest.raises(InvalidRequestError) as info:
        validate_request([1] * 5, SamplingParams(max_tokens=MAX_MODEL_LEN + 1), vocab_size=VOCAB,
                         max_model_len=MAX_MODEL_LEN)
    assert info.value.field == "max_tokens"
    assert f"max_model_len={MAX_MODEL_LEN}" in info.value.reason and str(MAX_MODEL_LEN + 1) in info.value.reason
    at_limit = SamplingParams(max_tokens=MAX_MODEL_LEN)
    assert validate_request([1] * 5, at_limit, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == MAX_MODEL_LEN - 5
    room = SamplingParams(max_tokens=ROOM_LEFT)
    assert validate_request([1] * 5, room, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN) == MAX_MODEL_LEN - 5
