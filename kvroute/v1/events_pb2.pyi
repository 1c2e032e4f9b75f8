from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoraKey(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class MultiModalKey(_message.Message):
    __slots__ = ("identifier", "offset")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ExtraKey(_message.Message):
    __slots__ = ("lora", "mm", "cache_salt")
    LORA_FIELD_NUMBER: _ClassVar[int]
    MM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    lora: LoraKey
    mm: MultiModalKey
    cache_salt: str
    def __init__(self, lora: _Optional[_Union[LoraKey, _Mapping]] = ..., mm: _Optional[_Union[MultiModalKey, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium", "extra_keys")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    medium: str
    extra_keys: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ..., extra_keys: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ("medium",)
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    medium: str
    def __init__(self, medium: _Optional[str] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("ts", "events")
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class MediumHashes(_message.Message):
    __slots__ = ("medium", "block_hashes")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    medium: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, medium: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheSnapshot(_message.Message):
    __slots__ = ("replica_id", "epoch", "seq", "media", "ts")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    epoch: int
    seq: int
    media: _containers.RepeatedCompositeFieldContainer[MediumHashes]
    ts: float
    def __init__(self, replica_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., media: _Optional[_Iterable[_Union[MediumHashes, _Mapping]]] = ..., ts: _Optional[float] = ...) -> None: ...
