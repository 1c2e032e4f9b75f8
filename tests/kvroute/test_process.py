"""kvroute.process: where a server process's Prometheus endpoint listens.

The router's and the replica's real entry points (``ServerMain.serve`` with their settings) are run
with a probe in place of the gRPC server: its ``start`` reads where the endpoint that ``serve`` set
up is bound and fails, which ends ``serve`` at once. Reachability is tested for real over two
loopback addresses (Linux routes all of 127.0.0.0/8 to ``lo``): an endpoint bound to 127.0.0.1
refuses a connection to 127.0.0.2, one bound to every interface accepts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import urllib.request

import pytest

import replica.server
import router.server
from replica.settings import ReplicaSettings
from router.settings import RouterSettings


class _Probed(Exception):
    def __init__(self, host: str, reachable_on_127_0_0_2: bool):
        self.host, self.reachable_on_127_0_0_2 = host, reachable_on_127_0_0_2


class _ProbeServer:
    def __init__(self, telemetry):
        self.telemetry = telemetry

    async def start(self) -> None:
        host, port = self.telemetry._http_server.server_address[:2]
        raise _Probed(host, _connects("127.0.0.2", port))

    async def stop(self, grace: float = 0) -> None:
        pass


def _bound(main, settings) -> tuple[str, bool]:
    """(the endpoint's bound address, whether 127.0.0.2 reached it) while ``main.serve`` ran."""
    probe = dataclasses.replace(main, make_server=lambda _settings, telemetry: _ProbeServer(telemetry))
    with pytest.raises(_Probed) as got:
        asyncio.run(probe.serve(settings))
    return got.value.host, got.value.reachable_on_127_0_0_2


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


MAINS = {
    "router": (router.server.serve.__self__, RouterSettings),
    "replica": (replica.server.serve.__self__, ReplicaSettings),
}


@pytest.mark.parametrize("kind", sorted(MAINS))
def test_metrics_listen_on_the_host_setting_by_default(kind):
    main, settings_cls = MAINS[kind]
    assert _bound(main, settings_cls(host="127.0.0.1", port=0, metrics_port=0)) == ("127.0.0.1", False)


@pytest.mark.parametrize("kind", sorted(MAINS))
def test_metrics_follow_a_non_default_host(kind):
    main, settings_cls = MAINS[kind]
    assert _bound(main, settings_cls(host="127.0.0.2", port=0, metrics_port=0)) == ("127.0.0.2", True)


@pytest.mark.parametrize("kind", sorted(MAINS))
def test_metrics_host_overrides_host(kind):
    main, settings_cls = MAINS[kind]
    settings = settings_cls(host="127.0.0.1", port=0, metrics_port=0, metrics_host="0.0.0.0")
    assert _bound(main, settings) == ("0.0.0.0", True)


def test_the_endpoint_bound_to_loopback_serves_there_and_nowhere_else():
    """The endpoint itself, live: answers /metrics on 127.0.0.1, refuses 127.0.0.2; on 0.0.0.0, both."""
    from kvroute.telemetry import setup_telemetry

    for host, reachable_elsewhere in (("127.0.0.1", False), ("0.0.0.0", True)):
        telemetry = setup_telemetry("probe", 0, metrics_host=host, otlp=False)
        try:
            port = telemetry.metrics_port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                assert resp.status == 200
            assert _connects("127.0.0.2", port) is reachable_elsewhere, host
        finally:
            telemetry.shutdown()


def test_metrics_host_is_a_flag_and_a_variable_of_both_processes():
    from kvroute.settings import load_settings

    for cls in (RouterSettings, ReplicaSettings):
        assert load_settings(cls, ["--metrics-host", "10.0.0.5"], env={}).metrics_host == "10.0.0.5"
        assert load_settings(cls, [], env={"KVROUTE_METRICS_HOST": "::"}).metrics_host == "::"
        assert load_settings(cls, [], env={}).metrics_host == ""
