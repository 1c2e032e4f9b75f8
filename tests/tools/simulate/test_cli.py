"""``kvroute simulate``'s command line: flag errors exit 2 naming the flag; --out writes JSON + PNGs."""

from __future__ import annotations

import json

import pytest

from kvroute_tools.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--policies", "kvroute,nope"], "--policies: unknown 'nope'"),
    (["--replicas", "4,x"], "--replicas: expected comma-separated integers"),
    (["--cache-fraction", "0"], "--cache-fraction: must be > 0"),
    (["--load", "0"], "load: must be > 0"),
    (["--routers", "0"], "--routers: must be >= 1, got 0"),
    (["--load-sync-interval", "-1"], "--load-sync-interval: must be >= 0, got -1"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--requests", "5", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_holds_the_rows_and_the_charts(tmp_path, capsys):
    argv = ["simulate", "--requests", "30", "--replicas", "2,4", "--policies", "kvroute,chwbl",
            "--num-blocks", "400", "--load", "0.7", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "simulate.json").read_text())
    assert [(r["replicas"], r["policy"]) for r in doc["rows"]] == [(2, "kvroute"), (2, "chwbl"), (4, "kvroute"),
                                                                     (4, "chwbl")]
    assert set(doc["oracles"]) == {"2", "4"}
    for name in ("hit_ttft_vs_replicas.png", "ttft_cdf_2.png", "ttft_cdf_4.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "oracles (hit rate in prompt tokens)" in capsys.readouterr().out


def test_several_routers_are_named_in_the_table_header(capsys):
    argv = ["simulate", "--requests", "20", "--replicas", "2", "--policies", "kvroute", "--num-blocks", "400",
            "--routers", "2", "--load-sync-interval", "0.5", "--no-progress"]
    assert main(argv) == 0
    assert "2 replicas x 399 blocks of 512 tokens, time scale 1, 2 routers syncing every 0.5 s" in capsys.readouterr().out


def test_a_request_larger_than_a_replica_exits_2(capsys):
    assert main(["simulate", "--requests", "5", "--num-blocks", "3", "--no-progress"]) == 2
    assert "raise --num-blocks" in capsys.readouterr().err
