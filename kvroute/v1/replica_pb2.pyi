from kvroute.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaGenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("replica_id", "running", "waiting", "kv_usage", "num_blocks", "free_blocks", "queued_prefill_tokens", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_cpu_hits", "preemptions", "recomputed_tokens")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_CPU_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int
    free_blocks: int
    queued_prefill_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_cpu_hits: int
    preemptions: int
    recomputed_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_cpu_hits: _Optional[int] = ..., preemptions: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ...) -> None: ...

class RequestSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestSnapshotResponse(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...
