"""``kvroute health --target HOST:PORT``: is this router ready to route? The probe of ``helm test``.

    grpc.health.v1 Check("readiness") ──▶ SERVING?            (the router has read the event streams)
    RouterService.Score(text=PROBE_TEXT) ──▶ any routable replica?   (discovered, heartbeating,
                                                                     hash-compatible; DESIGN.md §5)

Exit 0 with one line naming the routable replicas only when both hold; otherwise exit 1 with one
line saying which does not (unreachable router, readiness not SERVING, no replica known, or each
known replica with the router's reason why it is not routable). Imports grpc and the generated
code only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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


def check_health(target: str, timeout: float = 5.0) -> HealthReport:
    """Check the router at ``target`` (``host:port``) within ``timeout`` seconds per call.

    Never raises for what the router answers or fails to answer: every outcome is a report.
    """
    with grpc.insecure_channel(target) as channel:
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
        return HealthReport(True, f"router at {target}: SERVING, {len(routable)} routable replica(s): "
                                  + ", ".join(routable))
    if not scored.replicas:
        return HealthReport(False, f"router at {target}: SERVING but no replica is known (none heartbeating"
                                   " in its Redis namespace)")
    why = "; ".join(f"{r.replica_id} ({r.address}): {r.reason}" for r in scored.replicas)
    return HealthReport(False, f"router at {target}: SERVING but no replica is routable: {why}")


def health_main(target: str, timeout: float) -> int:
    """``kvroute health``: print the report's line (stdout when healthy, stderr otherwise); 0 or 1."""
    report = check_health(target, timeout)
    print(report.line, file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


__all__ = ["PROBE_TEXT", "HealthReport", "check_health", "health_main"]
