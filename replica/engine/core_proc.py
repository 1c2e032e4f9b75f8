"""The engine process: the step loop that ``ProcessLLMEngine`` (``core_client``) spawns.

    main thread = the engine thread (``EngineCore.run``):
      take ops (AddRequest, AbortRequest, CallEngine, CallHook, Shutdown), waiting up to the idle tick
      step()
      step hook (KV publisher, load sample) ─▶ one StepOutputs (outputs, errors, admissions, report)

It ignores SIGINT and SIGTERM (the server decides how to stop, see :func:`engine_process_main`),
and it stops when told (Shutdown), when the server's end of the pipe closes, or when a step raises
(Died, then exit code 1). The messages are ``core_messages``' (imported as ``msg``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from replica.engine import core_messages as msg
from replica.engine.engine import LLMEngine, RequestOutput
from replica.engine.request import Request

log = logging.getLogger(__name__)

IDLE_TICK_S = 0.05  # an idle engine process still runs the step hook this often (heartbeat load, snapshots)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means "not portable"
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def engine_process_main(
    ops_in: Connection,
    out: Connection,
    engine_factory: msg.EngineFactory,
    hook_factory: msg.StepHookFactory | None,
    model: str,
    log_level: int,
) -> None:
    """The child's entry point: build the engine and the hook, report :class:`Ready` (the engine's
    ``info(model)``) or :class:`StartFailed`, run the loop, exit."""
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
        out.send(msg.StartFailed(portable(e)))
        code = 1
    else:
        out.send(msg.Ready(engine.info(model)))
        code = EngineCore(engine, hook, ops_in, out).run()
    # What needed closing is closed (the hook flushed the publisher); interpreter teardown with
    # torch loaded takes seconds on a busy machine and would only delay the server's shutdown.
    logging.shutdown()
    os._exit(code)


class EngineCore:
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
                self._take_ops(wait=0.0 if eng.has_unfinished_requests() else IDLE_TICK_S)
                if self.stop:
                    break
                if eng.has_unfinished_requests():
                    self.outputs.extend(eng.step())
                self._send_step()
        except BaseException as e:  # noqa: BLE001 - the parent fails every stream with it
            log.exception("engine step loop died")
            code = 1
            with contextlib.suppress(Exception):
                self.out.send(msg.Died(repr(e)))
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
        if isinstance(op, msg.AddRequest):
            req = op.request
            try:
                eng.add_request(req)
            except Exception as e:  # noqa: BLE001 - reported to the caller's stream
                self.errors.append((req.request_id, portable(e)))
            else:
                self.unadmitted[req.request_id] = req
        elif isinstance(op, msg.AbortRequest):
            final = eng.abort_request(op.request_id)
            if final is not None:
                self.outputs.append(final)
        elif isinstance(op, msg.CallEngine):
            try:
                value, ok = pickle.loads(op.fn)(eng), True
            except Exception as e:  # noqa: BLE001 - raised to the caller
                value, ok = portable(e), False
            try:
                self.out.send(msg.CallResult(op.call_id, ok, value))
            except Exception as e:  # noqa: BLE001 - the result does not pickle
                self.out.send(msg.CallResult(op.call_id, False, RuntimeError(f"call result does not pickle: {e}")))
        elif isinstance(op, msg.CallHook):
            try:
                pickle.loads(op.fn)(self.hook)
            except Exception:  # noqa: BLE001 - fire-and-forget: logged here
                log.exception("run_in_hook failed")
        elif isinstance(op, msg.Shutdown):
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
            self.out.send(msg.StepOutputs(outputs, errors, admitted, report))


__all__ = ["IDLE_TICK_S", "EngineCore", "engine_process_main", "portable"]
