"""Running a kvroute server process until SIGTERM / SIGINT (shared by the replica and router mains).

:class:`ServerMain` is a server process's two entry points, ``serve(settings)`` and ``main(argv)``;
:func:`run_until_signal` and :func:`run_main` are what they run; :class:`BackgroundServer` runs a
server on its own event-loop thread for synchronous callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.telemetry import Telemetry, otlp_configured, otlp_protocol, setup_telemetry
from kvroute.tls import ServerTlsFiles

log = logging.getLogger(__name__)


class Server(Protocol):
    async def start(self) -> None: ...

    async def stop(self, grace: float = ...) -> None: ...


async def run_until_signal(
    make_server: Callable[[Telemetry], Server],
    service_name: str,
    metrics_port: int,
    telemetry: Telemetry | None = None,
    drain: float | None = None,
    *,
    metrics_host: str = "127.0.0.1",
    metrics_tls: ServerTlsFiles | None = None,
) -> None:
    """Start ``make_server(telemetry)``, wait for SIGTERM / SIGINT (also while still starting),
    then stop it gracefully (``stop(drain=drain)`` when ``drain`` is given: the seconds the calls
    in flight get to finish). A failed start stops the server at once and re-raises.

    ``metrics_port`` < 0 means no Prometheus endpoint (else it listens on ``metrics_host``, over
    https with ``metrics_tls``); the telemetry is set up (and shut down) here unless the caller passes its own.
    """
    own_telemetry = telemetry is None
    if telemetry is None:
        telemetry = setup_telemetry(service_name, metrics_port if metrics_port >= 0 else None,
                                    metrics_host=metrics_host, metrics_tls=metrics_tls, set_global=True)
        if telemetry.metrics_port is not None:
            log.info("%s: metrics on %s://%s:%d/metrics", service_name, "https" if metrics_tls else "http",
                     metrics_host, telemetry.metrics_port)
    server = make_server(telemetry)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.create_task(server.start())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            try:
                starting.result()
            except BaseException:
                await server.stop(grace=0)
                raise
            await stopping
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        log.info("%s: stopping", service_name)
        await (server.stop() if drain is None else server.stop(drain=drain))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if own_telemetry:
            telemetry.shutdown()


def run_main(
    settings_cls: type,
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    serve: Callable[[Any], Awaitable[None]],
    what: str,
    *,
    check: Callable[[Any], object] | None = None,
    plain_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """A server process's ``main``: flags (or ``KVROUTE_*``) -> ``settings_cls`` -> ``serve(settings)``
    until a signal. Returns the exit status: 2 for a setting that does not parse or fails ``check``
    (``prog: error: <message naming it>``), 1 when serving fails (one log line, no traceback;
    ``plain_errors`` are logged by message alone, for errors whose message says what to do), else 0.
    """
    from kvroute.settings import load_settings

    try:
        settings = load_settings(settings_cls, argv, prog=prog, description=description)
        if check is not None:
            check(settings)
        if otlp_configured():
            otlp_protocol("traces"), otlp_protocol("metrics")
    except ValueError as e:  # a flag or KVROUTE_* value that does not parse; the message names it
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(settings))
    except plain_errors as e:
        log.error("%s failed: %s", what, e)
        return 1
    except Exception as e:  # noqa: BLE001 - one readable line instead of a traceback
        log.error("%s failed: %s: %s", what, type(e).__name__, e)
        return 1
    return 0


def exit_process(code: int) -> None:
    """End a server process (``python -m replica`` / ``router`` / ``replica.bridge``) with ``code``
    once :func:`run_main` returned: its servers, engine process, Redis clients and telemetry are
    stopped by then, so only the logs and the standard streams are flushed, and the interpreter's
    teardown (module by module, with torch and grpc loaded: most of a second on a busy machine) is
    skipped (``os._exit``), as the engine process does. Never returns."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Bind addresses that mean every interface."""


def dial_host(host: str) -> str:
    """The host to dial on this machine for a server bound to ``host`` (a wildcard: 127.0.0.1)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def dial_target(host: str, port: int | None) -> str:
    """``host:port`` to dial on this machine for a server bound to ``host:port``."""
    return f"{dial_host(host)}:{port}"


class StopOnce:
    """Makes a server's ``stop`` idempotent: the first caller of :meth:`begin` runs the stop
    sequence and calls :meth:`end` in its ``finally``; later callers of :meth:`begin` wait for that
    stop to finish. ``stopping`` is true from the first :meth:`begin` on."""

    def __init__(self) -> None:
        self.stopping = False
        self._stopped = asyncio.Event()

    async def begin(self) -> bool:
        """True for the caller that must run the stop; False (once it has finished) for the others."""
        if self.stopping:
            await self._stopped.wait()
            return False
        self.stopping = True
        return True

    def end(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        """Until the stop has finished."""
        await self._stopped.wait()


@dataclass(frozen=True)
class ServerMain:
    """One kind of server process's entry points (``serve`` and ``main``), from what differs
    between kinds.

    Attributes:
        settings_cls: the settings dataclass (flags and ``KVROUTE_*`` variables; has ``host``,
            ``metrics_port`` and ``metrics_host``).
        make_server: ``(settings, telemetry) -> server`` (started and stopped by :meth:`serve`).
        service_name: the telemetry service name (``kvroute-replica``).
        prog, description: the default program name and the ``--help`` description.
        what: the process kind named in the failure log line (``replica``).
        check, plain_errors: as :func:`run_main` takes them.
        drain: ``settings -> seconds`` the calls in flight get to finish on SIGTERM (None: the
            server's own ``stop()``).
    """

    settings_cls: type
    make_server: Callable[[Any, Telemetry | None], Server]
    service_name: str
    prog: str
    description: str
    what: str
    check: Callable[[Any], object] | None = None
    plain_errors: tuple[type[BaseException], ...] = ()
    drain: Callable[[Any], float] | None = None

    async def serve(self, settings: Any, *, telemetry: Telemetry | None = None) -> None:
        """Run the server until SIGTERM / SIGINT, then stop it gracefully (:func:`run_until_signal`).
        The metrics endpoint listens on ``metrics_host``, or on ``host`` when that is empty: a
        process bound to loopback does not expose its metrics on every interface."""
        await run_until_signal(
            lambda t: self.make_server(settings, t), self.service_name, settings.metrics_port, telemetry,
            None if self.drain is None else self.drain(settings),
            metrics_host=settings.metrics_host or settings.host, metrics_tls=settings.metrics_tls_files(),
        )

    def main(self, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
        """``python -m <package>`` / ``kvroute <kind>``: flags (or ``KVROUTE_*``) -> settings ->
        :meth:`serve`; returns the exit status (:func:`run_main`)."""
        return run_main(
            self.settings_cls, argv, prog or self.prog, self.description, self.serve, self.what,
            check=self.check, plain_errors=self.plain_errors,
        )


class BackgroundServer:
    """A server on its own event-loop thread, for synchronous callers (tests, benchmarks, an
    in-process cluster). Subclasses build ``self.server`` in ``__init__`` through :meth:`_start`.
    ``run(coro)`` runs a coroutine on that loop; ``close()`` stops server and loop (idempotent).
    """

    server: Any

    def _start(self, make_server: Callable[[], Any], name: str, start: Callable[[Any], None]) -> None:
        """Start the loop thread, build the server on it and call ``start(server)``; on any error
        clean up and re-raise."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        self.server = make_server()
        try:
            start(self.server)
        except BaseException:
            self.close()
            raise

    @property
    def target(self) -> str:
        return self.server.target

    def run(self, coro: Any, timeout: float | None = 30.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, grace: float = 1.0) -> None:
        """Stop the server (gracefully) and its loop thread. Idempotent."""
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.run(self.server.stop(grace), grace + 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
