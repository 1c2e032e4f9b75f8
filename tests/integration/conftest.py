"""Fixtures the integration modules share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def redis_server():
    """A throwaway redis-server for one test module (its replicas and routers share it)."""
    from kvroute_tools.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Test certificates (tests.support_tls): ``ca`` and ``other_ca`` (CA files), and (cert, key)
    files for ``replica``, ``router``, ``client`` (all of ``ca``) and ``stranger`` (of ``other_ca``),
    each valid for 127.0.0.1 and localhost."""
    from tests.support_tls import TestCA

    folder = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(folder, "kvroute-test-ca"), TestCA(folder, "other-ca")
    return {"ca": str(ca.file), "other_ca": str(other.file), "replica": ca.issue("replica"),
            "router": ca.issue("router"), "client": ca.issue("client"), "stranger": other.issue("stranger")}


@pytest.fixture(scope="module")
def receiver():
    """A real OTLP receiver, gRPC and HTTP (tests.support_otlp), for one module."""
    from tests.support_otlp import OtlpReceiver

    with OtlpReceiver() as r:
        yield r
