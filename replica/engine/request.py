"""The engine's per-request state (vLLM v1 ``Request``), shared by scheduler, runner and engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvroute.hashing import BlockHashKeys
from replica.engine.params import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks freed, to be recomputed
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's tokens and progress. Satisfies ``replica.kv.KVRequest``.

    ``all_token_ids`` is prompt + output so far; ``num_computed_tokens`` of them have KV in the
    cache (or are scheduled to, this step). ``num_cached_tokens`` is the prefix hit at the first
    admission (-1 until admitted), reported to clients as ``usage.cached_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # effective output budget (params.effective_max_tokens)
    hash_keys: BlockHashKeys = field(default_factory=BlockHashKeys)
    lora_name: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = -1
    num_expected_hit_tokens: int = 0  # the scheduler's estimate at arrival (Scheduler.queued_prefill_tokens)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
