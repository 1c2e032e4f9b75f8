"""``kvroute up``'s cluster: redis, N replicas and one or more routers as supervised child processes
on this machine (DESIGN.md §7), started in order and stopped in order.

    start ─▶ redis-server (embedded, unless --redis-url)
          ─▶ the model resolved once (kvroute_tools.resolve_model in a child python: N replicas
             don't race to write the default model, and `up` stays torch-free)
          ─▶ N x `python -m replica` + M x `python -m router` (``--routers M``: one Redis, so they
             share their in-flight load and speculative entries; with ``metrics``: each process with
             a Prometheus endpoint on a free port, ``metrics_urls``, printed in the banner)
          ─▶ ready: every grpc.health.v1 "readiness" SERVING, and every router sees all N replicas
             routable (RouterService.Score)
          ─▶ --gateway envoy: Envoy (kvroute_tools.envoy) in front, the router as its endpoint picker

Stopping (``LocalCluster.stop``, idempotent): SIGTERM to the routers' and the replicas' process
groups at once, wait, SIGKILL what is left; then the same for redis, last, so that the replicas'
publishers close against a live server. Every child runs in its own session (process group), so
a terminal's Ctrl-C reaches only ``up``, which stops them in order, and whatever a child spawned
goes with its group. ``stop`` also runs at exit (atexit) when ``up`` fails, and on Linux every child
gets SIGTERM if ``up`` itself dies without cleaning up (kvroute_tools.supervise). Each child's output
goes to ``{log_dir}/{name}.log``; the banner prints the paths and a failure prints the tail.

Imports no replica/router code and no torch: they run as ``python -m replica`` / ``python -m router``.
The wait after the start, the command after ``--`` and the exit codes of ``kvroute up`` are
kvroute_tools.up's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvroute.process import dial_host
from kvroute.redis_connect import RedisAuth, connect, describe_error, redact
from kvroute.redis_layout import DEFAULT_NAMESPACE, RedisLayout
from kvroute_tools.banner import EXAMPLE_PROMPT
from kvroute_tools.cluster_ports import ClusterError, metrics_flags, plan_ports, router_names
from kvroute_tools.envoy import EnvoyFront
from kvroute_tools.redis_server import find_redis_server, free_port
from kvroute_tools.supervise import POLL_S, SERVING, Child, health, stop_all
from kvroute_tools.vllm_replicas import (
    VLLM_BLOCK_SIZE,
    VllmPorts,
    bridge_argv,
    cpu_share,
    find_vllm_python,
    vllm_child,
    wait_healthy,
)


@dataclass(frozen=True)
class ClusterConfig:
    """What ``kvroute up`` starts (see ``kvroute up --help``)."""

    replicas: int = 2
    routers: int = 1  # router processes on one Redis; the first on router_port, the others on free ports
    host: str = "127.0.0.1"
    router_port: int = 50050  # 0 = a free port
    router_http_port: int = 0  # the router's OpenAI-compatible HTTP API: 0 = a free port, -1 = off
    metrics: bool = False  # a Prometheus /metrics endpoint on every replica and the router (free ports)
    base_port: int = 0  # replica i listens on base_port + i; 0 = free ports
    replica_http_base_port: int = 0  # replica i's OpenAI HTTP API (+ /metrics) on this + i; 0 = off
    redis_url: str = ""  # empty = an embedded redis-server on a free port
    redis_cluster: bool = False  # redis_url names a Redis Cluster seed (a comma-separated redis_url implies it)
    namespace: str = DEFAULT_NAMESPACE
    model: str = ""
    model_cache_dir: str = ""
    kv_cache_memory_mb: int | None = None
    num_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    torch_threads: int = 1
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_dir: str = ""  # empty = a new temporary folder, kept after exit
    ready_timeout: float = 300.0
    stop_timeout: float = 10.0
    keep_going: bool = False  # a replica's death leaves the others serving (the cluster stops when none is left)
    python: str = sys.executable
    gateway: str = "proxy"  # "envoy": Envoy in front, the router as its endpoint picker (kvroute_tools.envoy)
    gateway_port: int = 0  # Envoy's listener; 0 = a free port
    engine: str = "kvroute"  # "vllm": stock vLLM servers with kvroute bridge beside each (kvroute_tools.vllm_replicas)
    block_size: int | None = None  # replicas' and router's KV block size (None: 16 for kvroute, 32 for vLLM)
    vllm_python: str = ""  # --engine vllm: the interpreter with vllm (default: vllm_replicas.find_vllm_python)
    vllm_args: tuple[str, ...] = ()  # --engine vllm: more flags for every vLLM server

    def __post_init__(self) -> None:
        if self.engine not in ("kvroute", "vllm"):
            raise ValueError(f"--engine: must be kvroute or vllm, got {self.engine!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"--block-size: must be >= 1, got {self.block_size}")
        if self.gateway not in ("proxy", "envoy"):
            raise ValueError(f"--gateway: must be proxy or envoy, got {self.gateway!r}")
        if not 0 <= self.gateway_port < 65536:
            raise ValueError(f"--gateway-port: must be in 0..65535, got {self.gateway_port}")
        if self.replicas < 1:
            raise ValueError(f"--replicas: must be >= 1, got {self.replicas}")
        if self.routers < 1:
            raise ValueError(f"--routers: must be >= 1, got {self.routers}")
        if self.routers > 1 and self.gateway == "envoy":  # its ext_proc cluster names one picker
            raise ValueError("--routers: --gateway envoy puts Envoy in front of one router (its endpoint picker); "
                             "leave --routers at 1")
        if not 0 <= self.router_port < 65536:
            raise ValueError(f"--router-port: must be in 0..65535, got {self.router_port}")
        if not -1 <= self.router_http_port < 65536:
            raise ValueError(f"--router-http-port: must be -1 (off) or in 0..65535, got {self.router_http_port}")
        if self.base_port and not 0 < self.base_port <= 65536 - self.replicas:
            raise ValueError(f"--base-port: {self.replicas} ports from {self.base_port} do not fit in 1..65535")
        if self.replica_http_base_port and not 0 < self.replica_http_base_port <= 65536 - self.replicas:
            raise ValueError(f"--replica-http-base-port: {self.replicas} ports from {self.replica_http_base_port} "
                             "do not fit in 1..65535")
        if self.base_port and self.router_port and self.base_port <= self.router_port < self.base_port + self.replicas:
            raise ValueError(f"--router-port {self.router_port} is one of the replicas' ports "
                             f"({self.base_port}..{self.base_port + self.replicas - 1}); move --base-port")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ValueError(f"--kv-cache-memory-mb: must be >= 1, got {self.kv_cache_memory_mb}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"--num-blocks: must be >= 2, got {self.num_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.torch_threads < 0:
            raise ValueError(f"--torch-threads: must be >= 0, got {self.torch_threads}")
        if self.ready_timeout <= 0 or self.stop_timeout <= 0:
            raise ValueError("--ready-timeout / --stop-timeout: must be > 0")
        if self.redis_cluster and not self.redis_url:
            raise ValueError("--redis-cluster: needs --redis-url (the embedded redis-server is a single Redis)")
        RedisLayout(self.namespace)  # its own check, naming the namespace

    @property
    def dial_host(self) -> str:
        return dial_host(self.host)

    @property
    def kv_block_size(self) -> int | None:
        """The block size every replica and the router run with (None: each one's default)."""
        if self.block_size is not None:
            return self.block_size
        return VLLM_BLOCK_SIZE if self.engine == "vllm" else None



class LocalCluster:
    """Redis, N replicas and the routers as child processes (module docstring). ``start()`` returns
    when all are ready; ``stop()`` stops them (idempotent, also at exit)."""

    def __init__(self, config: ClusterConfig, *, log=print):
        self.config = config
        self.log = log
        self.log_dir = Path(config.log_dir) if config.log_dir else None
        self.redis: Child | None = None
        self.redis_url = config.redis_url
        self.replicas: list[Child] = []
        self.engines: list[Child] = []  # --engine vllm: the vLLM servers (the replicas are their bridges)
        self.vllm_ports: list[VllmPorts] = []  # --engine vllm: each server's HTTP, KV events and replay ports
        self.routers: list[Child] = []  # the first is ``router``: {target}, the banner's router line
        self.router_http_url = ""  # the first router's http://host:port/v1 once started (empty: HTTP off)
        self.router_http_urls: list[str] = []  # every router's
        self.admin_token_file: Path | None = None  # the router's admin token (SetPolicy), made at start
        self.admin_token = ""  # the token in it
        self.envoy: EnvoyFront | None = None  # --gateway envoy
        self.picker_target = ""  # --gateway envoy: the router's endpoint picker (its --picker-port)
        self.metrics_urls: dict[str, str] = {}  # process name -> http://host:port/metrics (with metrics)
        self.replica_http_urls: list[str] = []  # http://host:port per replica (--replica-http-base-port)
        self.model_dir = config.model
        self._stopped = False
        atexit.register(self.stop)

    @property
    def router(self) -> Child | None:
        """The first router (``{target}``; None before the start)."""
        return self.routers[0] if self.routers else None

    @property
    def router_target(self) -> str:
        return self.router.target if self.router is not None else ""

    @property
    def router_targets(self) -> list[str]:
        """Every router's ``host:port``, the first first."""
        return [c.target for c in self.routers]

    @property
    def front_target(self) -> str:
        """Where clients go: Envoy's listener with ``--gateway envoy``, else the router."""
        return self.envoy.target if self.envoy is not None else self.router_target

    @property
    def children(self) -> list[Child]:
        envoy = self.envoy.child if self.envoy is not None else None
        return [c for c in (self.redis, *self.engines, *self.replicas, *self.routers, envoy) if c is not None]

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        """Start everything and wait until it is ready.

        Raises:
            ClusterError: a port is taken, the model cannot be generated, a process exits while
                starting, or readiness is not reached within ``ready_timeout`` (everything started
                is stopped first).
        """
        cfg = self.config
        try:
            if self.log_dir is None:
                self.log_dir = Path(tempfile.mkdtemp(prefix="kvroute-up-"))
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.admin_token_file = self._write_admin_token()
            ports = plan_ports(cfg)
            replica_ports, replica_http_ports, metrics_ports = ports.replicas, ports.replica_http, ports.metrics
            self.router_http_urls = [f"http://{cfg.dial_host}:{p}/v1" for p in ports.router_http]
            self.router_http_url = self.router_http_urls[0] if self.router_http_urls else ""
            self.metrics_urls = {name: f"http://{cfg.dial_host}:{p}/metrics" for name, p in metrics_ports.items()}
            if self.redis_url:
                self._check_redis()
            else:
                self._start_redis()
            self._resolve_model()
            deadline = time.monotonic() + cfg.ready_timeout
            if cfg.engine == "vllm":
                self._start_vllm(deadline)
            for i, port in enumerate(replica_ports if cfg.engine == "kvroute" else ()):
                rid = f"replica-{i}"
                http = replica_http_ports[i] if replica_http_ports else -1
                argv = self._replica_argv(rid, port, http) + metrics_flags(rid, metrics_ports)
                self.replicas.append(Child(rid, argv, self.log_dir / f"{rid}.log",
                                           target=f"{cfg.dial_host}:{port}").start())
                if http >= 0:
                    self.replica_http_urls.append(f"http://{cfg.dial_host}:{http}")
            for i, name in enumerate(router_names(cfg.routers)):
                http_port = ports.router_http[i] if ports.router_http else -1
                argv = self._router_argv(ports.routers[i], http_port) + metrics_flags(name, metrics_ports)
                if cfg.gateway == "envoy":  # the router's endpoint picker port, Envoy's ext_proc cluster
                    picker_port = free_port(cfg.dial_host)
                    self.picker_target = f"{cfg.dial_host}:{picker_port}"
                    argv += ["--picker-port", str(picker_port)]
                self.routers.append(Child(name, argv, self.log_dir / f"{name}.log",
                                          target=f"{cfg.dial_host}:{ports.routers[i]}").start())
            self._wait_ready([*(self.replicas if cfg.engine == "kvroute" else ()), *self.routers], deadline)
            self._wait_routable(deadline)
            if cfg.gateway == "envoy":
                self.envoy = EnvoyFront(self.router_target, picker_target=self.picker_target, host=cfg.host,
                                        port=cfg.gateway_port, folder=self.log_dir)
                try:
                    self.envoy.start(max(deadline - time.monotonic(), 5.0))
                except (FileNotFoundError, RuntimeError) as e:
                    raise ClusterError(str(e)) from e
                self.log(f"  envoy ready ({self.envoy.target})", flush=True)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_admin_token(self) -> Path:
        """A fresh admin token for this cluster's router, in a file only this user can read."""
        assert self.log_dir is not None
        path = self.log_dir / "admin-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.admin_token = secrets.token_urlsafe(32)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_token + "\n")
        return path

    def _start_redis(self) -> None:
        port = free_port()
        argv = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                "no", "--dir", str(self.log_dir), "--protected-mode", "no", "--loglevel", "warning"]
        self.redis = Child("redis", argv, self.log_dir / "redis.log", target=f"127.0.0.1:{port}").start()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not self.redis.running():
                raise ClusterError(self._died(self.redis, "while starting"))
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise ClusterError(f"redis-server did not answer on port {port} within 15 s (log: {self.redis.log_path})")

    def _check_redis(self) -> None:
        import redis

        try:
            connect(self.redis_url, RedisAuth(cluster=self.config.redis_cluster), socket_timeout=3,
                    socket_connect_timeout=3).ping()
        except (redis.RedisError, ValueError) as e:
            problem = describe_error(self.redis_url, e).partition(": ")[2]
            raise ClusterError(f"--redis-url: cannot reach {redact(self.redis_url)} ({problem})") from e

    def _resolve_model(self) -> None:
        """Generate the default model once, before N replicas would race to write it."""
        cfg = self.config
        self.log("kvroute up: resolving the model (the default one is generated on first use) ...", flush=True)
        try:
            proc = subprocess.run(
                [cfg.python, "-m", "kvroute_tools.resolve_model", cfg.model, cfg.model_cache_dir],
                capture_output=True, text=True, timeout=600,
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError("resolving the model took more than 10 minutes") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise ClusterError(f"cannot resolve the model (--model {cfg.model!r}, --model-cache-dir "
                               f"{cfg.model_cache_dir!r}):\n{tail}")
        self.model_dir = proc.stdout.strip().splitlines()[-1]

    def _start_vllm(self, deadline: float) -> None:
        """N vLLM servers, healthy, then a bridge beside each (the replicas ``replica-i``)."""
        cfg = self.config
        assert self.log_dir is not None and self.model_dir
        python = find_vllm_python(cfg.vllm_python)
        block_size = cfg.kv_block_size
        assert block_size is not None
        plans = self.vllm_ports = [VllmPorts.free(cfg.dial_host) for _ in range(cfg.replicas)]
        for i, ports in enumerate(plans):
            self.engines.append(vllm_child(f"vllm-{i}", python, self.model_dir, cfg.host, ports, block_size,
                                           self.log_dir, extra_args=cfg.vllm_args,
                                           cpus=cpu_share(i, cfg.replicas)).start())
        wait_healthy(self.engines, deadline, self._died)
        for i, ports in enumerate(plans):
            argv = bridge_argv(cfg.python, f"replica-{i}", cfg.dial_host, ports, self.model_dir, block_size,
                               self.redis_url, cfg.namespace) + self._redis_cluster_flag()
            self.replicas.append(Child(f"replica-{i}", argv, self.log_dir / f"replica-{i}.log").start())
            self.log(f"  vllm-{i} ready (http://{cfg.dial_host}:{ports.http}), bridge replica-{i}", flush=True)

    def _model_flags(self) -> list[str]:
        # The generated default model is passed by path, so router and replicas read the same folder.
        return ["--model", self.model_dir] if self.model_dir else []

    def _replica_argv(self, replica_id: str, port: int, http_port: int = -1) -> list[str]:
        cfg = self.config
        argv = [cfg.python, "-m", "replica", "--host", cfg.host, "--port", str(port), "--replica-id", replica_id,
                "--redis-url", self.redis_url, *self._redis_cluster_flag(), "--namespace", cfg.namespace,
                "--torch-threads", str(cfg.torch_threads),
                # Ctrl-C aborts what is in flight at once (a pod's SIGTERM drains: the chart sets it).
                "--drain-timeout", "0", *self._model_flags(), *self._block_size_flags()]
        if cfg.kv_cache_memory_mb is not None:
            argv += ["--kv-cache-memory-mb", str(cfg.kv_cache_memory_mb)]
        if cfg.num_blocks is not None:
            argv += ["--num-blocks", str(cfg.num_blocks)]
        if cfg.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        if http_port >= 0:
            argv += ["--http-port", str(http_port)]
            if not cfg.metrics:  # the HTTP API's /metrics serves the Prometheus registry, which metrics_port enables
                argv += ["--metrics-port", "0"]
        return argv + list(cfg.replica_args)

    def _router_argv(self, port: int, http_port: int) -> list[str]:
        cfg = self.config
        return [cfg.python, "-m", "router", "--host", cfg.host, "--port", str(port), "--http-port", str(http_port),
                "--redis-url", self.redis_url, *self._redis_cluster_flag(), "--namespace", cfg.namespace,
                "--admin-token-file", str(self.admin_token_file),
                *self._model_flags(), *self._block_size_flags(), *cfg.router_args]

    def _redis_cluster_flag(self) -> list[str]:
        return ["--redis-cluster"] if self.config.redis_cluster else []

    def _block_size_flags(self) -> list[str]:
        size = self.config.kv_block_size
        return ["--block-size", str(size)] if size is not None else []

    def _died(self, child: Child, when: str) -> str:
        tail = child.log_tail()
        return (f"{child.name} exited with status {child.returncode()} {when}; last lines of {child.log_path}:\n"
                + (tail or "(empty)"))

    def _wait_ready(self, children: Sequence[Child], deadline: float) -> None:
        """Until every child's grpc.health.v1 ``readiness`` is SERVING."""
        channels = {c.name: grpc.insecure_channel(c.target) for c in children}
        try:
            pending = {c.name: c for c in children}
            while pending:
                for name, c in list(pending.items()):
                    if not c.running():
                        raise ClusterError(self._died(c, "while starting"))
                    if health(health_pb2_grpc.HealthStub(channels[name])) == SERVING:
                        del pending[name]
                        self.log(f"  {name} ready ({c.target})", flush=True)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(pending)
                    raise ClusterError(f"not ready within {self.config.ready_timeout:.0f} s: {names} "
                                       f"(logs in {self.log_dir}); raise --ready-timeout on a slow machine")
                if pending:
                    time.sleep(POLL_S)
        finally:
            for ch in channels.values():
                ch.close()

    def _wait_routable(self, deadline: float) -> None:
        """Until every router counts every replica routable (heartbeat seen, hash triple checked)."""
        for router in self.routers:
            self._wait_router_routable(router, deadline)

    def _wait_router_routable(self, router: Child, deadline: float) -> None:
        from kvroute.v1 import generation_pb2 as gen_pb
        from kvroute.v1 import router_pb2 as router_pb
        from kvroute.v1 import router_pb2_grpc as router_grpc

        want = {c.name for c in self.replicas}
        last = ""
        with grpc.insecure_channel(router.target) as ch:
            stub = router_grpc.RouterServiceStub(ch)
            while True:
                for c in self.children:
                    if not c.running():
                        raise ClusterError(self._died(c, "while starting"))
                try:
                    resp = stub.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=[0])), timeout=2.0)
                    routable = {r.replica_id for r in resp.replicas if r.routable}
                    last = "; ".join(f"{r.replica_id}: {r.reason or 'routable'}" for r in resp.replicas) or "none known"
                    if want <= routable:
                        return
                except grpc.RpcError as e:
                    last = f"{e.code().name}: {e.details()}"
                if time.monotonic() > deadline:
                    raise ClusterError(f"{router.name} does not see every replica routable within "
                                       f"{self.config.ready_timeout:.0f} s ({last}); logs in {self.log_dir}")
                time.sleep(POLL_S)

    # -- run -------------------------------------------------------------------------------------
    def first_death(self, *, ignore: Collection[str] = ()) -> Child | None:
        """A child that has exited, other than those named in ``ignore`` (None while all run)."""
        return next((c for c in self.children if c.name not in ignore and not c.running()), None)

    def is_replica(self, child: Child) -> bool:
        """``child`` is part of a replica (a kvroute replica, a vLLM server or its bridge), not a
        process the whole cluster needs (Redis, a router, Envoy)."""
        return child in self.replicas or child in self.engines

    def serving_replicas(self) -> int:
        """Replicas whose processes all run (a vLLM replica: its server and its bridge)."""
        engines = self.engines or [None] * len(self.replicas)
        return sum(1 for r, e in zip(self.replicas, engines, strict=True) if r.running() and (e is None or e.running()))

    def describe_death(self, child: Child) -> str:
        return self._died(child, "unexpectedly")

    # -- stop ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Routers and replicas first (SIGTERM, wait, SIGKILL), then redis. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(ValueError):
            atexit.unregister(self.stop)
        if self.envoy is not None:  # the front first: no new call reaches a stopping router
            self.envoy.stop()
        stop_all([*self.routers, *self.replicas, *self.engines], self.config.stop_timeout)
        if self.redis is not None:
            stop_all([self.redis], 5.0)

__all__ = ["EXAMPLE_PROMPT", "ClusterConfig", "ClusterError", "LocalCluster"]
