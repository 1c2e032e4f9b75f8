"""The router's OpenAI-compatible HTTP front as bench/router.py times it: streamed
``/v1/completions`` calls on one kept-alive connection, timed like the gRPC sides."""

from __future__ import annotations

import http.client
import json
import time

from kvroute.v1 import generation_pb2 as gen_pb


class HttpStream:
    """Streamed ``/v1/completions`` calls over one kept-alive HTTP/1.1 connection, timed like
    :func:`timed_stream` (the first ``data:`` event of a token, then ``data: [DONE]``)."""

    def __init__(self, port: int, request: gen_pb.GenerateRequest):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.body = json.dumps({"model": "kvroute-tiny-llama", "prompt": list(request.token_ids.ids),
                                "max_tokens": request.sampling.max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "stream": True})

    def __call__(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        ttft = None
        self.conn.request("POST", "/v1/completions", self.body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP front: {resp.status} {resp.read()[:200]!r}")
        while line := resp.readline():
            if line.startswith(b"data: [DONE]"):
                break
            if ttft is None and line.startswith(b"data: "):
                ttft = time.perf_counter() - t0
        resp.read()  # the rest of the chunked body, so that the connection is reused
        return ttft or 0.0, time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()


__all__ = ["HttpStream"]
