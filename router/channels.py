"""The router's gRPC channels to its replicas: one per address, made on first use, pruned when idle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvroute.tls import open_channel
from kvroute.v1 import replica_pb2_grpc as rep_grpc

# Reconnect quickly to a replica that was down (the default backoff starts at 1 s and grows to
# 120 s, which would keep a restarted replica unused long after its heartbeat is back).
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.max_receive_message_length", 64 * 2**20),
)


class ReplicaChannels:
    """One ``grpc.aio`` channel (and ReplicaService stub) per replica address, made on first use.
    Event loop only.

    Channels reconnect on their own, so a replica that restarts at the same address keeps its
    channel. ``prune`` closes the channels of addresses no replica advertises any more that have
    not been used for ``idle_s`` seconds (pods come and go in Kubernetes; their channels must not
    pile up), never one with a call in flight. ``credentials``: TLS to the replicas
    (kvroute.tls.channel_credentials; None = plaintext); ``server_name``: over TLS, the name
    every replica's certificate is checked against instead of the host dialed ("" = that host).
    With Kubernetes discovery the router dials pod IPs, which certificates rarely name.
    """

    def __init__(self, options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS, idle_s: float = 300.0,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = ""):
        self._options = list(options)
        self._credentials = credentials
        self._server_name = server_name
        self.idle_s = idle_s
        self._entries: dict[str, _Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def stub(self, address: str) -> rep_grpc.ReplicaServiceStub:
        entry = self._entries.get(address)
        if entry is None:
            channel = open_channel(address, self._credentials, aio=True, options=self._options,
                                   server_name=self._server_name)
            entry = self._entries[address] = _Channel(channel, rep_grpc.ReplicaServiceStub(channel))
        entry.last_used = time.monotonic()
        return entry.stub

    @contextlib.contextmanager
    def in_flight(self, address: str) -> Iterator[rep_grpc.ReplicaServiceStub]:
        """The stub of ``address``, counted as in use until the block ends."""
        stub = self.stub(address)
        entry = self._entries[address]
        entry.calls += 1
        try:
            yield stub
        finally:
            entry.calls -= 1
            entry.last_used = time.monotonic()

    def prune(self, keep: Collection[str]) -> int:
        """Close idle channels of addresses not in ``keep``; returns how many."""
        now = time.monotonic()
        stale = [a for a, e in self._entries.items()
                 if a not in keep and not e.calls and now - e.last_used >= self.idle_s]
        for address in stale:
            task = asyncio.get_running_loop().create_task(self._entries.pop(address).channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return len(stale)

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        entries, self._entries = self._entries, {}
        for e in entries.values():
            await e.channel.close(grace=None)


@dataclass(eq=False)
class _Channel:
    channel: grpc.aio.Channel
    stub: rep_grpc.ReplicaServiceStub
    calls: int = 0
    last_used: float = 0.0


__all__ = ["CHANNEL_OPTIONS", "ReplicaChannels"]
