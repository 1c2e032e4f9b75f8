"""Fuzzing the replica's request conversion (replica/wire.py -> replica/engine/params.py) with
hypothesis: any GenerateRequest's sampling and prompt become engine values or an
InvalidRequestError naming a field (INVALID_ARGUMENT), never another exception."""

from __future__ import annotations

from hypothesis import given, settings

from kvroute.prompt import InvalidRequestError
from replica.engine.params import validate_request
from replica.wire import sampling_params_from_proto
from tests.support_fuzz import FUZZ_EXAMPLES, generate_requests

VOCAB = 500
MAX_MODEL_LEN = 64


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(generate_requests)
def test_any_request_is_engine_values_or_invalid_argument(request):
    try:
        params = sampling_params_from_proto(request.sampling if request.HasField("sampling") else None)
        ids = list(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else [1, 2, 3]
        max_tokens = validate_request(ids, params, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    except InvalidRequestError as e:
        assert e.field and str(e)
        return
    assert 1 <= max_tokens <= MAX_MODEL_LEN - len(ids)
    assert all(0 <= t < VOCAB for t in ids)
