from kvroute.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "cache_salt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _generation_pb2.TokenIds
    chat: _generation_pb2.ChatMessages
    cache_salt: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[_generation_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[_generation_pb2.ChatMessages, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReplicaScore(_message.Message):
    __slots__ = ("replica_id", "address", "routable", "reason", "gpu_matched_blocks", "cpu_matched_blocks", "speculative_matched_blocks", "queued_prefill_tokens", "in_flight", "running", "kv_usage", "cost")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GPU_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    routable: bool
    reason: str
    gpu_matched_blocks: int
    cpu_matched_blocks: int
    speculative_matched_blocks: int
    queued_prefill_tokens: int
    in_flight: int
    running: int
    kv_usage: float
    cost: float
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., routable: _Optional[bool] = ..., reason: _Optional[str] = ..., gpu_matched_blocks: _Optional[int] = ..., cpu_matched_blocks: _Optional[int] = ..., speculative_matched_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., in_flight: _Optional[int] = ..., running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., cost: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("prompt_tokens", "num_blocks", "replicas", "picked_replica_id", "policy")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PICKED_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    num_blocks: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaScore]
    picked_replica_id: str
    policy: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaScore, _Mapping]]] = ..., picked_replica_id: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...
