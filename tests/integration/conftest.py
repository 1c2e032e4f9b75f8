"""Fixtures the integration modules share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def redis_server():
    """A throwaway redis-server for one test module (its replicas and routers share it)."""
    from kvroute_tools.redis_server import RedisServer

    with RedisServer() as server:
        yield server
