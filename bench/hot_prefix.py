"""A hot shared prefix in a burst: does it spill onto the idle replica, through every front?

    python bench/hot_prefix.py [--replicas 2] [--requests 400] [--system-tokens 130] [--max-tokens 8]

What runs: ``kvroute up`` with ``--replicas`` kvroute replicas (the default tiny model), the router's
gRPC and OpenAI HTTP fronts, and Envoy with the router as its endpoint picker. Per front in turn
(the router's HTTP front through the ``openai`` client, the router's gRPC front, Envoy's gRPC
listener), ``--requests`` chat requests are sent at once, all sharing one system prompt of about
``--system-tokens`` tokens (a new one per front, so every front starts with the prefix cached
nowhere) and each with its own short user message. The most common production pattern: every
request of a deployment starts with the same system prompt.

Printed per front: the requests each replica finished (its ``kvroute_replica_requests_finished``
counter before and after), the largest replica's share, the refused calls by status, and the
burst's wall time. Goal (the verdict column): the split within 60/40 (no replica above
``1 / replicas + 0.1`` of the burst) and no refusal while any replica has room.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import print_table  # noqa: E402
from kvroute_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402

FINISHED = "kvroute_replica_requests_finished_total"
WORDS = ("harbour", "lantern", "granite", "meadow", "copper", "violet", "thunder", "orchard", "silver", "falcon",
         "river", "ember", "glacier", "willow", "saffron", "canyon")


def system_prompt(rng: random.Random, tokenizer, tokens: int) -> str:
    """Words drawn from ``rng`` until the text encodes to at least ``tokens`` tokens."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words.append(rng.choice(WORDS))
    return "You are a helpful assistant. " + " ".join(words)


def finished_counts(urls: dict[str, str]) -> dict[str, float]:
    """Each replica's finished-request counter (every label summed), by process name."""
    out = {}
    for name, url in urls.items():
        if not name.startswith("replica"):
            continue
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(FINISHED))
    return out


async def burst_http(base_url: str, messages_of, n: int, max_tokens: int) -> collections.Counter:
    import openai

    outcomes: collections.Counter = collections.Counter()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300) as client:
        async def one(i: int) -> None:
            try:
                await client.chat.completions.create(model=MODEL, messages=messages_of(i), max_tokens=max_tokens,
                                                     temperature=0.0)
                outcomes["ok"] += 1
            except openai.APIStatusError as e:
                outcomes[f"HTTP {e.status_code}"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


async def burst_grpc(target: str, messages_of, n: int, max_tokens: int) -> collections.Counter:
    import grpc

    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import generation_pb2_grpc as gen_grpc

    outcomes: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)

        async def one(i: int) -> None:
            chat = gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(**m) for m in messages_of(i)])
            req = gen_pb.GenerateRequest(chat=chat, sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
            try:
                async for _ in stub.GenerateStream(req, timeout=300):
                    pass
                outcomes["ok"] += 1
            except grpc.aio.AioRpcError as e:
                outcomes[f"{e.code().name} {e.details()[:60]!r}"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return outcomes


MODEL = ""


def main(argv: list[str] | None = None) -> int:
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--system-tokens", type=int, default=130)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--fronts", default="router_http,router_grpc,envoy_grpc")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from kvroute.prompt import PromptTokenizer, resolve_model_dir

    cluster = LocalCluster(ClusterConfig(replicas=a.replicas, router_port=0, metrics=True, gateway="envoy"),
                           log=lambda *m, **kw: print(*m, file=sys.stderr, **kw)).start()
    rows = []
    try:
        tokenizer = PromptTokenizer.from_folder(resolve_model_dir(cluster.model_dir or "")).tokenizer
        MODEL = Path(resolve_model_dir(cluster.model_dir or "")).name
        rng = random.Random(a.seed)
        fronts = {
            "router_http": lambda m: burst_http(cluster.router_http_url, m, a.requests, a.max_tokens),
            "router_grpc": lambda m: burst_grpc(cluster.router_target, m, a.requests, a.max_tokens),
            "envoy_grpc": lambda m: burst_grpc(cluster.front_target, m, a.requests, a.max_tokens),
        }
        for front in a.fronts.split(","):
            system = system_prompt(rng, tokenizer, a.system_tokens)
            users = [f"Question {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}?" for i in range(a.requests)]

            def messages_of(i: int, system=system, users=users) -> list[dict[str, str]]:
                return [{"role": "system", "content": system}, {"role": "user", "content": users[i]}]

            before = finished_counts(cluster.metrics_urls)
            t0 = time.perf_counter()
            outcomes = asyncio.run(fronts[front](messages_of))
            wall = time.perf_counter() - t0
            time.sleep(1.0)  # the counters of the last calls
            after = finished_counts(cluster.metrics_urls)
            split = [int(after[k] - before.get(k, 0.0)) for k in sorted(after)]
            top = max(split) / max(sum(split), 1)
            refused = {k: v for k, v in outcomes.items() if k != "ok"}
            met = top <= 1 / a.replicas + 0.1 and not refused
            rows.append((front, "/".join(map(str, split)), f"{top:.2f}", sum(refused.values()),
                         "; ".join(f"{k} x{v}" for k, v in refused.items()) or "-", f"{wall:.1f}",
                         "MET" if met else "NOT MET"))
    finally:
        cluster.stop()
    print(f"\n{a.requests} concurrent chat requests sharing a ~{a.system_tokens}-token system prompt,"
          f" {a.replicas} replicas, {a.max_tokens} output tokens each")
    print_table(("front", "finished per replica", "largest share", "refused", "refusals", "wall s",
                 f"goal: largest share <= {1 / a.replicas + 0.1:.2f}, no refusal"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
