"""The replica process: model + engine + gRPC services + health + reflection + KV event publisher,
and the OpenAI-compatible HTTP API (``http_port``; replica.http_api).

    start():  gRPC up (liveness SERVING, readiness NOT_SERVING), HTTP up (/health 503 until ready)
              ─▶ engine_process (default): ProcessLLMEngine.start() spawns the engine process, which
                   loads the model, warms up, starts the publisher and its step hook (ProcessStepHook);
                   this process holds a RemotePublisher (its counters as the step reports show them)
                 else: load model, warm up (a thread) ─▶ publisher.start()
                   ─▶ AsyncLLMEngine(step_hook=frontend.on_step).start()
              ─▶ readiness / "" / service names SERVING
    stop():   heartbeat says draining (at once) ─▶ every status NOT_SERVING ─▶ refuse new calls ─▶ in-flight calls get ``drain`` seconds to
              finish (SIGTERM: ``drain_timeout``), the rest are aborted ─▶ HTTP and grpc stop(grace)
              ─▶ engine process (or thread) stopped ─▶ publisher closed    (drain + a few seconds at most)

The publisher is always an ``EventPublisher`` (``make_publisher``: Redis, or the null one without
``redis_url``). The engine process exists because a step of a small model is mostly Python: on a
thread of this process it competes with gRPC for the GIL (replica/engine/core_client.py).

``serve(settings)`` runs that until SIGTERM or SIGINT; ``python -m replica`` and ``kvroute replica``
call :func:`main`. Tests and benchmarks use :class:`ReplicaServer` directly (``port=0`` binds a free
port, read back from ``.port``; ``http_port=0`` likewise, read back from ``.http_port``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvroute.engine_info import EngineInfo
from kvroute.grpc_errors import add_servicer
from kvroute.hashing import BlockHasher
from kvroute.openai_http import HttpServer
from kvroute.process import WILDCARD_HOSTS, BackgroundServer, ServerMain, StopOnce, dial_target
from kvroute.prompt import DEFAULT_MODEL_DIRNAME, default_model_dir
from kvroute.redis_connect import RedisAuth
from kvroute.redis_layout import RedisLayout
from kvroute.telemetry import Telemetry
from kvroute.tls import bind, server_credentials
from kvroute.v1 import generation_pb2, replica_pb2
from replica.attention import torch_backend
from replica.engine.async_engine import AsyncLLMEngine
from replica.engine.core_client import ProcessLLMEngine
from replica.engine.remote_publisher import RemotePublisher
from replica.engine.step_hook import ProcessStepHook, StepReport
from replica.frontend import EngineClient, ReplicaFrontend
from replica.http_api import replica_http_app
from replica.publisher import (
    EventPublisher,
    NullEventPublisher,
    ReplicaIdInUseError,
    make_publisher,
)
from replica.servicers import GenerationServicer, ReplicaServicer
from replica.settings import ReplicaSettings
from replica.telemetry import ReplicaMetrics
from replica.vllm_metrics import VllmMetricsCollector
from replica.wire import service_names

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"
WARMUP_PROMPT = "The harbour town woke before the sun."
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def resolve_model_dir(settings: ReplicaSettings) -> tuple[Path, str]:
    """The model folder and its name: ``settings.model``, or the generated default model in
    ``settings.model_cache_dir`` (:func:`kvroute.prompt.default_model_dir`), generated on first use."""
    if settings.model:
        path = Path(settings.model).expanduser()
        return path, path.name
    from replica.model.default_model import ensure_default_model

    return Path(ensure_default_model(default_model_dir(settings.model_cache_dir))), DEFAULT_MODEL_DIRNAME


def build_engine(settings: ReplicaSettings) -> tuple[Any, str]:
    """Load the model, build the ``LLMEngine`` and warm it up (blocking; seconds).

    The warm-up request goes through the whole step path once (first-call allocations, kernel
    selection). Its traces are then erased -- prefix cache emptied, its KV events dropped, the
    prefix cache counters zeroed -- so that metrics and the published cache state start at the
    first real request.

    Raises:
        ModelLoadError: the model folder cannot be loaded.
        ValueError: a setting is inconsistent (the message names it).
    """
    from replica.engine.engine import LLMEngine
    from replica.engine.params import SamplingParams
    from replica.kv import PrefixCacheStats

    model_dir, name = resolve_model_dir(settings)
    engine = LLMEngine(model_dir, settings.engine_config())
    engine.generate([WARMUP_PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    engine.kv.reset_prefix_cache(must_succeed=True)
    engine.take_kv_events()
    engine.kv.stats = PrefixCacheStats()
    return engine, name


def build_process_engine(settings: ReplicaSettings) -> Any:
    """:func:`build_engine` without the name: the ``engine_factory`` of the engine process."""
    return build_engine(settings)[0]


def make_process_step_hook(
    settings: ReplicaSettings, address: str, replica_id: str, model_name: str, engine: Any
) -> ProcessStepHook:
    """The engine process's ``step_hook_factory``: starts the KV event publisher there (the null
    one without ``redis_url``), so that events, snapshots and heartbeats leave from next to the engine."""
    pub = _make_publisher(settings, engine, address, replica_id, model_name)
    pub.start()
    return ProcessStepHook(pub)


def _make_publisher(
    settings: ReplicaSettings, engine: Any, address: str, replica_id: str, model_name: str
) -> EventPublisher:
    s = settings
    return make_publisher(
        s.redis_url, RedisLayout(s.namespace, s.event_shards), replica_id, engine.info(model_name), address,
        heartbeat_interval=s.heartbeat_interval, heartbeat_ttl=s.heartbeat_ttl or None, snapshot_interval=s.snapshot_interval,
        buffer_size=s.event_buffer, stream_maxlen=s.stream_maxlen, max_waiting=s.max_waiting,
        auth=RedisAuth.from_settings(s),
    )


class ReplicaServer:
    """One replica's gRPC server over one engine (see the module docstring for the sequence).

    After ``await start()``: ``port`` (bound), ``http_port`` (bound; None when off), ``address`` (advertised), ``replica_id``,
    ``engine`` (a ``ProcessLLMEngine`` with ``engine_process``, else an ``AsyncLLMEngine`` whose
    ``.engine`` is the ``LLMEngine``), ``frontend``, ``publisher`` (an ``EventPublisher``: a
    :class:`RemotePublisher` with ``engine_process``, else the one ``make_publisher`` made).
    """

    def __init__(self, settings: ReplicaSettings, *, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.port: int | None = None
        self.address = ""
        self.replica_id = settings.replica_id
        self.engine: EngineClient | None = None
        self.publisher: EventPublisher = NullEventPublisher()
        self.frontend: ReplicaFrontend | None = None
        self.model_name = ""
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._http: HttpServer | None = None
        self._vllm_metrics: VllmMetricsCollector | None = None  # registered while this replica runs
        self._health = health.aio.HealthServicer()
        self._watchdog: asyncio.Task | None = None
        self._alive: asyncio.Task | None = None  # _say_alive
        self._stop = StopOnce()

    @property
    def target(self) -> str:
        """``host:port`` to dial on this machine."""
        return dial_target(self.settings.host, self.port)

    async def _set_all(self, status: int) -> None:
        for name in ("", READINESS, *service_names()):
            await self._health.set(name, status)

    async def start(self) -> None:
        """Bind and serve, then load the model and become ready.

        Raises:
            RuntimeError: the port cannot be bound, or ``redis_url`` is set without a publisher.
            ReplicaIdInUseError: a live replica at another address heartbeats under this replica id.
            ModelLoadError / ValueError: from :func:`build_engine` (the server is stopped first).
        """
        s = self.settings
        # so_reuseport off: a second replica on a taken port must fail, not share the port.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._server = server
        self.port = bind(server, f"{s.host}:{s.port}", server_credentials(s.tls_cert_file, s.tls_key_file,
                                                                          s.tls_client_ca_file))
        if not self.port:
            raise RuntimeError(f"port: cannot bind {s.host}:{s.port}")
        wildcard = s.host in WILDCARD_HOSTS
        self.address = s.advertise_address or f"{socket.gethostname() if wildcard else s.host}:{self.port}"
        self.replica_id = s.replica_id or f"{socket.gethostname()}-{self.port}"
        if s.redis_url:  # before anything is served or loaded: a live replica elsewhere owns this id?
            from replica.publisher.id_check import claim_replica_id

            layout = RedisLayout(s.namespace, s.event_shards)
            await asyncio.to_thread(claim_replica_id, s.redis_url, layout, self.replica_id, self.address,
                                    RedisAuth.from_settings(s))
        tracer = None
        if self.telemetry is not None and self.telemetry.tracing:  # spans nobody exports are not made
            tracer = self.telemetry.tracer("kvroute.replica")
        self.frontend = frontend = ReplicaFrontend(
            replica_id=self.replica_id, max_waiting=s.max_waiting, publishing=bool(s.redis_url), tracer=tracer
        )
        if s.http_port >= 0:  # bound now: a taken port fails before anything starts
            app = replica_http_app(frontend, self.telemetry).app
            self._http = HttpServer(app, s.host, s.http_port, name=f"replica {self.replica_id}",
                                    tls=s.http_tls_files())
            self.http_port = self._http.port
        add_servicer(server, generation_pb2.DESCRIPTOR.services_by_name["GenerationService"], GenerationServicer(frontend))
        add_servicer(server, replica_pb2.DESCRIPTOR.services_by_name["ReplicaService"], ReplicaServicer(frontend))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*service_names(), health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        await self._set_all(_NOT_SERVING)
        await self._health.set(LIVENESS, _SERVING)
        await server.start()
        log.info("replica %s: gRPC on %s:%d, loading the model", self.replica_id, s.host, self.port)
        if self._http is not None:
            await self._http.start()
        try:
            if s.engine_process:
                info = await self._start_engine_process(frontend)
            else:
                info = await self._start_engine_thread(frontend)
        except BaseException:
            await self.stop(grace=0)
            raise
        self._watchdog = asyncio.create_task(self._watch_engine())
        self._alive = asyncio.create_task(self._say_alive())
        await self._set_all(_SERVING)
        log.info(
            "replica %s ready: model %s, %d KV blocks of %d tokens, max_model_len %d, address %s, engine %s,"
            " hashing %s [%s], attention backend %s (%s), CPU decode attention %s",
            self.replica_id, self.model_name, info.num_blocks, info.block_size, info.max_model_len,
            self.address, f"process {self.engine.pid}" if s.engine_process else "thread",
            s.hash_algorithm, BlockHasher(s.hash_algorithm).implementation, info.attn_backend,
            info.attn_backend_reason,
            "compiled kernel" if torch_backend._cpu_paged is not None else "gather + SDPA (_cpu_paged not built)",
        )

    def _make_metrics(self, frontend: ReplicaFrontend) -> None:
        if self.telemetry is not None and self.telemetry.registry is not None:
            self._vllm_metrics = VllmMetricsCollector(frontend, self.model_name)
            self.telemetry.registry.register(self._vllm_metrics)
        if self.telemetry is not None:
            # A replica that does not publish exports no event counters (rather than zeros).
            stats = (lambda: self.publisher.stats()) if self.settings.redis_url else (lambda: None)
            frontend.metrics = ReplicaMetrics(
                self.telemetry.meter("kvroute.replica"), model=self.model_name, replica_id=self.replica_id,
                sample=frontend.latest_sample,
                publisher=stats,
            )

    async def _start_engine_process(self, frontend: ReplicaFrontend) -> EngineInfo:
        s = self.settings
        model_dir, self.model_name = await asyncio.to_thread(resolve_model_dir, s)  # generates the default model
        self._make_metrics(frontend)

        def on_step_report(report: StepReport) -> None:  # the engine client's reader thread, once started
            remote.update(report.publisher)
            frontend.on_step_report(report)

        engine = ProcessLLMEngine(
            functools.partial(build_process_engine, s), model_dir, model=self.model_name,
            step_hook_factory=functools.partial(make_process_step_hook, s, self.address, self.replica_id, self.model_name),
            on_step_report=on_step_report,
        )
        self.publisher = remote = RemotePublisher(engine)
        self.engine = engine  # before it starts: stop() during the start ends the engine process
        await asyncio.to_thread(engine.start)
        assert engine.info is not None and engine.tokenizer is not None
        frontend.attach(engine, engine.info, engine.tokenizer, remote)
        return engine.info

    async def _start_engine_thread(self, frontend: ReplicaFrontend) -> EngineInfo:
        engine, self.model_name = await asyncio.to_thread(build_engine, self.settings)
        self._make_metrics(frontend)
        self.publisher = _make_publisher(self.settings, engine, self.address, self.replica_id, self.model_name)
        self.publisher.start()
        self.engine = AsyncLLMEngine(engine, step_hook=frontend.on_step)
        info = engine.info(self.model_name)
        frontend.attach(self.engine, info, engine.tokenizer, self.publisher)
        self.engine.start()
        return info

    async def _watch_engine(self) -> None:
        """Liveness and readiness go NOT_SERVING when the step loop (or the engine process) dies:
        the orchestrator restarts us."""
        while self.engine is not None and self.engine.dead is None:
            await asyncio.sleep(0.5)
        if self.engine is not None and not self._stop.stopping:
            log.error("engine step loop died (%r); reporting NOT_SERVING", self.engine.dead)
            await self._set_all(_NOT_SERVING)
            await self._health.set(LIVENESS, _NOT_SERVING)

    async def _say_alive(self) -> None:
        """Tell the publisher, every half heartbeat interval, that this event loop (which serves
        every gRPC and HTTP call) runs: a heartbeat then proves the serving path, not only the
        engine process (a frozen or hung server stops heartbeating within its TTL)."""
        period = self.settings.heartbeat_interval / 2
        while True:
            self.publisher.serving_alive()
            await asyncio.sleep(period)

    async def stop(self, grace: float = 1.0, *, drain: float = 0.0) -> None:
        """Stop: a heartbeat saying ``draining`` at once (routers stop picking this replica), NOT_SERVING
        everywhere (readiness first, so the endpoint leaves the Service), refuse
        new calls, give the calls in flight ``drain`` seconds to finish, abort the rest, stop gRPC
        within ``grace`` seconds, stop the engine process (or thread), close the publisher. Idempotent.

        The aborted generation streams end within milliseconds, so ``grace`` mostly bounds calls
        that never end on their own (health ``Watch`` streams), which are cancelled after it.
        """
        if not await self._stop.begin():
            return
        try:
            # Before anything else, so that routers stop picking this replica now rather than
            # sending it calls it would refuse until its heartbeat expires.
            self.publisher.start_draining()
            await self._health.enter_graceful_shutdown()
            if self.frontend is not None:
                self.frontend.stop_admitting()
                if drain > 0 and self.frontend.num_in_flight:
                    log.info("replica %s: draining %d in-flight requests (up to %.1fs)",
                             self.replica_id, self.frontend.num_in_flight, drain)
                    await self.frontend.wait_idle(drain)
                n = self.frontend.drain()
                if n:
                    log.info("replica %s: aborting %d in-flight requests", self.replica_id, n)
            if self._http is not None:
                await self._http.stop(grace)
            if self._server is not None:
                await self._server.stop(grace)
            for task in (self._watchdog, self._alive):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if self.engine is not None:
                await asyncio.to_thread(self.engine.shutdown, 2.0)
            await asyncio.to_thread(self.publisher.close)
            if self._vllm_metrics is not None and self.telemetry is not None:
                self.telemetry.registry.unregister(self._vllm_metrics)
        finally:
            self._stop.end()
            log.info("replica %s stopped", self.replica_id)

    async def wait_for_termination(self) -> None:
        await self._stop.wait()


class BackgroundReplica(BackgroundServer):
    """A :class:`ReplicaServer` on its own event-loop thread, for synchronous callers (tests,
    benchmarks, an in-process cluster): ``with BackgroundReplica(settings) as r: dial(r.target)``.

    Raises (constructor): whatever ``ReplicaServer.start`` raises, after cleaning up.
    """

    def __init__(self, settings: ReplicaSettings, *, telemetry: Telemetry | None = None, timeout: float = 120.0):
        self._start(
            lambda: ReplicaServer(settings, telemetry=telemetry), "replica-server",
            lambda server: self.run(server.start(), timeout),
        )


def _check_settings(settings: ReplicaSettings) -> None:
    """The TLS and Redis secret settings, read once before anything starts (exit 2 naming the
    setting). Raises ValueError."""
    server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    settings.http_tls_files(), settings.metrics_tls_files()
    RedisAuth.from_settings(settings)


_MAIN = ServerMain(
    ReplicaSettings, lambda settings, telemetry: ReplicaServer(settings, telemetry=telemetry), "kvroute-replica",
    "python -m replica", "A kvroute replica: paged-KV engine, gRPC GenerationService + ReplicaService, KV events.",
    "replica", drain=lambda settings: settings.drain_timeout, check=_check_settings,
    plain_errors=(ReplicaIdInUseError,),
)
serve = _MAIN.serve  # serve(settings, *, telemetry=None): a replica until SIGTERM / SIGINT, then stopped gracefully
main = _MAIN.main  # main(argv=None, prog=None) -> exit status: ``python -m replica`` / ``kvroute replica``


__all__ = [
    "LIVENESS",
    "READINESS",
    "BackgroundReplica",
    "ReplicaServer",
    "build_engine",
    "build_process_engine",
    "main",
    "make_process_step_hook",
    "resolve_model_dir",
    "serve",
]
