"""ModelLimits: what the router validates a request against before routing (router/model_limits.py)."""

from __future__ import annotations

from kvroute.v1 import generation_pb2 as gen_pb
from router.model_limits import UNBOUNDED, ModelLimits


def info(vocab_size: int, max_model_len: int) -> gen_pb.ModelInfo:
    return gen_pb.ModelInfo(vocab_size=vocab_size, max_model_len=max_model_len)


def test_the_model_folder_applies_until_a_replica_answers_then_the_largest_known():
    limits = ModelLimits(529, 4096)
    assert limits.current == (529, 4096)
    assert limits.missing(["a:1", "b:1", ""]) == ["a:1", "b:1"]
    assert limits.missing(["a:1", "b:1"]) == []  # being asked
    limits.learn("a:1", info(529, 256))
    assert limits.current == (529, 256)
    limits.learn("b:1", info(529, 1024))
    assert limits.current == (529, 1024)
    limits.forget(["a:1"])
    assert limits.current == (529, 256)
    limits.forget([])
    assert limits.current == (529, 4096)


def test_a_failed_answer_is_asked_again_and_an_unknown_length_is_unbounded():
    limits = ModelLimits(100, 0)
    assert limits.current == (100, UNBOUNDED)
    assert limits.missing(["a:1"]) == ["a:1"]
    limits.learn("a:1", None)
    assert limits.missing(["a:1"]) == ["a:1"] and limits.current == (100, UNBOUNDED)
