"""The router process: consumer + index + registry + discovery + load sync + gRPC proxy, the
Gateway API Inference Extension endpoint picker (Envoy ext_proc, router.picker; ``picker_port``), health,
reflection and telemetry (DESIGN.md §5, §6), and the OpenAI-compatible HTTP API (``http_port``;
router.http_api).

    start():  tokenizer (the replicas' model folder) ─▶ gRPC up (liveness SERVING, readiness
              NOT_SERVING), HTTP up (/health 503 until ready) ─▶ consumer, discovery, load sync threads ─▶ readiness / "" / service
              names SERVING once the consumer has bootstrapped (every stream read to its end)
    stop():   every status NOT_SERVING ─▶ HTTP stop(grace), grpc stop(grace) (in-flight calls are cancelled after it,
              which cancels their upstream calls) ─▶ replica channels closed ─▶ threads stopped

``serve(settings)`` runs that until SIGTERM or SIGINT; ``python -m router`` and ``kvroute router``
call :func:`main`. Tests and benchmarks use :class:`RouterServer` (``port=0`` binds a free port,
read back from ``.port``; ``http_port=0`` likewise, ``.http_port``) or :class:`BackgroundRouter` (the same on its own event-loop thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvroute.grpc_errors import add_servicer
from kvroute.hashing import BlockHasher
from kvroute.model_folder import ModelLoadError
from kvroute.openai_http import HttpServer
from kvroute.process import BackgroundServer, ServerMain, StopOnce, dial_target
from kvroute.prompt import PromptTokenizer, resolve_model_dir
from kvroute.redis_connect import RedisAuth, redact
from kvroute.redis_layout import RedisLayout
from kvroute.settings import secret_from
from kvroute.telemetry import Telemetry
from kvroute.tls import bind, channel_credentials, server_credentials
from kvroute.v1 import generation_pb2, router_pb2
from router import index as index_module
from router.channels import ReplicaChannels
from router.consumer import EventConsumer
from router.core import Router
from router.discovery import Discovery, KubernetesDiscovery, RedisDiscovery, StaticDiscovery
from router.http_api import router_http_app
from router.index import BlockIndex
from router.load import LoadTracker
from router.load_sync import RedisLoadSync
from router.picker.server import PickerServer
from router.picker.servicer import EndpointPicker
from router.policies.base import Policy
from router.policies.registry import make_policy
from router.proxy import Proxy
from router.registry import ReplicaRegistry
from router.routing import RoutingService
from router.servicers import GenerationServicer, RouterServicer, service_names
from router.settings import RouterSettings
from router.telemetry import RouterMetrics

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_READY_POLL_S = 0.25


def make_discovery(settings: RouterSettings, registry: ReplicaRegistry) -> Discovery:
    """The discovery ``settings.discovery`` names, attached to ``registry`` (not started).

    Raises:
        ValueError: a static address that is not host:port, or static discovery without replicas.
    """
    mode = settings.discovery
    if mode == "static":
        addresses = [a for a in settings.replicas.split(",") if a.strip()]
        if not addresses:
            raise ValueError("replicas: static discovery needs a comma-separated host:port list")
        discovery: Discovery = StaticDiscovery(addresses)
    elif mode == "kubernetes":
        discovery = KubernetesDiscovery(settings.k8s_namespace, settings.k8s_service, port_name=settings.k8s_port_name)
    else:
        discovery = RedisDiscovery(registry)
    discovery.attach(registry)
    return discovery


class RouterServer:
    """One router's gRPC server and the machinery behind it (see the module docstring).

    After ``await start()``: ``port`` (bound), ``http_port`` / ``picker_port`` (bound; None when off), ``router_id``, ``router`` (core.Router), ``routing`` (router.routing), ``proxy``,
    ``index``, ``registry``, ``consumer``, ``load``, ``discovery``, ``tokenizer``.
    """

    def __init__(self, settings: RouterSettings, *, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.port: int | None = None
        self.router_id = settings.router_id
        self.tokenizer: PromptTokenizer | None = None
        self.index: BlockIndex | None = None
        self.registry: ReplicaRegistry | None = None
        self.consumer: EventConsumer | None = None
        self.discovery: Discovery | None = None
        self.load: LoadTracker | None = None
        self.load_sync: RedisLoadSync | None = None
        self.router: Router | None = None
        self.routing: RoutingService | None = None
        self.proxy: Proxy | None = None
        self.metrics: RouterMetrics | None = None
        self.http_port: int | None = None
        self.picker_port: int | None = None
        self._picker: PickerServer | None = None
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._health = health.aio.HealthServicer()
        self._ready_task: asyncio.Task | None = None
        self._threads: list[Any] = []  # started parts with a stop(): consumer, discovery, load sync
        self._ready = asyncio.Event()
        self._stop = StopOnce()

    @property
    def target(self) -> str:
        """``host:port`` to dial on this machine."""
        return dial_target(self.settings.host, self.port)

    @property
    def picker_target(self) -> str:
        """The endpoint picker's ``host:port`` on this machine ("" when ``picker_port`` is off)."""
        return dial_target(self.settings.host, self.picker_port) if self.picker_port else ""

    def policy(self, name: str) -> Policy:
        """A fresh policy of that name with this router's weights and seed."""
        s = self.settings
        return make_policy(name, s.weights(), None if s.seed < 0 else s.seed)

    async def _set_all(self, status: int) -> None:
        for name in ("", READINESS, *service_names()):
            await self._health.set(name, status)

    async def start(self) -> None:
        """Load the tokenizer, bind and serve, start the background threads; readiness follows
        the consumer's bootstrap (``wait_ready``).

        Raises:
            ModelLoadError: no tokenizer (the message says to pass --model).
            ValueError: an inconsistent setting (the message names it).
            RuntimeError: the port cannot be bound.
        """
        s = self.settings
        self.tokenizer = await asyncio.to_thread(PromptTokenizer.from_folder, resolve_model_dir(s.model, s.model_cache_dir))
        hasher = BlockHasher(s.hash_algorithm, s.hash_seed, s.block_size)
        layout = RedisLayout(s.namespace, s.event_shards)
        redis_auth = RedisAuth.from_settings(s)
        index_lock = threading.Lock()
        self.index = BlockIndex(speculative_ttl=s.speculative_ttl)
        self.registry = ReplicaRegistry(hasher.identity, s.discovery, model=self.tokenizer.model_name)
        self.discovery = make_discovery(s, self.registry)
        self.load = LoadTracker()
        self.router = Router(hasher, self.index, self.registry, self.load, self.policy(s.policy), index_lock)
        self.consumer = EventConsumer(
            s.redis_url, layout, self.index, self.registry,
            heartbeat_poll_interval=s.heartbeat_poll_interval, index_lock=index_lock, auth=redis_auth,
        )

        server_tls = server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
        replica_tls = channel_credentials(s.replica_tls_ca_file, s.replica_tls_cert_file, s.replica_tls_key_file,
                                          prefix="replica_tls_")
        admin_token = secret_from(s, "admin_token")
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._server = server
        self.port = bind(server, f"{s.host}:{s.port}", server_tls)
        if not self.port:
            raise RuntimeError(f"port: cannot bind {s.host}:{s.port}")
        # The bound port, not the flag: two routers started with --port 0 must not share an id
        # (their load keys in Redis would overwrite each other).
        self.router_id = s.router_id or f"{socket.gethostname()}-{self.port}"
        self.load_sync = RedisLoadSync(s.redis_url, layout, self.router_id, self.router,
                                       interval=s.load_sync_interval, auth=redis_auth)
        tracer = None
        if self.telemetry is not None:
            self.metrics = RouterMetrics(
                self.telemetry.meter("kvroute.router"), model=self.tokenizer.model_name,
                consumer=self.consumer, registry=self.registry,
            )
            if self.telemetry.tracing:  # spans nobody exports are not made
                tracer = self.telemetry.tracer("kvroute.router")
        self.routing = RoutingService(self.router, self.tokenizer, policy_factory=self.policy, metrics=self.metrics)
        self.proxy = Proxy(self.routing, max_retries=s.max_retries, tracer=tracer,
                           channels=ReplicaChannels(credentials=replica_tls,
                                                            server_name=s.replica_tls_server_name))
        if s.http_port >= 0:  # bound now: a taken port fails before anything starts
            app = router_http_app(self.routing, self.proxy, self._ready.is_set, self.telemetry).app
            self._http = HttpServer(app, s.host, s.http_port, name=f"router {self.router_id}", tls=s.http_tls_files())
            self.http_port = self._http.port
        add_servicer(server, generation_pb2.DESCRIPTOR.services_by_name["GenerationService"], GenerationServicer(self.proxy))
        add_servicer(server, router_pb2.DESCRIPTOR.services_by_name["RouterService"], RouterServicer(self.routing, admin_token))
        if s.picker_port >= 0:  # its own port and server (router.picker.server); bound now, like HTTP
            picker = EndpointPicker(self.routing, fallbacks=s.picker_fallbacks, tracer=tracer)
            self._picker = PickerServer(picker, s.host, s.picker_port, server_tls, s.picker_streams)
            if self.metrics is not None:
                self.metrics.observe_picker(picker)
            self.picker_port = self._picker.start()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((*service_names(), health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_all(_NOT_SERVING)
        await self._health.set(LIVENESS, _SERVING)
        await server.start()
        if self._http is not None:
            await self._http.start()
        for part in (self.consumer, self.discovery, self.load_sync):
            part.start()
            self._threads.append(part)
        self._ready_task = asyncio.create_task(self._become_ready())
        log.info(
            "router %s: gRPC on %s:%d, policy %s, %s discovery, Redis %s namespace %s, tokenizer of %s,"
            " hashing %s [%s], index loops %s, %s, replicas dialed %s, SetPolicy %s",
            self.router_id, s.host, self.port, s.policy, s.discovery, redact(s.redis_url), s.namespace,
            self.tokenizer.model_name, s.hash_algorithm, self.router.hasher.implementation,
            "compiled" if index_module._index is not None else "Python (router._index not built)",
            ("mTLS" if s.tls_client_ca_file else "TLS") if server_tls else "plaintext",
            ("over TLS" + (f" (certificates checked against {s.replica_tls_server_name})"
                           if s.replica_tls_server_name else "")) if replica_tls else "in plaintext",
            "with the admin token" if admin_token else "off",
        )
        if self._picker is not None:
            log.info("router %s: endpoint picker (ext_proc) on %s:%d, %d streams at most", self.router_id, s.host,
                     self.picker_port, self._picker.max_streams)

    async def _become_ready(self) -> None:
        assert self.consumer is not None
        while not self._stop.stopping and not await asyncio.to_thread(self.consumer.wait_ready, _READY_POLL_S):
            pass
        if self._stop.stopping:
            return
        await self._set_all(_SERVING)
        self._ready.set()
        assert self.registry is not None
        log.info("router %s ready: %d replica(s) routable", self.router_id, len(self.registry.routable()))

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until readiness is SERVING; False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self, grace: float = 1.0) -> None:
        """NOT_SERVING everywhere, stop gRPC within ``grace`` seconds (calls still running then are
        cancelled, and with them their upstream calls), close the replica channels, stop the
        threads. Idempotent."""
        if not await self._stop.begin():
            return
        try:
            await self._health.enter_graceful_shutdown()
            if self._http is not None:
                await self._http.stop(grace)
            if self._picker is not None:  # Envoy's calls in flight end with their streams
                await asyncio.to_thread(self._picker.stop, grace)
            if self._server is not None:
                await self._server.stop(grace)
            if self._ready_task is not None:
                with contextlib.suppress(Exception):
                    await self._ready_task
            if self.proxy is not None:
                await self.proxy.close()
            for part in reversed(self._threads):
                await asyncio.to_thread(part.stop)
        finally:
            self._stop.end()
            if self.port is not None:
                log.info("router %s stopped", self.router_id)

    async def wait_for_termination(self) -> None:
        await self._stop.wait()


class BackgroundRouter(BackgroundServer):
    """A :class:`RouterServer` on its own event-loop thread, for synchronous callers (tests,
    benchmarks): ``with BackgroundRouter(settings) as r: dial(r.target)``. Waits for readiness
    (``ready_timeout`` seconds; None = don't wait).

    Raises (constructor): whatever ``RouterServer.start`` raises, after cleaning up;
    TimeoutError when the router is not ready in time.
    """

    def __init__(self, settings: RouterSettings, *, telemetry: Telemetry | None = None,
                 ready_timeout: float | None = 30.0):
        def start(server: RouterServer) -> None:
            self.run(server.start(), 60.0)
            if ready_timeout is not None and not self.run(server.wait_ready(ready_timeout), ready_timeout + 5):
                raise TimeoutError(f"router not ready within {ready_timeout}s (is Redis at {redact(settings.redis_url)} up?)")

        self._start(lambda: RouterServer(settings, telemetry=telemetry), "router-server", start)

    @property
    def picker_target(self) -> str:
        return self.server.picker_target


def _check_settings(settings: RouterSettings) -> None:
    """What the settings' parts check themselves, before anything starts (TLS and secret files
    read once here, so a half-set pair or a missing file is exit 2 naming it). Raises ValueError."""
    s = settings
    s.weights()
    server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
    channel_credentials(s.replica_tls_ca_file, s.replica_tls_cert_file, s.replica_tls_key_file, prefix="replica_tls_")
    s.http_tls_files(), s.metrics_tls_files()
    if s.replica_tls_server_name and not s.replica_tls_ca_file:
        raise ValueError("replica_tls_server_name: needs replica_tls_ca_file")
    secret_from(s, "admin_token")
    RedisAuth.from_settings(s)


_MAIN = ServerMain(
    RouterSettings, lambda settings, telemetry: RouterServer(settings, telemetry=telemetry), "kvroute-router",
    "python -m router", "A kvroute router: KV events in, prefix-aware routing decisions out, generation proxied.",
    "router", check=_check_settings, plain_errors=(ModelLoadError,),
)
serve = _MAIN.serve  # serve(settings, *, telemetry=None): a router until SIGTERM / SIGINT, then stopped gracefully
main = _MAIN.main  # main(argv=None, prog=None) -> exit status: ``python -m router`` / ``kvroute router``


__all__ = ["LIVENESS", "READINESS", "BackgroundRouter", "RouterServer", "main", "make_discovery", "serve"]
