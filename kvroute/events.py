"""KV cache events and their protobuf codec (DESIGN.md §2, §4; schema in proto/kvroute/v1/events.proto).

A replica's KV cache manager produces these plain dataclasses, in vLLM v1's order (a step's
BlockRemoved before its BlockStored); the publisher encodes one step's list as a ``KVEventBatch``
and the router decodes it. Hash values are the 64-bit event ints of ``kvroute.hashing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import Message

from kvroute.hashing import ExtraKeys
from kvroute.v1 import events_pb2

M = TypeVar("M", bound=Message)

GPU = "GPU"
CPU = "CPU"
MEDIA = (GPU, CPU)


@dataclass(frozen=True)
class BlockStored:
    """Newly full blocks registered in the prefix cache (one chain segment, in order)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str = GPU
    extra_keys: tuple[ExtraKeys, ...] | None = None  # one per block hash, or None when all are None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks dropped from a medium, one entry per copy."""

    block_hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block of ``medium`` was dropped; ``None`` means every medium."""

    medium: str | None = None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


MAX_EVENT_HASHES = 1 << 20
"""Block hashes one KVEvent may carry (a reader's bound: an engine step stores or evicts far fewer)."""
MAX_BATCH_BYTES = 64 << 20
"""Bytes one encoded KVEventBatch may have (a reader's bound, checked before parsing)."""


class EventDecodeError(ValueError):
    """A KVEventBatch (or an extra key inside it) could not be decoded."""


def _extra_to_pb(extra: ExtraKeys) -> events_pb2.BlockExtraKeys:
    msg = events_pb2.BlockExtraKeys()
    for key in extra or ():
        tag = key[0]
        if tag == "lora":
            msg.keys.add().lora.CopyFrom(events_pb2.LoraKey(name=key[1], path=key[2]))
        elif tag == "mm":
            msg.keys.add().mm.CopyFrom(events_pb2.MultiModalKey(identifier=key[1], offset=key[2]))
        elif tag == "cache_salt":
            msg.keys.add().cache_salt = key[1]
        else:
            raise ValueError(f"extra_keys: unknown tag {tag!r}")
    return msg


def _extra_from_pb(msg: events_pb2.BlockExtraKeys) -> ExtraKeys:
    keys: list[tuple] = []
    for k in msg.keys:
        which = k.WhichOneof("key")
        if which == "lora":
            keys.append(("lora", k.lora.name, k.lora.path))
        elif which == "mm":
            keys.append(("mm", k.mm.identifier, k.mm.offset))
        elif which == "cache_salt":
            keys.append(("cache_salt", k.cache_salt))
        else:
            raise EventDecodeError("extra_keys: an ExtraKey with no key set")
    return tuple(keys) if keys else None


def event_to_pb(event: KVCacheEvent) -> events_pb2.KVEvent:
    """One event as a ``kvroute.v1.KVEvent`` message."""
    msg = events_pb2.KVEvent()
    if isinstance(event, BlockStored):
        s = msg.block_stored
        s.block_hashes.extend(event.block_hashes)
        if event.parent_block_hash is not None:
            s.parent_block_hash = event.parent_block_hash
        s.token_ids.extend(event.token_ids)
        s.block_size = event.block_size
        s.lora_name = event.lora_name or ""
        s.medium = event.medium
        if event.extra_keys is not None:
            s.extra_keys.extend(_extra_to_pb(e) for e in event.extra_keys)
    elif isinstance(event, BlockRemoved):
        msg.block_removed.block_hashes.extend(event.block_hashes)
        msg.block_removed.medium = event.medium
    elif isinstance(event, AllBlocksCleared):
        msg.all_blocks_cleared.medium = event.medium or ""
    else:
        raise TypeError(f"not a KV cache event: {event!r}")
    return msg


def event_from_pb(msg: events_pb2.KVEvent) -> KVCacheEvent:
    """The dataclass of a ``kvroute.v1.KVEvent``. Raises EventDecodeError when no event is set."""
    which = msg.WhichOneof("event")
    if which == "block_stored":
        s = msg.block_stored
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=tuple(s.token_ids),
            block_size=s.block_size,
            lora_name=s.lora_name or None,
            medium=s.medium or GPU,
            extra_keys=tuple(_extra_from_pb(e) for e in s.extra_keys) if len(s.extra_keys) else None,
        )
    if which == "block_removed":
        r = msg.block_removed
        return BlockRemoved(block_hashes=tuple(r.block_hashes), medium=r.medium or GPU)
    if which == "all_blocks_cleared":
        return AllBlocksCleared(medium=msg.all_blocks_cleared.medium or None)
    raise EventDecodeError("KVEvent: no event set")


def encode_batch(events: Iterable[KVCacheEvent], ts: float) -> bytes:
    """Serialize one engine step's events (in order) as a ``KVEventBatch``; ``ts`` in Unix seconds."""
    batch = events_pb2.KVEventBatch(ts=ts)
    batch.events.extend(event_to_pb(e) for e in events)
    return batch.SerializeToString()


def decode_batch(data: bytes) -> tuple[float, list[KVCacheEvent]]:
    """Inverse of :func:`encode_batch`: ``(ts, events)``.

    Raises:
        EventDecodeError: the bytes are not a valid KVEventBatch.
    """
    batch = parse_message(events_pb2.KVEventBatch, data)
    return batch.ts, [event_from_pb(m) for m in batch.events]


def batch_problem(batch: events_pb2.KVEventBatch, block_size: int) -> tuple[str, str] | None:
    """Why a decoded batch cannot come from a replica whose KV block size is ``block_size``, as
    ``(reason, detail)``, or None when it can. Reasons: ``hash_count`` (an event with more than
    :data:`MAX_EVENT_HASHES` hashes, or a BlockStored with more token ids than its blocks hold);
    ``block_size`` (a BlockStored whose block_size is neither 0, as the CPU tier sends, nor
    ``block_size``). Unknown media are not a problem here: a reader skips those events."""
    for i, ev in enumerate(batch.events):
        which = ev.WhichOneof("event")
        if which == "block_stored":
            s = ev.block_stored
            n = len(s.block_hashes)
            if s.block_size not in (0, block_size):
                return "block_size", f"event {i}: block_size {s.block_size} != {block_size}"
            if len(s.token_ids) > n * block_size:
                return "hash_count", f"event {i}: {len(s.token_ids)} token ids for {n} blocks of {block_size}"
        elif which == "block_removed":
            n = len(ev.block_removed.block_hashes)
        else:
            continue
        if n > MAX_EVENT_HASHES:
            return "hash_count", f"event {i}: {n} hashes > {MAX_EVENT_HASHES}"
    return None


def parse_message(message_type: type[M], data: bytes) -> M:
    """A ``message_type`` (a generated protobuf class) parsed from ``data``.

    Raises:
        EventDecodeError: the bytes are not a valid ``message_type`` (the message names it).
    """
    try:
        return message_type.FromString(data)
    except Exception as e:  # protobuf raises its own DecodeError
        raise EventDecodeError(f"{message_type.DESCRIPTOR.name}: {e}") from e
