"""``kvroute demo`` is ``kvroute simulate`` with small defaults: one routing implementation, the
router's, over real KV managers. The scenarios the old demo was tested on, through the simulator."""

from __future__ import annotations

import pytest

from kvroute_tools.cli import main
from kvroute_tools.simulate.cluster import SimConfig, simulate
from kvroute_tools.trace import TRACE_BLOCK_TOKENS, TraceRequest


def _trace(prompts: list[tuple[int, ...]], gap_ms: float) -> list[TraceRequest]:
    # 16 tokens per trace block = one KV block; input_length is in 512-token units.
    return [TraceRequest(gap_ms * i, len(ids) * TRACE_BLOCK_TOKENS, 1, ids) for i, ids in enumerate(prompts)]


def _cfg() -> SimConfig:
    return SimConfig(replicas=4, num_blocks=64, block_size=16, tokens_per_block=16)


def test_kvroute_keeps_each_conversation_on_the_replica_that_holds_its_prefix():
    # Three conversations of three turns each (2, 3, 4 blocks), each turn extending the previous
    # one's prompt, sent turn by turn: round robin over four replicas deals every turn elsewhere.
    convs = [tuple(1000 * c + t for t in range(4)) for c in range(3)]
    trace = _trace([convs[c][: 2 + turn] for turn in range(3) for c in range(3)], gap_ms=1000)
    row, rr = simulate(trace, _cfg(), "kvroute"), simulate(trace, _cfg(), "round_robin")
    prompt = sum(r.prompt_tokens for r in row.requests)
    # Under kvroute turns 2 and 3 hit their whole previous prompt (2 then 3 blocks of 16 tokens).
    assert sum(r.cached_tokens for r in row.requests) / prompt == pytest.approx(3 * (32 + 48) / prompt)
    assert sum(row.routed) == 9
    assert sum(r.cached_tokens for r in rr.requests) == 0
    assert rr.routed == [3, 2, 2, 2]


def test_in_flight_load_spreads_requests_that_share_nothing():
    trace = _trace([tuple(7000 + 100 * i + t for t in range(3)) for i in range(8)], gap_ms=0)
    row = simulate(trace, _cfg(), "kvroute")
    assert row.routed == [2, 2, 2, 2]
    assert sum(r.cached_tokens for r in row.requests) == 0


def test_demo_prints_the_table_of_simulate(capsys):
    assert main(["demo", "--requests", "40"]) == 0
    out = capsys.readouterr().out
    assert "4 replicas x" in out and "round_robin" in out and "kvroute" in out and "pooled LRU" in out


def test_demo_rejects_a_bad_request_count(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--requests", "0"])
    assert exc.value.code == 2
    assert "--requests: must be >= 1" in capsys.readouterr().err
