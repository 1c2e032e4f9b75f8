"""vLLM's ZMQ KV events, decoded into typed dataclasses (``vllm/distributed/kv_events.py`` is the writer).

A message on vLLM's PUB socket is three frames::

    topic (bytes, the configured topic) | seq (8 bytes, big-endian, 0 at every server start, +1 per
    batch) | payload (msgpack)

and a reply on the replay (ROUTER) socket, as a DEALER receives it, is the same three frames after an
empty delimiter frame; the reply stream ends with ``b"" | b"" | seq -1 | b""``.

The payload is a msgspec ``array_like`` struct ``[ts, events, data_parallel_rank]`` (``data_parallel_rank``
is omitted when None). Each event is a msgspec struct tagged by its class name: vLLM 0.32 writes it as
a map ``{"type": "BlockStored", "block_hashes": ..., ...}``; a writer that makes the events
``array_like`` too writes ``["BlockStored", block_hashes, parent_block_hash, ...]``. Both are read:
maps by field name, arrays by the field positions below. Fields past the known ones, and map keys
not known here, are ignored (msgspec appends new fields with defaults, so newer writers stay
readable); fields with defaults may be missing (``omit_defaults``).

Field order (array form), the required ones first:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size | lora_id, medium,
  lora_name, extra_keys, group_idx
- ``BlockRemoved``: block_hashes | medium, group_idx
- ``AllBlocksCleared``: nothing

A block hash is an unsigned 64-bit int by default (the last 8 bytes of vLLM's digest,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the raw digest bytes (``=0``); both are kept as they
came. ``token_ids`` is one flat list for the whole run of blocks of one BlockStored; partial blocks
are never published. ``extra_keys`` is one entry per block hash, untagged (a LoRA name, then
``(mm_identifier, offset)`` pairs, the cache salt on block 0, prompt-embedding digests).

Every malformed input raises :class:`VllmEventDecodeError` (a ValueError) whose message starts with
the field it is about, e.g. ``events[1].block_hashes[0]: ...``; nothing else escapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

VllmHash = int | bytes
"""A block hash as vLLM publishes it: an unsigned 64-bit int, or the digest's bytes."""

SEQ_BYTES = 8
REPLAY_END_SEQ = -1
MAX_PAYLOAD_BYTES = 64 << 20
"""Bytes one payload may have (a reader's bound, checked before unpacking)."""


class VllmEventDecodeError(ValueError):
    """A vLLM KV event message could not be decoded. ``field`` names the part at fault."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """vLLM cached ``len(block_hashes)`` newly full blocks of one request, in chain order.

    ``parent_block_hash`` is the hash of the block before the first one (None: the first block is
    the chain's start); ``token_ids`` holds the tokens of every block, ``block_size`` per block.
    ``extra_keys``: one untagged tuple (or None) per block hash, or None when every block has none.
    """

    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple | None, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """vLLM evicted one cached block per hash from ``medium`` (None: vLLM's default, the GPU)."""

    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    """vLLM dropped every cached block (``reset_prefix_cache``)."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


@dataclass(frozen=True, slots=True)
class VllmBatch:
    """One message: batch ``seq`` of the server's current run, written at ``ts`` (seconds since the
    epoch) by data-parallel rank ``dp_rank`` (None when the writer omitted it)."""

    seq: int
    ts: float
    events: tuple[VllmEvent, ...]
    dp_rank: int | None = None


# -- field readers ---------------------------------------------------------------------------------
def _int(value: Any, field: str, *, lo: int = 0, hi: int = (1 << 64) - 1, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if type(value) is not int:
        raise VllmEventDecodeError(field, f"expected an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise VllmEventDecodeError(field, f"{value} is outside [{lo}, {hi}]")
    return value


def _str(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise VllmEventDecodeError(field, f"expected a string or nil, got {type(value).__name__}")


def _list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise VllmEventDecodeError(field, f"expected an array, got {type(value).__name__}")
    return value


def _hash(value: Any, field: str, *, optional: bool = False) -> VllmHash | None:
    if value is None and optional:
        return None
    if isinstance(value, bytes):
        if not value:
            raise VllmEventDecodeError(field, "an empty byte string is not a block hash")
        return value
    if type(value) is int:
        return _int(value, field)
    raise VllmEventDecodeError(field, f"expected an unsigned 64-bit int or bytes, got {type(value).__name__}")


def _hashes(value: Any, field: str) -> tuple[VllmHash, ...]:
    return tuple(_hash(h, f"{field}[{i}]") for i, h in enumerate(_list(value, field)))


def _frozen(value: Any) -> Any:
    """msgpack arrays as tuples, all the way down (extra keys are compared and hashed)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _extra_keys(value: Any, field: str, num_blocks: int) -> tuple[tuple | None, ...] | None:
    if value is None:
        return None
    entries = _list(value, field)
    if len(entries) != num_blocks:
        raise VllmEventDecodeError(field, f"{len(entries)} entries for {num_blocks} block hashes")
    out = []
    for i, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, list):
            raise VllmEventDecodeError(f"{field}[{i}]", f"expected an array or nil, got {type(entry).__name__}")
        out.append(None if entry is None else _frozen(entry))
    return tuple(out)


_FIELDS = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                    ("lora_id", "medium", "lora_name", "extra_keys", "group_idx")),
    "BlockRemoved": (("block_hashes",), ("medium", "group_idx")),
    "AllBlocksCleared": ((), ()),
}


def _fields(raw: Any, field: str) -> tuple[str, dict[str, Any]]:
    """(tag, {field name: value}) of one event, from its map or array form."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = raw
    elif isinstance(raw, list):
        if not raw:
            raise VllmEventDecodeError(field, "an empty array is not an event")
        tag = raw[0]
        values = None
    else:
        raise VllmEventDecodeError(field, f"expected a tagged map or array, got {type(raw).__name__}")
    if not isinstance(tag, str):
        raise VllmEventDecodeError(f"{field}.type", f"expected the event's class name, got {tag!r}")
    if tag not in _FIELDS:
        raise VllmEventDecodeError(f"{field}.type", f"unknown event {tag!r}; expected one of {sorted(_FIELDS)}")
    required, optional = _FIELDS[tag]
    if values is None:  # array form: by position after the tag
        names = required + optional
        values = dict(zip(names, raw[1 : 1 + len(names)], strict=False))
    missing = [name for name in required if name not in values]
    if missing:
        raise VllmEventDecodeError(f"{field}.{missing[0]}", f"missing from {tag}")
    return tag, values


def decode_event(raw: Any, field: str = "event") -> VllmEvent:
    """One event, as msgpack unpacked it (a map or an array; see the module doc).

    Raises:
        VllmEventDecodeError: an unknown tag, a missing required field or a field of the wrong type.
    """
    tag, v = _fields(raw, field)
    if tag == "BlockStored":
        hashes = _hashes(v["block_hashes"], f"{field}.block_hashes")
        tokens = _list(v["token_ids"], f"{field}.token_ids")
        return VllmBlockStored(
            block_hashes=hashes,
            parent_block_hash=_hash(v["parent_block_hash"], f"{field}.parent_block_hash", optional=True),
            token_ids=tuple(_int(t, f"{field}.token_ids[{i}]") for i, t in enumerate(tokens)),
            block_size=_int(v["block_size"], f"{field}.block_size", lo=1, hi=1 << 31),
            lora_id=_int(v.get("lora_id"), f"{field}.lora_id", lo=-(1 << 63), optional=True),
            medium=_str(v.get("medium"), f"{field}.medium"),
            lora_name=_str(v.get("lora_name"), f"{field}.lora_name"),
            extra_keys=_extra_keys(v.get("extra_keys"), f"{field}.extra_keys", len(hashes)),
            group_idx=_int(v.get("group_idx"), f"{field}.group_idx", optional=True),
        )
    if tag == "BlockRemoved":
        return VllmBlockRemoved(
            block_hashes=_hashes(v["block_hashes"], f"{field}.block_hashes"),
            medium=_str(v.get("medium"), f"{field}.medium"),
            group_idx=_int(v.get("group_idx"), f"{field}.group_idx", optional=True),
        )
    return VllmAllBlocksCleared()


def decode_seq(frame: bytes, field: str = "seq") -> int:
    """The batch seq of an 8-byte big-endian frame (signed: the replay's end marker is -1).

    Raises:
        VllmEventDecodeError: the frame is not 8 bytes.
    """
    if not isinstance(frame, bytes | bytearray | memoryview) or len(frame) != SEQ_BYTES:
        size = len(frame) if isinstance(frame, bytes | bytearray | memoryview) else type(frame).__name__
        raise VllmEventDecodeError(field, f"expected {SEQ_BYTES} bytes, got {size}")
    return int.from_bytes(frame, "big", signed=True)


def decode_payload(payload: bytes, seq: int) -> VllmBatch:
    """The batch in one msgpack payload (``[ts, events, dp_rank]``), given its ``seq``.

    Raises:
        VllmEventDecodeError: not msgpack, not the batch's shape, or a malformed event
            (``events[i]...`` names it).
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise VllmEventDecodeError("payload", f"{len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte bound")
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for a bad buffer
        raise VllmEventDecodeError("payload", f"not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise VllmEventDecodeError("payload", "expected the array [ts, events, dp_rank]")
    ts = raw[0]
    if type(ts) not in (int, float):
        raise VllmEventDecodeError("ts", f"expected a number, got {type(ts).__name__}")
    events = _list(raw[1], "events")
    dp_rank = _int(raw[2], "dp_rank", optional=True) if len(raw) > 2 else None
    return VllmBatch(seq=seq, ts=float(ts), events=tuple(decode_event(e, f"events[{i}]") for i, e in enumerate(events)),
                     dp_rank=dp_rank)


def decode_message(frames: Sequence[bytes]) -> VllmBatch:
    """One message of the PUB socket, ``[topic, seq, payload]`` as ``recv_multipart`` returns it.

    Raises:
        VllmEventDecodeError: not three frames (``frames``), a seq that is not 8 bytes or negative
            (``seq``), or a bad payload.
    """
    if not isinstance(frames, Sequence) or len(frames) != 3:
        got = len(frames) if isinstance(frames, Sequence) else type(frames).__name__
        raise VllmEventDecodeError("frames", f"expected [topic, seq, payload], got {got} frames")
    _, seq_frame, payload = frames
    seq = decode_seq(seq_frame)
    if seq < 0:
        raise VllmEventDecodeError("seq", f"{seq} is negative outside a replay's end marker")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise VllmEventDecodeError("payload", f"expected bytes, got {type(payload).__name__}")
    return decode_payload(bytes(payload), seq)


def decode_replay_reply(frames: Sequence[bytes]) -> VllmBatch | None:
    """One reply of the replay socket as a DEALER receives it, ``[b"", topic, seq, payload]``: the
    batch, or None for the end marker (seq -1) that closes every replay.

    Raises:
        VllmEventDecodeError: the first frame is not the empty delimiter, or as :func:`decode_message`.
    """
    if not isinstance(frames, Sequence) or len(frames) != 4:
        got = len(frames) if isinstance(frames, Sequence) else type(frames).__name__
        raise VllmEventDecodeError("frames", f"expected [b'', topic, seq, payload], got {got} frames")
    if frames[0] != b"":
        raise VllmEventDecodeError("frames[0]", "expected the empty delimiter frame")
    if decode_seq(frames[2]) == REPLAY_END_SEQ:
        return None
    return decode_message(frames[1:])


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch from ``start_seq`` on."""
    _int(start_seq, "start_seq", hi=(1 << 63) - 1)
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


__all__ = [
    "MAX_PAYLOAD_BYTES", "REPLAY_END_SEQ", "VllmAllBlocksCleared", "VllmBatch", "VllmBlockRemoved", "VllmBlockStored",
    "VllmEvent", "VllmEventDecodeError", "VllmHash", "decode_event", "decode_message", "decode_payload",
    "decode_replay_reply", "decode_seq", "replay_request",
]
