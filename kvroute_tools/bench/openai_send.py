"""``kvroute bench --api openai``: one planned request sent through an OpenAI-compatible HTTP API
(``POST {http_url}/completions``, streamed, with the official ``openai`` client) instead of
``GenerationService.GenerateStream``, measured the same way (kvroute_tools.bench.run).

The same prompt ids (``prompt`` as a list of token ids), greedy, ``max_tokens`` with
``ignore_eos``, the run's ``cache_salt``, ``stream_options.include_usage`` for the usage (cached
tokens in ``prompt_tokens_details``); the serving replica and the predicted cached tokens from the
``x-kvroute-replica`` / ``x-kvroute-predicted-cached-tokens`` headers when the server sends them
(any other OpenAI-compatible router: left empty). TTFT is the first chunk with text or, for a
token that decodes to no text yet, any content chunk; TPOT as over gRPC.
"""

from __future__ import annotations

import time
from typing import Any

from kvroute_tools.bench.plan import PlannedRequest
from kvroute_tools.bench.report import RequestResult


class OpenAISender:
    """An ``openai.AsyncOpenAI`` client on ``http_url`` (``http://host:port/v1``) for one bench run.

    Raises (constructor):
        ImportError: the ``openai`` package is not installed (the message says what to install).
    """

    def __init__(self, http_url: str) -> None:
        try:
            import openai
        except ImportError as e:
            raise ImportError("--api openai needs the openai package: pip install openai") from e
        self._openai = openai
        self.client = openai.AsyncOpenAI(base_url=http_url, api_key="unused", max_retries=0)

    async def send(self, p: PlannedRequest, salt: str, model: str, timeout: float) -> RequestResult:
        """Send ``p`` and measure it (an HTTP error or a broken stream is the result's ``error``)."""
        res = RequestResult(p.index)
        t0 = time.perf_counter()
        chunk_times: list[float] = []  # of the chunks that carry a choice (text, or a token without text yet)
        usage: Any = None
        try:
            stream = await self.client.completions.create(
                model=model, prompt=p.token_ids, max_tokens=p.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, timeout=timeout,
                extra_body={"ignore_eos": True, "cache_salt": salt},
            )
            headers = stream.response.headers
            async for chunk in stream:
                if chunk.choices:
                    chunk_times.append(time.perf_counter())
                usage = chunk.usage or usage
        except self._openai.APIError as e:  # a status (429, 503, ...) or a broken connection
            status = getattr(e, "status_code", None)
            res.error = f"HTTP {status}: {e.message}" if status is not None else f"{type(e).__name__}: {e}"
            return res
        res.latency_s = time.perf_counter() - t0
        if usage is None:  # asked for with include_usage: a server that ignores it is not measurable
            res.error = "the stream ended without a usage chunk"
            return res
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        first, last = (chunk_times[0], chunk_times[-1]) if chunk_times else (None, None)
        res.measured(t0, first, last, usage.prompt_tokens, usage.completion_tokens, cached)
        res.replica_id = headers.get("x-kvroute-replica", "")
        res.predicted_cached_tokens = int(headers.get("x-kvroute-predicted-cached-tokens", "0") or 0)
        return res

    async def close(self) -> None:
        await self.client.close()


__all__ = ["OpenAISender"]
