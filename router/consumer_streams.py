"""StreamReads: the event consumer's blocking reads of the event streams (router/consumer.py's
thread asks, DESIGN.md §4): one blocking XREAD per group of streams, each group on a thread of
its own.

A Redis Cluster runs a multi-key XREAD only when every key is in one hash slot, and each event
shard has a slot of its own (kvroute.redis_layout), so one blocking XREAD cannot wait on every
shard. Reading the shards in turn would add a block timeout per shard to an entry's latency, and
reading them without blocking would poll; here each group's read blocks on its own thread and the
consumer takes whatever has come back. On a cluster each stream is a group; a single Redis reads
every stream in one group (one XREAD, as before there were clusters).

    consumer thread                              one reader thread per group
    ───────────────                              ───────────────────────────
    read(client, positions, block_ms) ──job──▶   idle readers: XREAD BLOCK block_ms COUNT n
        waits up to block_ms for entries ◀─────  STREAMS group's streams, positions
        returns every reply in by then             (the reply, or the error it raised)

A group whose read is still blocked when ``read`` returns is not asked again until its reply is
in, and one that comes back empty (its block ran out) or stale is asked again at once. Positions
advance only through the consumer, so a reply from before ``reset`` (a reconnect) is dropped,
never applied.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence

import redis

Entries = list[tuple[bytes, dict]]
Reply = list[tuple[str, Entries]]


class _Reader:
    """One group's thread: runs each job's XREAD and puts ``(generation, reader, reply)`` on
    ``replies`` (the reply: ``(stream, entries)`` of the streams with entries, or the error)."""

    def __init__(self, streams: Sequence[str], count: int, replies: queue.SimpleQueue):
        self.streams = list(streams)
        self.count = count
        self.busy = False  # a job out and its reply not taken yet (the consumer thread's)
        self._replies = replies
        self._jobs: queue.SimpleQueue[tuple[int, redis.Redis, dict[str, bytes], int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kv-xread-{self.streams[0]}", daemon=True)
        self._thread.start()

    def submit(self, generation: int, client: redis.Redis, positions: Mapping[str, bytes], block_ms: int) -> None:
        self.busy = True
        self._jobs.put((generation, client, {s: positions[s] for s in self.streams}, block_ms))

    def close(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            generation, client, positions, block_ms = job
            reply: Reply | BaseException
            try:
                resp = client.xread(positions, count=self.count, block=block_ms)
                items = resp.items() if isinstance(resp, dict) else (resp or ())  # RESP3 / RESP2
                reply = [(s.decode() if isinstance(s, bytes) else s, entries) for s, entries in items if entries]
            except BaseException as e:  # noqa: BLE001 - handed to the consumer thread, which decides
                reply = e
            self._replies.put((generation, self, reply))


class StreamReads:
    """Blocking reads of ``groups`` of streams (each group one XREAD: streams of one node and
    slot), ``count`` entries at most per stream and reply, for one consumer thread.

    Owns a reader thread per group and the generation that tells current replies from stale
    ones. Only the consumer thread calls ``read`` and ``reset``.
    """

    def __init__(self, groups: Sequence[Sequence[str]], count: int):
        self._replies: queue.SimpleQueue[tuple[int, _Reader, Reply | BaseException]] = queue.SimpleQueue()
        self._readers = [_Reader(group, count, self._replies) for group in groups]
        self._generation = 0

    def reset(self) -> None:
        """Drop the replies of every read out now (the positions or the client changed)."""
        self._generation += 1

    def read(self, client: redis.Redis, positions: Mapping[str, bytes], block_ms: int) -> Reply:
        """Start a read of each idle group after its streams' ``positions`` entry ids, blocking up
        to ``block_ms`` (>= 1); wait as long for the first entries; return ``(stream, entries)``
        for each stream whose entries are in by then (none: nothing new).

        Raises:
            whatever a current read raised (Redis lost: the caller reconnects and resets).
        """
        for reader in self._readers:
            if not reader.busy:
                reader.submit(self._generation, client, positions, block_ms)
        out: Reply = []
        deadline = time.monotonic() + block_ms / 1000
        while True:
            try:
                # After the first entries, only what is already in: they are applied at once.
                generation, reader, reply = (self._replies.get_nowait() if out else
                                             self._replies.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                return out
            reader.busy = False
            stale = generation != self._generation
            if isinstance(reply, BaseException) and not stale:
                raise reply
            if stale or not reply:  # read again at once: idle till the next call, it would add a block to the latency
                reader.submit(self._generation, client, positions, block_ms)
                continue
            out += reply

    def close(self, timeout: float = 2.0) -> None:
        """Stop the threads (each after its read out now ends: within its block timeout)."""
        self.reset()
        for reader in self._readers:
            reader.close()
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(deadline - time.monotonic(), 0))


__all__ = ["StreamReads"]
