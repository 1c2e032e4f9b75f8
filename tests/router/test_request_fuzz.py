"""Fuzzing the router's request conversion (router/proxy.py: kvroute.prompt.PromptTokenizer, then
the decision's hash chain) with hypothesis: any GenerateRequest becomes token ids in the
vocabulary and block hashes, or an InvalidRequestError naming a field (INVALID_ARGUMENT), never
another exception."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings

from kvroute.hashing import BlockHasher
from kvroute.prompt import InvalidRequestError, PromptTokenizer
from router.core import Router
from router.index import BlockIndex
from router.load import LoadTracker
from router.policies.registry import make_policy
from router.registry import ReplicaRegistry
from router.scoring import ScoringWeights
from tests.support_fuzz import FUZZ_EXAMPLES, generate_requests


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return PromptTokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def router():
    hasher = BlockHasher()
    return Router(hasher, BlockIndex(), ReplicaRegistry(hasher.identity, "redis"), LoadTracker(),
                  make_policy("kvroute", ScoringWeights(), 0), threading.Lock())


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=generate_requests)
def test_any_request_is_token_ids_and_hashes_or_invalid_argument(tokenizer, router, request):
    try:
        ids = tokenizer.token_ids(request)
    except InvalidRequestError as e:
        assert e.field.startswith("prompt") and str(e)
        return
    assert ids and all(0 <= t < tokenizer.vocab_size for t in ids)
    decision = router.decide(ids, request.cache_salt or None, ())
    assert decision.picked is None and len(decision.block_hashes) == len(ids) // router.hasher.block_size
