"""Capture a stock vLLM server's ZMQ KV events as raw multipart frames (README.md in this folder).

Run with the python of a venv that has vLLM (the CPU build serves the tiny model), pyzmq and msgpack:

    python tests/data/vllm_events/capture.py --model MODEL_DIR --out tests/data/vllm_events/int_hashes.jsonl
    python tests/data/vllm_events/capture.py --model MODEL_DIR --bytes-hashes --out .../bytes_hashes.jsonl

``MODEL_DIR``: a Llama checkpoint whose tokenizer maps token id == byte value (a byte-level BPE with no
merges), so token ids can be sent as they are. The script starts one vLLM OpenAI server on free loopback
ports (its own process group, stopped at exit), subscribes to its KV events, sends the scenario below as
``/v1/completions`` calls with token-id prompts, asks the replay socket for past batches, and writes one
JSON object per line:

- ``{"kind": "meta", ...}``: vLLM's version, the server's command line and environment, block size,
  the number of KV blocks;
- ``{"kind": "frame", "source": "live", "frames": [b64 topic, b64 seq, b64 payload]}``: one message of the
  PUB socket, in arrival order;
- ``{"kind": "request", "name", "prompt_token_ids", "usage", "live_frames"}``: one completion call;
  ``live_frames`` is the number of live frames received once its events had settled;
- ``{"kind": "reset", "response", "live_frames"}``: ``POST /reset_prefix_cache`` (dev mode);
- ``{"kind": "replay", "start_seq", "request": [b64...], "replies": [[b64...], ...]}``: one DEALER request
  (an empty frame and the 8-byte big-endian start seq) and every reply message up to and including the
  end marker (seq -1).

Scenario (block size 32, one tail of 7 tokens on every prompt so that partial blocks are exercised):
``a`` (4 full blocks), ``b`` (shares a's first 3 blocks), ``a_again`` (a repeated), ``fill_0..`` (distinct
4-block prompts that overflow the small KV pool: evictions), reset, ``after_reset`` (a again), ``salted`` (a with ``cache_salt`` "salt-1": extra keys on block 0).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import zmq

BLOCK_SIZE = 32
TAIL = 7
NUM_BLOCKS = 16
TOPIC = "kv"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def b64(frame: bytes) -> str:
    return base64.b64encode(frame).decode("ascii")


def prompt_tokens(seed: int, num_tokens: int) -> list[int]:
    """Printable-ASCII byte ids (32..126), reproducible from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(num_tokens)]


def http_json(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else {}


def wait_health(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"vLLM did not serve /health within {timeout} s")


def drain(sub: zmq.Socket, out: list, quiet_s: float = 0.7, max_s: float = 5.0) -> None:
    """Receive live messages until none arrives for ``quiet_s`` seconds (at most ``max_s``)."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if not sub.poll(int(quiet_s * 1000)):
            return
        out.append(sub.recv_multipart())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bytes-hashes", action="store_true", help="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0")
    ap.add_argument("--num-fill", type=int, default=4, help="distinct 4-block prompts after a, b, a_again")
    ap.add_argument("--log", default=None, help="the server's log (default: OUT with .log)")
    args = ap.parse_args()

    import vllm

    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
                 "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": TOPIC}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(http_port), "--served-model-name", "tiny", "--dtype", "float32",
           "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--prefix-caching-hash-algo", "sha256_cbor",
           "--max-model-len", "256", "--max-num-seqs", "4", "--num-gpu-blocks-override", str(NUM_BLOCKS),
           "--enforce-eager", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events)]
    env_set = {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0" if args.bytes_hashes else "1"}
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    env = {**os.environ, **env_set}
    if os.path.exists(iomp):
        env["LD_PRELOAD"] = iomp
    log_path = args.log or os.path.splitext(args.out)[0] + ".log"
    records: list[dict] = [{"kind": "meta", "vllm_version": vllm.__version__, "variant":
                            "bytes" if args.bytes_hashes else "int", "block_size": BLOCK_SIZE,
                            "num_gpu_blocks_override": NUM_BLOCKS, "topic": TOPIC,
                            "argv": ["python", *("MODEL_DIR" if a == args.model else a for a in cmd[1:])],
                            "env": env_set}]
    live: list[list[bytes]] = []
    base = f"http://127.0.0.1:{http_port}"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_health(base, proc, 600)
        time.sleep(1.0)  # the SUB socket's connection settles before the first event

        def complete(name: str, tokens: list[int], **extra) -> None:
            resp = http_json(base + "/v1/completions", {"model": "tiny", "prompt": tokens, "max_tokens": 1,
                                                         "temperature": 0, **extra})
            drain(sub, live)
            records.append({"kind": "request", "name": name, "prompt_token_ids": tokens, **extra,
                            "usage": resp["usage"], "live_frames": len(live)})

        a = prompt_tokens(1, 4 * BLOCK_SIZE + TAIL)
        b = a[: 3 * BLOCK_SIZE] + prompt_tokens(2, BLOCK_SIZE + TAIL)
        complete("a", a)
        complete("b", b)
        complete("a_again", a)
        for i in range(args.num_fill):
            complete(f"fill_{i}", prompt_tokens(100 + i, 4 * BLOCK_SIZE + TAIL))
        reset = http_json(base + "/reset_prefix_cache", {})
        drain(sub, live)
        records.append({"kind": "reset", "response": reset, "live_frames": len(live)})
        complete("after_reset", a)
        complete("salted", a, cache_salt="salt-1")

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        for start in (1, int.from_bytes(live[-1][1], "big") + 1 if live else 0):
            request = [b"", start.to_bytes(8, "big")]
            dealer.send_multipart(request)
            replies = []
            while dealer.poll(10000):
                msg = dealer.recv_multipart()
                replies.append(msg)
                if len(msg) >= 3 and msg[2] == (-1).to_bytes(8, "big", signed=True):
                    break
            records.append({"kind": "replay", "start_seq": start, "request": [b64(f) for f in request],
                            "replies": [[b64(f) for f in msg] for msg in replies]})
        dealer.close(linger=0)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        sub.close(linger=0)

    # Frames first in arrival order, then the requests that point into them by count.
    frames = [{"kind": "frame", "source": "live", "frames": [b64(f) for f in msg]} for msg in live]
    with open(args.out, "w") as out:
        for rec in [records[0], *frames, *records[1:]]:
            out.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(live)} live frames, {len(records) - 1} other records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
