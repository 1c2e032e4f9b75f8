"""Capture vLLM's /v1/completions stream for tests/router/test_vllm_upstream.py.

Run with a vLLM server on --url (see README.md beside this file for how it was started):
    python capture.py --url http://127.0.0.1:8191
Writes stream_max_tokens.sse (the raw SSE body, as vLLM sent it) and meta.json (the prompt and
vLLM's own non-streamed answer to the same request, which the test compares the deltas with).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = list(range(40, 40 + 70))  # 70 token ids of the byte tokenizer: two full 32-token blocks + 6


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    url = ap.parse_args().url
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    whole = json.loads(post(url, {**base, "return_token_ids": True}))  # caches the prompt's 2 full blocks
    stream = post(url, {**base, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True})
    (HERE / "stream_max_tokens.sse").write_bytes(stream)
    choice = whole["choices"][0]
    meta = {"max_tokens": {"prompt": PROMPT, "token_ids": choice["token_ids"], "text": choice["text"],
                           "prompt_tokens": whole["usage"]["prompt_tokens"], "block_size": 32}}
    (HERE / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
