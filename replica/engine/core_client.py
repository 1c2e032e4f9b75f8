"""ProcessLLMEngine: what the server process holds of an engine whose step loop runs in its own process.

Why a process: a step of a small model is mostly Python, so an engine thread in the gRPC server's
process (``AsyncLLMEngine``) takes turns with the server on one GIL (bench/replica.py measures the
cost). As vLLM v1 does (``EngineCoreProc``), the engine runs in a child process with a GIL of its
own (``core_proc``); the server talks to it over two one-way pipes (``core_messages``)::

    server process (asyncio)                                   engine process (spawned, daemon)
    ────────────────────────                                   ────────────────────────────────
    make_request: validated here (tokenizer + EngineInfo)      main thread = the engine thread:
    generate / abort / call ─▶ ops queue ─▶ writer thread ══▶   take ops (add, abort, call, hook)
                                                                step()
    reader thread ◀══ one StepOutputs per step ══════════════   step hook: KV publisher, load sample
      admissions ─▶ the Request copies (num_cached_tokens)       ─▶ (outputs, errors, admissions,
      report ─▶ on_step_report(report)                              the hook's report)
      outputs ─▶ loop.call_soon_threadsafe ─▶ one asyncio.Queue per request

Contract (the same async surface as ``AsyncLLMEngine``, which stays for callers that need the
engine object in their own process, or pass lambdas to ``call``):
- ``make_request`` is pure and runs in the caller's process: it is ``LLMEngine.make_request`` itself
  over the :class:`~kvroute.engine_info.EngineInfo` the engine process reported at startup, so the
  validation and its messages are the engine's. ``generate(request)`` yields ``RequestOutput``
  deltas until the final one; cancelling the consumer aborts the request in the engine process,
  which frees its blocks.
- A request's parent-side copy mirrors ``num_cached_tokens`` from its first admission (set by the
  reader thread before ``on_step_report`` runs), so callers watch admissions as they do in-thread.
- ``call(fn)`` runs ``fn(engine)`` in the engine process between steps: ``fn`` (pickled at once,
  a ``TypeError`` / ``PicklingError`` for a lambda) and its result must pickle.
- The step hook is made in the engine process by ``step_hook_factory(engine)``; it runs after every
  step and every idle tick (50 ms), returns a picklable report (or None: nothing new) that travels
  with the step's outputs to ``on_step_report`` on the reader thread, and is closed at shutdown.
- The engine process dying (crash, OOM kill, a step that raises) ends every open stream and pending
  call with ``EngineDeadError`` and sets ``dead``. ``shutdown`` stops it (tells it, then kills it,
  if it does not exit in time; it ignores SIGINT and SIGTERM, which a process-group stop sends it
  too); it is a daemon, and it exits when this process's end of the pipe closes, so it never
  outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvroute.engine_info import EngineInfo
from kvroute.tokenizer import Tokenizer
from replica.engine.async_engine import EngineDeadError, drain_outputs
from replica.engine.core_messages import (
    AbortRequest,
    AddRequest,
    CallEngine,
    CallHook,
    CallResult,
    Died,
    EngineFactory,
    Ready,
    Shutdown,
    StartFailed,
    StepHookFactory,
    StepOutputs,
)
from replica.engine.core_proc import engine_process_main
from replica.engine.engine import LLMEngine, RequestOutput
from replica.engine.errors import InvalidRequestError
from replica.engine.params import SamplingParams
from replica.engine.request import Request

log = logging.getLogger(__name__)

_STOP = object()  # the writer thread's sentinel


class _RequestFactory:
    """``LLMEngine.make_request`` without the engine. It reads only ``tokenizer`` (through
    ``tokenize``), ``vocab_size``, ``max_model_len``, ``extra_eos_token_ids`` and an id counter, which
    the server process has, so validation stays the engine's own code instead of a copy of it."""

    tokenize = LLMEngine.tokenize
    make_request = LLMEngine.make_request

    def __init__(self, tokenizer: Tokenizer, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.extra_eos_token_ids = info.extra_eos_token_ids
        self._ids = itertools.count()


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _deliver(pairs: list[tuple[_Stream, Any]]) -> None:
    """Put each item on its stream's queue: one callback per event loop and batch, not per item."""
    per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for st, item in pairs:
        per_loop.setdefault(st.loop, []).append((st.queue, item))
    for loop, items in per_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(_put_all, items)


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class ProcessLLMEngine:
    """Runs an ``LLMEngine`` in a spawned child process; the same async surface as ``AsyncLLMEngine``.

    Args:
        engine_factory: builds the engine in the child (picklable: a module-level function or a
            ``functools.partial`` of one). Its errors are raised again by ``start``.
        model_dir: the model folder, for the tokenizer this process validates text prompts with.
        model: the served model name (``EngineInfo.model``; default: the folder's name).
        step_hook_factory: ``factory(engine) -> hook``, called in the child; ``hook(engine)`` runs
            after every step and idle tick and returns a picklable report or None; ``hook.close()``
            (if it has one) runs when the child stops.
        on_step_report: receives each report, on the reader thread, before the step's outputs are
            delivered.

    After ``start()``: ``info`` (the engine's :class:`~kvroute.engine_info.EngineInfo`), ``tokenizer``,
    ``pid``. ``dead`` is the ``EngineDeadError`` once the engine process has died (None while it runs).
    """

    def __init__(
        self,
        engine_factory: EngineFactory,
        model_dir: str | Path,
        *,
        model: str = "",
        step_hook_factory: StepHookFactory | None = None,
        on_step_report: Callable[[Any], None] | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self._engine_factory = engine_factory
        self._model_dir = Path(model_dir)
        self._model = model or self._model_dir.name
        self._hook_factory = step_hook_factory
        self._on_report = on_step_report
        self._startup_timeout = startup_timeout
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.dead: BaseException | None = None
        self._requests: _RequestFactory | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._to_core: Connection | None = None
        self._from_core: Connection | None = None
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle (any thread; start blocks until the engine is built) ----------------------------
    def start(self) -> None:
        """Spawn the engine process and wait until its engine is built (seconds: model load, warm-up).

        Raises:
            whatever ``engine_factory`` or ``step_hook_factory`` raised in the child (ModelLoadError,
            ValueError naming a setting, ...), or RuntimeError when the child exits without a word
            or is not ready within ``startup_timeout``; the child is stopped first.
        """
        ctx = multiprocessing.get_context("spawn")
        from_core, core_out = ctx.Pipe(duplex=False)
        core_in, to_core = ctx.Pipe(duplex=False)
        self._proc = proc = ctx.Process(
            target=engine_process_main,
            args=(
                core_in, core_out, self._engine_factory, self._hook_factory, self._model,
                logging.getLogger().getEffectiveLevel(),
            ),
            name="kvroute-engine-core",
            daemon=True,
        )
        proc.start()
        core_in.close()  # only the child holds these now: its death reads as EOF here
        core_out.close()
        self._to_core, self._from_core = to_core, from_core
        reply = None
        try:
            self.tokenizer = Tokenizer.from_folder(self._model_dir)  # while the child loads the model
            if not from_core.poll(self._startup_timeout):
                raise RuntimeError(f"engine process: not ready within {self._startup_timeout:g} s")
            try:
                reply = from_core.recv()
            except (EOFError, OSError):
                proc.join(5.0)
                raise RuntimeError(f"engine process exited during startup (exit code {proc.exitcode})") from None
            if isinstance(reply, StartFailed):
                raise reply.error
            assert isinstance(reply, Ready), reply
        except BaseException:
            # A child that reported its failure exits by itself; any other is still loading.
            self._stop_process(timeout=5.0 if isinstance(reply, StartFailed) else 0.0)
            raise
        self.info = reply.info
        self._requests = _RequestFactory(self.tokenizer, reply.info)
        self._reader = threading.Thread(target=self._read_loop, name="engine-proc-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="engine-proc-writer", daemon=True)
        self._reader.start()
        self._writer.start()
        log.info("engine process %d ready", proc.pid)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (its hook is closed: the publisher flushes) and the I/O threads.
        Open streams and pending calls end with ``EngineDeadError``. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._writer is not None:
            self._ops.put(Shutdown())
            self._ops.put(_STOP)
            self._stop_process(timeout)
        else:  # still starting (or never started): nothing to wind down gracefully
            self._stop_process(0.0)
        for t in (self._writer, self._reader):
            if t is not None and t.is_alive():
                t.join(timeout)
        for conn in (self._to_core, self._from_core):
            if conn is not None:
                conn.close()
        self._fail_all(EngineDeadError("engine process stopped"))

    def _stop_process(self, timeout: float) -> None:
        proc = self._proc
        if proc is None or proc.pid is None:
            return
        proc.join(timeout)
        if proc.is_alive():  # it ignores SIGTERM (``core_proc.engine_process_main``): kill it
            log.warning("engine process %d did not stop within %.1f s; killing it", proc.pid, timeout)
            proc.kill()
            proc.join()

    # -- called on the event loop -----------------------------------------------------------------
    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None, cache_salt: str | None
    ) -> Request:
        """Validate (raises InvalidRequestError) in this process, as ``LLMEngine.make_request``."""
        if self._requests is None:
            raise RuntimeError("ProcessLLMEngine.make_request: call start() first")
        return self._requests.make_request(prompt, params, request_id, cache_salt)

    def _dead_error(self) -> EngineDeadError:
        return self.dead if isinstance(self.dead, EngineDeadError) else EngineDeadError(f"engine died: {self.dead!r}")

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a validated request and yield its outputs until the final one.

        Raises:
            EngineDeadError: the engine process died (before or during the request).
            InvalidRequestError: the request id is already in use.
        """
        if self.dead is not None:
            raise self._dead_error()
        rid = request.request_id
        if rid in self._streams:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = _Stream(asyncio.get_running_loop(), q, request)
        # Checked after registering: the reader sets ``dead`` before it fails the registered streams.
        if self.dead is not None:
            self._streams.pop(rid, None)
            raise self._dead_error()
        self._ops.put(AddRequest(request))
        async for item in drain_outputs(q, rid, self._streams, self.abort):
            yield item

    def abort(self, request_id: str) -> None:
        """Ask the engine process to abort a request (idempotent, non-blocking)."""
        self._ops.put(AbortRequest(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run ``fn(engine)`` in the engine process between steps; returns an awaitable result.

        Raises:
            TypeError / pickle.PicklingError: ``fn`` does not pickle (a lambda, a closure).
        """
        payload = pickle.dumps(fn)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        cid = next(self._call_ids)
        self._calls[cid] = (loop, fut)
        if self.dead is not None:  # checked after registering, as in generate
            self._calls.pop(cid, None)
            fut.set_exception(self._dead_error())
            return fut
        self._ops.put(CallEngine(cid, payload))
        return fut

    def run_in_hook(self, fn: Callable[[Any], object]) -> None:
        """Run ``fn(step_hook)`` in the engine process before its next step (fire-and-forget; the
        RequestSnapshot rpc reaches the publisher this way). ``fn`` must pickle, as for ``call``."""
        self._ops.put(CallHook(pickle.dumps(fn)))

    # -- the writer thread ------------------------------------------------------------------------
    def _write_loop(self) -> None:
        """Send queued ops, all that are waiting in one message."""
        assert self._to_core is not None
        while True:
            batch = [self._ops.get()]
            while True:
                try:
                    batch.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            last = batch[-1] is _STOP
            ops = [op for op in batch if op is not _STOP]
            if ops:
                try:
                    self._to_core.send(ops)
                except (OSError, ValueError):  # the child is gone (the reader reports it) or we closed
                    return
            if last:
                return

    # -- the reader thread ------------------------------------------------------------------------
    def _read_loop(self) -> None:
        assert self._from_core is not None and self._proc is not None
        reason = None
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, StepOutputs):
                self._on_step(msg)
            elif isinstance(msg, CallResult):
                target = self._calls.pop(msg.call_id, None)
                if target is not None:
                    with contextlib.suppress(RuntimeError):  # the loop is closed
                        target[0].call_soon_threadsafe(_settle, target[1], msg.ok, msg.value)
            elif isinstance(msg, Died):
                reason = msg.reason
                break
        if self._stopping:
            return
        self._proc.join(2.0)
        if reason is not None:
            err = EngineDeadError(f"engine step loop died: {reason}")
        else:
            err = EngineDeadError(f"engine process exited unexpectedly (exit code {self._proc.exitcode})")
        log.error("%s", err)
        self.dead = err
        self._fail_all(err)

    def _on_step(self, msg: StepOutputs) -> None:
        streams = self._streams
        for rid, num_cached in msg.admitted:
            st = streams.get(rid)
            if st is not None:
                st.request.num_cached_tokens = num_cached
        if msg.report is not None and self._on_report is not None:
            try:
                self._on_report(msg.report)
            except Exception:  # a frontend bug must not stop the outputs
                log.exception("on_step_report failed")
        pairs = [(st, out) for out in msg.outputs if (st := streams.get(out.request_id)) is not None]
        pairs += [(st, exc) for rid, exc in msg.errors if (st := streams.get(rid)) is not None]
        _deliver(pairs)

    def _fail_all(self, err: BaseException) -> None:
        _deliver([(st, err) for st in list(self._streams.values())])
        for cid in list(self._calls):
            target = self._calls.pop(cid, None)
            if target is not None:
                with contextlib.suppress(RuntimeError):
                    target[0].call_soon_threadsafe(_settle, target[1], False, err)


__all__ = ["ProcessLLMEngine"]
