"""bench/engine.py: a timed run never starts warm without saying so (a refused prefix-cache reset
is an error, not a silent warm run)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench.engine import engine_decode  # noqa: E402
from replica.engine.params import SamplingParams  # noqa: E402
from replica.kv import KVCacheError  # noqa: E402
from tests.support import make_cpu_engine, random_tokens  # noqa: E402


def test_engine_decode_refuses_to_run_when_the_prefix_cache_cannot_be_reset(default_model_dir):
    engine = make_cpu_engine(default_model_dir, num_blocks=16)
    engine.add_request(random_tokens(40, seed=1), SamplingParams(max_tokens=4, temperature=0.0), request_id="held")
    engine.step()  # "held" now owns blocks: the reset must be refused
    with pytest.raises(KVCacheError, match="reset_prefix_cache: refused"):
        engine_decode(engine, [random_tokens(20, seed=2)], 2)
