"""The CacheSnapshot codec: a replica's whole cached set at one stream position (DESIGN.md §4;
schema ``kvroute.v1.CacheSnapshot`` in proto/kvroute/v1/events.proto).

    replica publisher ──encode_snapshot──▶ SET kvroute:{ns:k}:snapshot:{id}
    router consumer   ◀─decode_snapshot─── GET                       (bootstrap, a gap it covers)
    router consumer   ◀─snapshot_position─ GETRANGE 0 SNAPSHOT_HEAD_BYTES-1   (every poll)

A snapshot is valid right after batch ``seq`` of ``epoch``: a reader that loads it applies only
the stream entries after that seq. ``media`` holds one hash per cached copy (a hash cached in two
blocks appears twice), per medium.

Reading the head: a snapshot is megabytes, and the consumer needs only its position to decide
whether it is worth fetching (every heartbeat poll, every 50 ms while a gap is open). Protobuf
writes fields in field-number order and ``replica_id`` (1), ``epoch`` (2) and ``seq`` (3) come
before the media, so the first :data:`SNAPSHOT_HEAD_BYTES` bytes hold the position whenever the
replica id is shorter than about 100 bytes; :func:`snapshot_position` walks those fields with the
wire format's varint rules and stops there (protobuf's parser refuses a truncated message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvroute.events import GPU, parse_message
from kvroute.v1 import events_pb2

SNAPSHOT_HEAD_BYTES = 128
"""How many leading bytes :func:`snapshot_position` is given (fields 1-3 with a replica id of up to ~100 bytes)."""


@dataclass(frozen=True)
class CacheSnapshot:
    """One replica's cached set, valid right after batch ``seq`` of ``epoch``.

    Attributes:
        replica_id: whose set.
        epoch, seq: the stream position it is valid at.
        ts: the replica's wall clock when it was taken (Unix seconds).
        media: medium (``GPU`` / ``CPU``) -> 64-bit event hashes, one per cached copy.
    """

    replica_id: str
    epoch: int
    seq: int
    ts: float = 0.0
    media: Mapping[str, Sequence[int]] = field(default_factory=dict)


def encode_snapshot(snapshot: CacheSnapshot) -> bytes:
    """The ``kvroute.v1.CacheSnapshot`` bytes of ``snapshot`` (position fields first, then the media)."""
    msg = events_pb2.CacheSnapshot(
        replica_id=snapshot.replica_id, epoch=snapshot.epoch, seq=snapshot.seq, ts=snapshot.ts
    )
    for medium, hashes in snapshot.media.items():
        msg.media.add(medium=medium, block_hashes=hashes)
    return msg.SerializeToString()


def decode_snapshot(data: bytes) -> CacheSnapshot:
    """Inverse of :func:`encode_snapshot`. A medium left empty reads as ``GPU``; a medium listed
    twice has its hashes joined.

    Raises:
        EventDecodeError: the bytes are not a valid CacheSnapshot.
    """
    msg = parse_message(events_pb2.CacheSnapshot, data)
    media: dict[str, list[int]] = {}
    for m in msg.media:
        media.setdefault(m.medium or GPU, []).extend(m.block_hashes)
    return CacheSnapshot(replica_id=msg.replica_id, epoch=msg.epoch, seq=msg.seq, ts=msg.ts, media=media)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    """(value, index after it) of the varint at ``buf[i]``; IndexError when ``buf`` ends inside it."""
    value = shift = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7


def snapshot_position(head: bytes | None) -> tuple[int, int] | None:
    """(epoch, seq) from the first bytes of an encoded CacheSnapshot (a GETRANGE of
    :data:`SNAPSHOT_HEAD_BYTES`), or None when they are not both in ``head`` (truncated before them,
    no snapshot, or not a snapshot). Never raises."""
    if not head:
        return None
    epoch = seq = None
    i = 0
    try:
        while i < len(head) and (epoch is None or seq is None):
            key, i = _varint(head, i)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:  # varint
                value, i = _varint(head, i)
                if number == 2:
                    epoch = value
                elif number == 3:
                    seq = value
            elif wire_type == 2:  # length-delimited (replica_id, media)
                length, i = _varint(head, i)
                i += length
            elif wire_type == 1:  # 64-bit (ts)
                i += 8
            elif wire_type == 5:  # 32-bit
                i += 4
            else:
                return None
    except IndexError:
        pass
    return (epoch, seq) if epoch is not None and seq is not None else None


__all__ = ["SNAPSHOT_HEAD_BYTES", "CacheSnapshot", "decode_snapshot", "encode_snapshot", "snapshot_position"]
