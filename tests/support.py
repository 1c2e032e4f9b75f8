"""Helpers the test modules share (imported as ``support``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 10.0, what: str = "condition", *, interval: float = 0.02) -> T:
    """Poll ``pred()`` until it returns a truthy value, and return that value.

    Raises:
        AssertionError: not within ``timeout`` seconds (the message names ``what`` and the last value).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def replica_idle(rep) -> bool:
    """Nothing running or waiting on the replica behind the ``ReplicaServiceStub`` ``rep``, and
    no KV block in use (``GetLoad``)."""
    from kvroute.v1 import replica_pb2 as rep_pb

    load = rep.GetLoad(rep_pb.GetLoadRequest())
    return load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0
