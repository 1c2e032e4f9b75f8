"""``kvroute health --target HOST:PORT``: is this router ready to route? The probe of ``helm test``.

    grpc.health.v1 Check("readiness") ──▶ SERVING?            (the router has read the event streams)
    RouterService.Score(text=PROBE_TEXT) ──▶ any routable replica?   (discovered, heartbeating,
                                                                     hash-compatible; DESIGN.md §5)

Exit 0 with one line naming the routable replicas only when both hold; otherwise exit 1 with one
line saying which does not (unreachable router, readiness not SERVING, no replica known, or each
known replica with the router's reason why it is not routable).

``kvroute health --service NAME`` checks only grpc.health.v1 ``NAME`` (``readiness``,
``liveness``) of a router or a replica: the chart's exec probes when the ports serve TLS, which
Kubernetes' native gRPC probes cannot speak. Over TLS the credentials come from kvroute.tls
(``--tls-ca-file`` ...); ``--tls-server-name`` is the name the server's certificate is checked
against when the target is an address the certificate does not name (a probe dials 127.0.0.1).
Imports grpc, kvroute.tls and the generated code only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.counted import counted
from kvroute.tls import open_channel
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc

PROBE_TEXT = "kvroute health"
"""The prompt of the Score call: any text does; nothing is generated or committed."""

_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class HealthReport:
    """The outcome of one check: ``ok`` and the one line to print."""

    ok: bool
    line: str


def _channel(target: str, credentials: grpc.ChannelCredentials | None, server_name: str) -> grpc.Channel:
    return open_channel(target, credentials, server_name=server_name)


def check_service(target: str, service: str, timeout: float = 5.0, *,
                  credentials: grpc.ChannelCredentials | None = None, server_name: str = "") -> HealthReport:
    """Check one grpc.health.v1 service name (``readiness``, ``liveness``) of the router or replica
    at ``target`` (``host:port``) within ``timeout`` seconds: ok when it is SERVING.

    ``credentials``: TLS (kvroute.tls.channel_credentials; None = plaintext); ``server_name``: the
    name the server's certificate must carry ("" = the target's host). Never raises for what the
    server answers or fails to answer: every outcome is a report.
    """
    with _channel(target, credentials, server_name) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            ).status
        except grpc.RpcError as e:
            return HealthReport(False, f"{target}: health check {service!r} failed: {e.code().name}: {e.details()}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return HealthReport(status == _SERVING, f"{target}: {service} is {name}")


def check_health(target: str, timeout: float = 5.0, *, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "") -> HealthReport:
    """Check the router at ``target`` (``host:port``) within ``timeout`` seconds per call
    (``credentials``, ``server_name``: as in check_service).

    Never raises for what the router answers or fails to answer: every outcome is a report.
    """
    with _channel(target, credentials, server_name) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=timeout
            ).status
        except grpc.RpcError as e:
            return HealthReport(False, f"router at {target}: health check failed: {e.code().name}: {e.details()}")
        if status != _SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            return HealthReport(False, f"router at {target}: readiness is {name} (still reading the event streams"
                                       " from Redis, or shutting down)")
        try:
            scored = router_grpc.RouterServiceStub(channel).Score(
                router_pb.ScoreRequest(text=PROBE_TEXT), timeout=timeout
            )
        except grpc.RpcError as e:
            return HealthReport(False, f"router at {target}: Score failed: {e.code().name}: {e.details()}")
    routable = [r.replica_id for r in scored.replicas if r.routable]
    if routable:
        return HealthReport(True, f"router at {target}: SERVING, {counted(len(routable), 'routable replica')}: "
                                  + ", ".join(routable))
    if not scored.replicas:
        return HealthReport(False, f"router at {target}: SERVING but no replica is known (none heartbeating"
                                   " in its Redis namespace)")
    why = "; ".join(f"{r.replica_id} ({r.address}): {r.reason}" for r in scored.replicas)
    return HealthReport(False, f"router at {target}: SERVING but no replica is routable: {why}")


def health_main(target: str, timeout: float, *, service: str = "",
                credentials: grpc.ChannelCredentials | None = None, server_name: str = "") -> int:
    """``kvroute health``: print the report's line (stdout when healthy, stderr otherwise); 0 or 1.
    ``service`` set: check_service of that name only; else check_health."""
    tls = dict(credentials=credentials, server_name=server_name)
    report = check_service(target, service, timeout, **tls) if service else check_health(target, timeout, **tls)
    print(report.line, file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


__all__ = ["PROBE_TEXT", "HealthReport", "check_health", "check_service", "health_main"]
