"""``kvroute demo``: the replay routes with router.scoring's policies over real KV managers."""

from __future__ import annotations

import pytest

from kvroute_tools.cli import main
from kvroute_tools.demo import replay


def _prompts() -> list[list[int]]:
    # Three conversations of three turns each (32, 48, 64 tokens), each turn extending the previous
    # one's prompt, sent turn by turn: round robin over four replicas deals every turn elsewhere.
    convs = [[1000 * c + t for t in range(64)] for c in range(3)]
    return [convs[c][: 32 + 16 * turn] for turn in range(3) for c in range(3)]


def test_kvroute_keeps_each_conversation_on_the_replica_that_holds_its_prefix():
    row = replay(_prompts(), "kvroute", replicas=4, num_blocks=64, block_size=16, concurrency=0)
    rr = replay(_prompts(), "round_robin", replicas=4, num_blocks=64, block_size=16, concurrency=0)
    # Under kvroute turns 2 and 3 hit their whole previous prompt (2 then 3 blocks of 16 tokens);
    # round robin deals each turn to a replica that has never seen the conversation.
    assert row.hit_rate == pytest.approx((32 + 48) / (32 + 48 + 64))
    assert sum(row.per_replica) == 9
    assert rr.hit_rate == 0.0
    assert rr.per_replica == (3, 2, 2, 2)


def test_the_in_flight_window_spreads_requests_that_share_nothing():
    prompts = [[7000 + 100 * i + t for t in range(48)] for i in range(8)]
    row = replay(prompts, "kvroute", replicas=4, num_blocks=64, block_size=16, concurrency=3)
    assert row.per_replica == (2, 2, 2, 2)
    assert row.hit_rate == 0.0


def test_demo_rejects_a_negative_concurrency(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--concurrency", "-1"])
    assert exc.value.code == 2
    assert "--concurrency: must be >= 0" in capsys.readouterr().err
