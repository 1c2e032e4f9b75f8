"""The ports ``kvroute up`` gives its processes: fixed ones checked free, the rest picked free, none
twice (kvroute_tools.cluster's ``LocalCluster.start`` uses the plan).

    ClusterConfig ─▶ plan_ports ─▶ PortPlan(router, replicas, replica_http, router_http, metrics)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvroute_tools.redis_server import free_port
from kvroute_tools.supervise import port_free


class ClusterError(RuntimeError):
    """The cluster could not start (the message names the process, and its log's last lines)."""


@dataclass
class PortPlan:
    """Every port of one local cluster: the router's gRPC port, the replicas' gRPC ports, the
    replicas' HTTP ports (empty: off), the router's HTTP port (-1: off) and, with ``metrics``, a
    Prometheus port per process name (``router``, ``replica-0``, ...)."""

    router: int
    replicas: list[int]
    replica_http: list[int] = field(default_factory=list)
    router_http: int = -1
    metrics: dict[str, int] = field(default_factory=dict)

    def taken(self) -> list[int]:
        return [self.router, *self.replicas, *self.replica_http, self.router_http, *self.metrics.values()]


def plan_ports(cfg: Any) -> PortPlan:
    """The ports for ``cfg`` (a ``ClusterConfig``).

    Raises:
        ClusterError: a configured port (``--router-port``, ``--base-port``,
            ``--replica-http-base-port``, ``--router-http-port``) is taken; the message names the flag.
    """
    plan = PortPlan(*_grpc_ports(cfg))
    if cfg.replica_http_base_port:
        ports = [cfg.replica_http_base_port + i for i in range(cfg.replicas)]
        busy = [p for p in ports if p in plan.taken() or not port_free(cfg.host, p)]
        if busy:
            raise ClusterError(f"--replica-http-base-port: port(s) {', '.join(map(str, busy))} on {cfg.host} are taken")
        plan.replica_http = ports
    port = cfg.router_http_port
    if port >= 0:
        if port and not port_free(cfg.host, port):
            raise ClusterError(f"router_http_port: port {port} on {cfg.host} is taken")
        while not port or port in plan.taken():
            port = free_port(cfg.dial_host)
        plan.router_http = port
    if cfg.metrics:
        for name in ("router", *(f"replica-{i}" for i in range(cfg.replicas))):
            port = 0
            while not port or port in plan.taken():
                port = free_port(cfg.dial_host)
            plan.metrics[name] = port
    return plan


def metrics_flags(name: str, ports: dict[str, int]) -> list[str]:
    """``--metrics-port N`` for process ``name`` when the plan gave it one (the endpoint listens on
    the process's --host: its metrics_host follows its host)."""
    return ["--metrics-port", str(ports[name])] if name in ports else []


def _grpc_ports(cfg: Any) -> tuple[int, list[int]]:
    router_port = cfg.router_port or free_port(cfg.dial_host)
    if cfg.router_port and not port_free(cfg.host, router_port):
        raise ClusterError(f"--router-port: port {router_port} on {cfg.host} is taken (another `kvroute up`?); "
                           "pass another one, or 0 for a free one")
    if cfg.base_port:
        ports = [cfg.base_port + i for i in range(cfg.replicas)]
        taken = [p for p in ports if not port_free(cfg.host, p)]
        if taken:
            raise ClusterError(f"--base-port: port(s) {', '.join(map(str, taken))} on {cfg.host} are taken")
    else:
        ports = []
        while len(ports) < cfg.replicas:
            p = free_port(cfg.dial_host)
            if p != router_port and p not in ports:
                ports.append(p)
    return router_port, ports


__all__ = ["ClusterError", "PortPlan", "metrics_flags", "plan_ports"]
