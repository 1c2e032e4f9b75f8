"""The cost model's weights are declared once (router.weights.ScoringWeights): the router's
settings and ``kvroute simulate``'s flags are made from that declaration, with its defaults."""

from __future__ import annotations

import argparse

import pytest

from kvroute.settings import load_settings
from kvroute_tools.simulate.flags import add_arguments as add_simulate_arguments
from router.settings import RouterSettings
from router.weights import WEIGHT_NAMES, ScoringWeights

# The documented defaults (docs/settings.md), written out by hand.
DEFAULTS = {"prefill_tokens_per_s": None, "decode_seconds_per_running": None, "prefill_work_weight": 30.0,
            "backlog_work_weight": 1.0, "cpu_match_weight": 0.5, "kv_footprint_weight": 2.0,
            "kv_usage_weight": 0.0, "in_flight_weight": 0.0}


def test_the_router_settings_carry_every_weight_with_its_default():
    assert set(WEIGHT_NAMES) == set(DEFAULTS)
    assert load_settings(RouterSettings, [], env={}).weights() == ScoringWeights(**DEFAULTS)


def test_a_router_flag_and_variable_set_the_weight():
    s = load_settings(RouterSettings, ["--prefill-work-weight", "5", "--in-flight-weight", "0.25"],
                      env={"KVROUTE_KV_USAGE_WEIGHT": "0.5"})
    assert s.weights() == ScoringWeights(**{**DEFAULTS, "prefill_work_weight": 5.0, "in_flight_weight": 0.25,
                                            "kv_usage_weight": 0.5})
    assert type(s.weights()) is ScoringWeights


def test_a_bad_weight_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"backlog_work_weight: must be >= 0, got -1.0"):
        load_settings(RouterSettings, ["--backlog-work-weight", "-1"], env={})
    with pytest.raises(ValueError, match=r"cpu_match_weight: must be in \[0, 1\], got 2.0"):
        load_settings(RouterSettings, [], env={"KVROUTE_CPU_MATCH_WEIGHT": "2"})


def test_simulate_takes_the_routers_own_weight_flags():
    p = argparse.ArgumentParser()
    add_simulate_arguments(p, requests=None, replicas="8", policies="kvroute")
    args = p.parse_args(["--prefill-work-weight", "5", "--kv-footprint-weight", "0"])
    assert (args.prefill_work_weight, args.kv_footprint_weight, args.backlog_work_weight) == (5.0, 0.0, None)
    with pytest.raises(SystemExit):  # the old spelling is gone
        p.parse_args(["--weights", "prefill_work_weight=5"])
