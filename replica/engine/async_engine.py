"""AsyncLLMEngine: the engine's step loop on its own thread, per-request output streams for asyncio.

The gRPC server runs on an asyncio event loop; a forward pass takes milliseconds to seconds, so the
step loop must never run on that loop. One daemon thread owns the ``LLMEngine``; the loop talks
to it through a thread-safe inbox (adds, aborts) and receives outputs via
``loop.call_soon_threadsafe`` onto one ``asyncio.Queue`` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from replica.engine.engine import LLMEngine, RequestOutput
from replica.engine.params import SamplingParams
from replica.engine.request import Request

log = logging.getLogger(__name__)

StepHook = Callable[[LLMEngine], None]


async def drain_outputs(
    q: asyncio.Queue, request_id: str, streams: dict, abort: Callable[[str], None]
) -> AsyncIterator[RequestOutput]:
    """Yield one request's outputs from its queue until the final one; an exception put on the
    queue is raised. On exit the request leaves ``streams``, and when the consumer stopped early
    (client cancel, deadline) ``abort(request_id)`` frees its blocks. Shared by the thread and
    the process engine."""
    finished = False
    try:
        while True:
            item = await q.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        streams.pop(request_id, None)
        if not finished:
            abort(request_id)


class EngineDeadError(RuntimeError):
    """The step loop crashed; every open stream ends with this error."""


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a background thread while requests are in flight.

    ``step_hook(engine)`` runs on the engine thread after every step (the KV event publisher uses
    it to take the step's events). Start with ``start()``, stop with ``shutdown()``.
    """

    def __init__(self, engine: LLMEngine, step_hook: StepHook | None = None):
        self.engine = engine
        self._hook = step_hook
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self.dead: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- called on the event loop -----------------------------------------------------------------
    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None, cache_salt: str | None
    ) -> Request:
        """Validate (raises InvalidRequestError) without touching engine state."""
        return self.engine.make_request(prompt, params, request_id, cache_salt)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a validated request and yield its outputs until the final one.

        Cancelling the consumer (client cancel, deadline) aborts the request on the engine
        thread, which frees its blocks.

        Raises:
            EngineDeadError: the step loop crashed.
            InvalidRequestError: the request id is already in use.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine step loop died: {self.dead!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        if rid in self._streams:
            from replica.engine.errors import InvalidRequestError

            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        self._streams[rid] = (loop, q)
        self._inbox.put(("add", request))
        self._wake.set()
        async for item in drain_outputs(q, rid, self._streams, self.abort):
            yield item

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request (idempotent, non-blocking)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread between steps; returns an awaitable result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put(("call", (fn, loop, fut)))
        self._wake.set()
        return fut

    # -- the engine thread ------------------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, rid: str) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(q.put_nowait, out)

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    eng.add_request(arg)
                except Exception as e:  # noqa: BLE001 - reported to the caller's stream
                    self._deliver(e, arg.request_id)
            elif kind == "abort":
                out = eng.abort_request(arg)
                if out is not None:
                    self._deliver(out, arg)
            elif kind == "call":
                fn, loop, fut = arg
                try:
                    res = fn(eng)
                    loop.call_soon_threadsafe(lambda f=fut, r=res: f.done() or f.set_result(r))
                except Exception as e:  # noqa: BLE001
                    loop.call_soon_threadsafe(lambda f=fut, x=e: f.done() or f.set_exception(x))

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not eng.has_unfinished_requests():
                    if self._hook is not None:
                        self._hook(eng)
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in eng.step():
                    self._deliver(out, out.request_id)
                if self._hook is not None:
                    self._hook(eng)
        except BaseException as e:  # noqa: BLE001
            log.exception("engine step loop died")
            self.dead = e
            err = EngineDeadError(f"engine step loop died: {e!r}")
            for rid in list(self._streams):
                self._deliver(err, rid)
