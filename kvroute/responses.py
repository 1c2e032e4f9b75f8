"""Helpers over GenerateResponse streams, shared by the replica frontend and the router proxy."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kvroute.v1 import generation_pb2 as gen_pb

FINISH_REASONS = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
}
"""A finished response's ``finish_reason`` by name (OpenAI's spelling, and the CLI's)."""

MD_REPLICA = "x-kvroute-replica"
"""Trailing metadata (HTTP: a response header) the router adds: the replica that served the call."""
MD_PREDICTED = "x-kvroute-predicted-cached-tokens"
"""Trailing metadata (HTTP: a response header) the router adds: the cached tokens it predicted there."""
MD_CACHED_TOKENS = "x-kvroute-cached-tokens"
"""Trailing metadata of a replica's generation call: ``usage.cached_tokens`` of its final message,
for whoever sees the trailers but not the messages (an endpoint picker behind a gateway)."""


async def concat_deltas(deltas: AsyncIterator[gen_pb.GenerateResponse]) -> gen_pb.GenerateResponse:
    """A stream of deltas as one unary response: all token ids, the full text, and the final
    message's fields (finish reason, matched stop, usage, routing). The stream is closed after."""
    ids: list[int] = []
    texts: list[str] = []
    last = None
    async with contextlib.aclosing(deltas) as stream:
        async for d in stream:
            ids.extend(d.token_ids)
            texts.append(d.text)
            last = d
    resp = gen_pb.GenerateResponse()
    if last is not None:
        resp.CopyFrom(last)
    del resp.token_ids[:]
    resp.token_ids.extend(ids)
    resp.text = "".join(texts)
    return resp
