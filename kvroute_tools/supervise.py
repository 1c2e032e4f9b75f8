"""Supervised child processes for the local tools: each in its own session (process group), its
output appended to a log file, stopped by group (SIGTERM, wait, SIGKILL), and on Linux sent SIGTERM
when the process that started it dies (``PR_SET_PDEATHSIG``); and the grpc.health.v1 readiness
poll that says a child is serving.

    Child(name, argv, log_path).start() ──▶ running() / returncode() / log_tail() ──▶ stop_all([...])
    wait_serving(target, proc, ...)       ──▶ returns at readiness SERVING, raises when the child
                                              exits first or the timeout passes

Used by ``kvroute up`` (kvroute_tools.cluster) and the benchmarks in bench/. Imports grpc's health
stubs and nothing of kvroute, router or replica.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
POLL_S = 0.2  # seconds between two readiness polls


def pdeathsig_preexec():
    """Linux: a ``preexec_fn`` that makes the child get SIGTERM when the process that started it dies
    (even by SIGKILL): ``prctl(PR_SET_PDEATHSIG, SIGTERM)``. The libc symbol is looked up here, in
    the parent, so that the child, between fork and exec, only makes the call. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # pragma: no cover - runs in the child
        prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return preexec


class Child:
    """One supervised process in its own session; output appended to ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, target: str = "",
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})  # set over this process's environment
        self.log_path = log_path
        self.target = target  # host:port it serves gRPC on ("" for redis)
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=pdeathsig_preexec(),
                env={**os.environ, **self.env} if self.env else None,
            )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (its session: the child and anything it spawned)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def stop_all(children: Sequence[Child], timeout: float) -> None:
    """SIGTERM every group, wait up to ``timeout`` seconds, SIGKILL the rest (and their groups)."""
    for c in children:
        if c.running():
            c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        if c.proc is None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(max(deadline - time.monotonic(), 0.01))
    for c in children:
        if c.proc is None:
            continue
        c.signal_group(signal.SIGKILL)  # stragglers, and anything the child left in its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(5)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def health(stub: health_pb2_grpc.HealthStub, service: str = "readiness") -> int | None:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0).status
    except grpc.RpcError:
        return None


def wait_serving(target: str, proc: subprocess.Popen, what: str, timeout: float = 120.0,
                 details: Callable[[], str] = lambda: "") -> None:
    """Poll ``target``'s grpc.health.v1 ``readiness`` until SERVING (one child process; ``LocalCluster``
    waits for several at once).

    Raises:
        RuntimeError: ``proc`` exited first, or ``timeout`` seconds passed (then ``proc`` is killed);
            the message ends with ``details()`` (e.g. the child's log).
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while health(stub) != SERVING:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode}:\n{details()}")
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{what} not ready within {timeout:.0f} s:\n{details()}")
            time.sleep(POLL_S)



__all__ = ["POLL_S", "SERVING", "Child", "health", "pdeathsig_preexec", "port_free", "stop_all", "wait_serving"]
