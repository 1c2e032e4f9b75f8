"""ProcessLLMEngine: the engine's step loop in its own process, per-request output streams for asyncio.

Why a process. ``AsyncLLMEngine`` runs the step loop on a thread of the gRPC server's process. A step
of a small model is mostly Python, so the engine thread and the server (event loop, grpc's poller)
take turns on one GIL: bench/replica.py measured the engine thread at ~0.85 of a core behind gRPC
and 15-20 % of the in-process throughput lost at 32 streams. As vLLM v1 does (``EngineCoreProc``),
the engine here runs in a child process with a GIL of its own (measured: -3 % overhead vs 13-14 % for
the engine thread, same run, 2 quiet cores), and the server talks to it over two one-way pipes::

    server process (asyncio)                                   engine process (spawned, daemon)
    ────────────────────────                                   ────────────────────────────────
    make_request: validated here (tokenizer + EngineFacts)     main thread = the engine thread:
    generate / abort / call ─▶ ops queue ─▶ writer thread ══▶   take ops (add, abort, call, hook)
                                                                step()
    reader thread ◀══ one message per step ══════════════════   step hook: KV publisher, load sample
      admissions ─▶ the Request copies (num_cached_tokens)       ─▶ (outputs, errors, admissions,
      report ─▶ on_step_report(report)                              the hook's report)
      outputs ─▶ loop.call_soon_threadsafe ─▶ one asyncio.Queue per request

Contract (the same async surface as ``AsyncLLMEngine``, which stays for callers that need the
engine object in their own process, or pass lambdas to ``call``):
- ``make_request`` is pure and runs in the caller's process: it is ``LLMEngine.make_request`` itself
  over the facts the engine process reported at startup, so the validation and its messages are
  the engine's. ``generate(request)`` yields ``RequestOutput`` deltas until the final one;
  cancelling the consumer aborts the request in the engine process, which frees its blocks.
- A request's parent-side copy mirrors ``num_cached_tokens`` from its first admission (set by the
  reader thread before ``on_step_report`` runs), so callers watch admissions as they do in-thread.
- ``call(fn)`` runs ``fn(engine)`` in the engine process between steps: ``fn`` (pickled at once,
  a ``TypeError`` / ``PicklingError`` for a lambda) and its result must pickle.
- The step hook is made in the engine process by ``step_hook_factory(engine)``; it runs after every
  step and every idle tick (50 ms), returns a picklable report (or None: nothing new) that travels
  with the step's outputs to ``on_step_report`` on the reader thread, and is closed at shutdown.
- The engine process dying (crash, OOM kill, a step that raises) ends every open stream and pending
  call with ``EngineDeadError`` and sets ``dead``. ``shutdown`` stops it (tells it, then kills it, if it
  does not exit in time; it ignores SIGINT and SIGTERM, which a process-group stop sends it too); it is a daemon, and it exits when this process's end of the pipe closes,
  so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvroute.tokenizer import Tokenizer
from replica.engine.async_engine import EngineDeadError, drain_outputs
from replica.engine.engine import LLMEngine, RequestOutput
from replica.engine.errors import InvalidRequestError
from replica.engine.params import SamplingParams
from replica.engine.request import Request

log = logging.getLogger(__name__)

EngineFactory = Callable[[], LLMEngine]
StepHookFactory = Callable[[LLMEngine], Callable[[LLMEngine], Any]]

_IDLE_TICK_S = 0.05  # an idle engine process still runs the step hook this often (heartbeat load, snapshots)
_STOP = object()  # the writer thread's sentinel


@dataclass(frozen=True)
class EngineFacts:
    """What the engine process reports once its engine is built: everything the server needs to
    validate requests and describe the model without holding the weights."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    hash_algorithm: str
    hash_seed_digest: str
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        algorithm, seed_digest, block_size = engine.hasher.identity
        return cls(
            vocab_size=engine.vocab_size, max_model_len=engine.max_model_len, block_size=block_size,
            num_blocks=engine.num_blocks, hash_algorithm=algorithm, hash_seed_digest=seed_digest,
            eos_token_id=engine.eos_token_id, extra_eos_token_ids=tuple(engine.extra_eos_token_ids),
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ((self.eos_token_id,) if self.eos_token_id is not None else ()) + self.extra_eos_token_ids


class _RequestFactory:
    """``LLMEngine.make_request`` without the engine. It reads only ``tokenizer`` (through
    ``tokenize``), ``vocab_size``, ``max_model_len``, ``extra_eos_token_ids`` and an id counter, which
    the server process has, so validation stays the engine's own code instead of a copy of it."""

    tokenize = LLMEngine.tokenize
    make_request = LLMEngine.make_request

    def __init__(self, tokenizer: Tokenizer, facts: EngineFacts) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = facts.vocab_size
        self.max_model_len = facts.max_model_len
        self.extra_eos_token_ids = facts.extra_eos_token_ids
        self._ids = itertools.count()


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request: Request


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means "not portable"
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


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
        step_hook_factory: ``factory(engine) -> hook``, called in the child; ``hook(engine)`` runs
            after every step and idle tick and returns a picklable report or None; ``hook.close()``
            (if it has one) runs when the child stops.
        on_step_report: receives each report, on the reader thread, before the step's outputs are
            delivered.

    After ``start()``: ``facts`` (:class:`EngineFacts`), ``tokenizer``, ``pid``. ``dead`` is the
    ``EngineDeadError`` once the engine process has died (None while it runs).
    """

    def __init__(
        self,
        engine_factory: EngineFactory,
        model_dir: str | Path,
        *,
        step_hook_factory: StepHookFactory | None = None,
        on_step_report: Callable[[Any], None] | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self._engine_factory = engine_factory
        self._model_dir = Path(model_dir)
        self._hook_factory = step_hook_factory
        self._on_report = on_step_report
        self._startup_timeout = startup_timeout
        self.facts: EngineFacts | None = None
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
            target=_engine_process_main,
            args=(core_in, core_out, self._engine_factory, self._hook_factory, logging.getLogger().getEffectiveLevel()),
            name="kvroute-engine-core",
            daemon=True,
        )
        proc.start()
        core_in.close()  # only the child holds these now: its death reads as EOF here
        core_out.close()
        self._to_core, self._from_core = to_core, from_core
        kind = None
        try:
            self.tokenizer = Tokenizer.from_folder(self._model_dir)  # while the child loads the model
            if not from_core.poll(self._startup_timeout):
                raise RuntimeError(f"engine process: not ready within {self._startup_timeout:g} s")
            try:
                kind, payload = from_core.recv()
            except (EOFError, OSError):
                proc.join(5.0)
                raise RuntimeError(f"engine process exited during startup (exit code {proc.exitcode})") from None
            if kind == "failed":
                raise payload
        except BaseException:
            # A child that reported its failure exits by itself; any other is still loading.
            self._stop_process(timeout=5.0 if kind == "failed" else 0.0)
            raise
        self.facts = payload
        self._requests = _RequestFactory(self.tokenizer, payload)
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
            self._ops.put(("shutdown",))
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
        if proc.is_alive():  # it ignores SIGTERM (``_engine_process_main``): kill it
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
        self._ops.put(("add", request))
        async for item in drain_outputs(q, rid, self._streams, self.abort):
            yield item

    def abort(self, request_id: str) -> None:
        """Ask the engine process to abort a request (idempotent, non-blocking)."""
        self._ops.put(("abort", request_id))

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
        self._ops.put(("call", cid, payload))
        return fut

    def run_in_hook(self, fn: Callable[[Any], object]) -> None:
        """Run ``fn(step_hook)`` in the engine process before its next step (fire-and-forget; the
        RequestSnapshot rpc reaches the publisher this way). ``fn`` must pickle, as for ``call``."""
        self._ops.put(("hook", pickle.dumps(fn)))

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
            kind = msg[0]
            if kind == "step":
                self._on_step(*msg[1:])
            elif kind == "result":
                _kind, cid, ok, value = msg
                target = self._calls.pop(cid, None)
                if target is not None:
                    with contextlib.suppress(RuntimeError):  # the loop is closed
                        target[0].call_soon_threadsafe(_settle, target[1], ok, value)
            elif kind == "dead":
                reason = msg[1]
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

    def _on_step(
        self,
        outputs: list[RequestOutput],
        errors: list[tuple[str, BaseException]],
        admitted: list[tuple[str, int]],
        report: Any,
    ) -> None:
        streams = self._streams
        for rid, num_cached in admitted:
            st = streams.get(rid)
            if st is not None:
                st.request.num_cached_tokens = num_cached
        if report is not None and self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:  # a frontend bug must not stop the outputs
                log.exception("on_step_report failed")
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            st = streams.get(out.request_id)
            if st is not None:
                per_loop.setdefault(st.loop, []).append((st.queue, out))
        for rid, exc in errors:
            st = streams.get(rid)
            if st is not None:
                per_loop.setdefault(st.loop, []).append((st.queue, exc))
        for loop, items in per_loop.items():  # one callback per loop and step, not per output
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, err: BaseException) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for st in list(self._streams.values()):
            per_loop.setdefault(st.loop, []).append((st.queue, err))
        for loop, items in per_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)
        for cid in list(self._calls):
            target = self._calls.pop(cid, None)
            if target is not None:
                with contextlib.suppress(RuntimeError):
                    target[0].call_soon_threadsafe(_settle, target[1], False, err)


# -- the engine process ---------------------------------------------------------------------------
def _engine_process_main(
    ops_in: Connection,
    out: Connection,
    engine_factory: EngineFactory,
    hook_factory: StepHookFactory | None,
    log_level: int,
) -> None:
    """The child's entry point: build the engine and the hook, report ready (or why not), run the loop."""
    # Ctrl-C, and a SIGTERM sent to the whole process group (`kvroute up` stopping, a shell's
    # kill -TERM -PGID), reach this process too; the server decides how to stop (it aborts the
    # in-flight requests first, then tells this process), so the engine process waits to be told.
    # Dying on the group's SIGTERM first made the server log a spurious "engine process exited
    # unexpectedly" during clean shutdowns. SIGKILL, and the end of the server's pipe, still end it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    code = 0
    try:
        engine = engine_factory()
        hook = hook_factory(engine) if hook_factory is not None else None
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        out.send(("failed", _portable(e)))
        code = 1
    else:
        out.send(("ready", EngineFacts.of(engine)))
        code = _EngineCore(engine, hook, ops_in, out).run()
    # What needed closing is closed (the hook flushed the publisher); interpreter teardown with
    # torch loaded takes seconds on a busy machine and would only delay the server's shutdown.
    logging.shutdown()
    os._exit(code)


class _EngineCore:
    """The engine process's step loop. Owns the engine; ``unadmitted`` holds the requests added
    and not yet admitted by the scheduler (``num_cached_tokens`` still -1), whose admission goes to
    the parent with the step that made it."""

    def __init__(self, engine: LLMEngine, hook: Any, ops_in: Connection, out: Connection) -> None:
        self.engine = engine
        self.hook = hook
        self.ops_in = ops_in
        self.out = out
        self.unadmitted: dict[str, Request] = {}
        self.outputs: list[RequestOutput] = []
        self.errors: list[tuple[str, BaseException]] = []
        self.stop = False

    def run(self) -> int:
        """The step loop until shutdown (0) or a crash (1)."""
        eng = self.engine
        code = 0
        try:
            while not self.stop:
                self._take_ops(wait=0.0 if eng.has_unfinished_requests() else _IDLE_TICK_S)
                if self.stop:
                    break
                if eng.has_unfinished_requests():
                    self.outputs.extend(eng.step())
                self._send_step()
        except BaseException as e:  # noqa: BLE001 - the parent fails every stream with it
            log.exception("engine step loop died")
            code = 1
            with contextlib.suppress(Exception):
                self.out.send(("dead", repr(e)))
        finally:
            close = getattr(self.hook, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("closing the step hook failed")
        return code

    def _take_ops(self, wait: float) -> None:
        conn = self.ops_in
        try:
            if not conn.poll(wait):
                return
            while True:
                for op in conn.recv():
                    self._apply(op)
                if self.stop or not conn.poll(0):
                    return
        except (EOFError, OSError):  # the server process is gone: nobody to serve
            self.stop = True

    def _apply(self, op: tuple) -> None:
        eng = self.engine
        kind = op[0]
        if kind == "add":
            req = op[1]
            try:
                eng.add_request(req)
            except Exception as e:  # noqa: BLE001 - reported to the caller's stream
                self.errors.append((req.request_id, _portable(e)))
            else:
                self.unadmitted[req.request_id] = req
        elif kind == "abort":
            final = eng.abort_request(op[1])
            if final is not None:
                self.outputs.append(final)
        elif kind == "call":
            _kind, cid, payload = op
            try:
                value, ok = pickle.loads(payload)(eng), True
            except Exception as e:  # noqa: BLE001 - raised to the caller
                value, ok = _portable(e), False
            try:
                self.out.send(("result", cid, ok, value))
            except Exception as e:  # noqa: BLE001 - the result does not pickle
                self.out.send(("result", cid, False, RuntimeError(f"call result does not pickle: {e}")))
        elif kind == "hook":
            try:
                pickle.loads(op[1])(self.hook)
            except Exception:  # noqa: BLE001 - fire-and-forget: logged here
                log.exception("run_in_hook failed")
        elif kind == "shutdown":
            self.stop = True

    def _send_step(self) -> None:
        admitted: list[tuple[str, int]] = []
        if self.unadmitted:
            for rid, req in list(self.unadmitted.items()):
                if req.num_cached_tokens >= 0:  # set by the scheduler at first admission
                    admitted.append((rid, req.num_cached_tokens))
                    del self.unadmitted[rid]
        outputs, errors = self.outputs, self.errors
        for o in outputs:
            if o.finished:
                self.unadmitted.pop(o.request_id, None)
        report = self.hook(self.engine) if self.hook is not None else None
        if outputs or errors or admitted or report is not None:
            self.outputs, self.errors = [], []
            self.out.send(("step", outputs, errors, admitted, report))


__all__ = ["EngineFacts", "ProcessLLMEngine"]
