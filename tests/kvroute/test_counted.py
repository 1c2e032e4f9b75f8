"""kvroute.counted: a count and its noun, singular for exactly one."""

from __future__ import annotations

import pytest

from kvroute.counted import counted


@pytest.mark.parametrize(("n", "noun", "text"), [
    (1, "request", "1 request"),
    (0, "request", "0 requests"),
    (2, "replica", "2 replicas"),
    (1, "routable replica", "1 routable replica"),
    (3, "routable replica", "3 routable replicas"),
    (-1, "token", "-1 tokens"),
])
def test_one_is_singular_every_other_count_plural(n, noun, text):
    assert counted(n, noun) == text


def test_an_irregular_plural_and_a_format_spec():
    assert counted(2, "index", "indices") == "2 indices"
    assert counted(1, "index", "indices") == "1 index"
    assert counted(12345, "prompt token", spec=",") == "12,345 prompt tokens"
