"""The trace made concrete: each Mooncake trace request as the prompt, output length and send time
the bench uses (prompts from kvroute_tools.trace's TraceTokenizer: equal hash ids, equal prefixes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute_tools.trace import TraceRequest, TraceTokenizer


@dataclass(frozen=True)
class PlannedRequest:
    """One trace request made concrete: when it is sent (seconds after the start), its prompt and
    how many tokens it generates."""

    index: int
    arrival_s: float
    token_ids: list[int]
    max_tokens: int


def plan_requests(
    trace: Sequence[TraceRequest], tokenizer: TraceTokenizer, *, output_scale: float, max_output_tokens: int,
    time_scale: float | None, max_model_len: int = 0,
) -> tuple[list[PlannedRequest], int]:
    """The trace's requests as prompts and output lengths, and how many prompts were cut to fit
    ``max_model_len`` (0 = no limit; a prompt keeps at least one slot for its output)."""
    t_first = min((r.timestamp_ms for r in trace), default=0.0)
    planned = []
    truncated = 0
    for i, r in enumerate(trace):
        ids = tokenizer.token_ids(r)
        max_tokens = min(max(1, round(r.output_length * output_scale)), max_output_tokens)
        if max_model_len:
            if len(ids) >= max_model_len:
                ids = ids[: max_model_len - 1]
                truncated += 1
            max_tokens = max(1, min(max_tokens, max_model_len - len(ids)))
        arrival = (r.timestamp_ms - t_first) / 1000.0 * time_scale if time_scale is not None else 0.0
        planned.append(PlannedRequest(i, arrival, ids, max_tokens))
    return planned, truncated


__all__ = ["PlannedRequest", "plan_requests"]
