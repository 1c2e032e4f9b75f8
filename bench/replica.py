"""Replica service benchmark: what gRPC costs on top of the engine, in one table.

    python bench/replica.py [--device auto] [--threads 1] [--max-tokens 64] [--seconds 3] [--rounds 3]
                            [--stat median|best|both] [--compare-engine-thread]

For 1, 8 and 32 concurrent streams (closed loop: each stream sends its next request when the
previous one ends; every prompt is distinct, 64 tokens, so the prefix cache plays no part; output
lengths uniform in [max_tokens/2, 3*max_tokens/2] so that the streams do not run in lockstep), on
the default model, greedy, ``ignore_eos``:

- **in-process**: ``AsyncLLMEngine.generate`` called directly in this process, with the replica's
  step hook (``ReplicaFrontend.on_step``) feeding a ``RedisEventPublisher`` -- the same per-step work
  as the server minus gRPC;
- **gRPC**: ``python -m replica`` in a child process with the same settings (``engine_process``
  on: the engine in its own process, ``ProcessLLMEngine``), driven through
  ``ReplicaService.GenerateStream`` over loopback by a grpc.aio client in this process;
- **gRPC, engine thread** (``--compare-engine-thread``): the same with ``--no-engine-process``,
  the engine on a thread of the gRPC process (``AsyncLLMEngine``), as before the engine process.

All sides publish KV events to one throwaway Redis (``kvroute_tools.redis_server``). Reported: output
tokens per second (completed requests' tokens / wall time of the cell; the median of the rounds, or
with ``--stat best`` the best, since noise on a shared machine only ever slows a cell down) and
TTFT p50 (client-side: call start to the first token). Overhead = 1 - gRPC tok/s / in-process
tok/s. Goal: <= 5 % at 32 streams. Per concurrency level the sides alternate, ``--rounds`` cells
each, so that drift and neighbours on the machine hit all alike; a note is printed when other
processes were already busy.

Reading the result on a small CPU box: the default model is so small that a step is mostly Python,
so the engine thread holds the GIL most of the time. With the engine on a thread of the gRPC
process, the server's event loop (and grpc's poller thread) must take the GIL from the engine for
every call and message, and the loss is GIL hand-off latency (sending several tokens per message
lowers the loop's CPU but does not recover the throughput; the running batch shrinks too). Hence
vLLM v1's remedy, the default now: the engine in its own process (one GIL to itself), the gRPC
front end in another, one pipe message per step between them. TTFT is then higher than in-process
by the extra hops (gRPC both ways, two pipes), and the gRPC side needs more than one core in all
(engine process, server process, client): on a small shared machine a busy neighbour shows up as
overhead, which is why the note under the table says how busy the machine was.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench._common import busy_cores  # noqa: E402
from kvroute.redis_layout import RedisLayout  # noqa: E402
from kvroute.v1 import generation_pb2 as gen_pb  # noqa: E402
from kvroute.v1 import replica_pb2 as rep_pb  # noqa: E402
from kvroute.v1 import replica_pb2_grpc as rep_grpc  # noqa: E402
from kvroute_tools.redis_server import RedisServer, free_port  # noqa: E402
from kvroute_tools.supervise import wait_serving  # noqa: E402
from replica.engine.async_engine import AsyncLLMEngine  # noqa: E402
from replica.engine.params import SamplingParams  # noqa: E402
from replica.frontend import ReplicaFrontend  # noqa: E402
from replica.server import build_engine  # noqa: E402
from replica.settings import ReplicaSettings  # noqa: E402

CONCURRENCY = (1, 8, 32)
PROMPT_LEN = 64
GOAL_OVERHEAD = 0.05


@dataclass
class Cell:
    tokens: int
    wall_s: float
    ttfts: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttfts) * 1e3


class Workload:
    """Distinct random prompts (no special tokens) and output lengths uniform in [max_tokens/2,
    3*max_tokens/2], deterministic. Varied lengths keep the streams out of lockstep (equal lengths
    make every stream finish in the same step and come back as one burst of prefills)."""

    def __init__(self, vocab: int, max_tokens: int, seed: int = 0):
        self._rng = random.Random(seed)
        self._vocab = vocab
        self._lo, self._hi = max(1, max_tokens // 2), max(1, max_tokens * 3 // 2)

    def next(self) -> tuple[list[int], int]:
        prompt = [self._rng.randrange(1, self._vocab) for _ in range(PROMPT_LEN)]
        return prompt, self._rng.randint(self._lo, self._hi)


async def closed_loop(concurrency: int, seconds: float, one_request) -> Cell:
    """``concurrency`` streams, each issuing requests back to back until ``seconds`` have passed;
    a request that started counts in full (wall time runs until the last one ends)."""
    ttfts: list[float] = []
    tokens = 0
    stop_at = time.perf_counter() + seconds

    async def stream() -> None:
        nonlocal tokens
        while time.perf_counter() < stop_at:
            n, ttft = await one_request()
            tokens += n
            ttfts.append(ttft)

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return Cell(tokens, time.perf_counter() - t0, ttfts)


async def count_tokens(stream: AsyncIterator[Any], tokens_of: Callable[[Any], Sequence[int]]) -> tuple[int, float]:
    """Drain one request's ``stream`` (not started yet: the clock starts here): (tokens received,
    seconds to the first of them); ``tokens_of`` reads the new token ids from one item."""
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async for item in stream:
        new = tokens_of(item)
        if ttft is None and new:
            ttft = time.perf_counter() - t0
        n += len(new)
    return n, ttft


class InProcess:
    """The baseline: an ``AsyncLLMEngine`` in this process, with the replica's step hook and a publisher."""

    def __init__(self, settings: ReplicaSettings, redis_url: str, max_tokens: int):
        self.settings, self.redis_url = settings, redis_url
        self.max_tokens = max_tokens
        self._ids = iter(range(10**9))

    async def __aenter__(self) -> InProcess:
        from replica.publisher import make_publisher

        engine, model = await asyncio.to_thread(build_engine, self.settings)
        self.publisher = make_publisher(self.redis_url, RedisLayout("bench"), "bench-in-process",
                                        engine.info(model), "in-process")
        self.publisher.start()
        frontend = ReplicaFrontend(replica_id="bench-in-process", max_waiting=self.settings.max_waiting)
        frontend.publisher = self.publisher
        self.engine = AsyncLLMEngine(engine, step_hook=frontend.on_step)
        self.engine.start()
        self.workload = Workload(engine.vocab_size - 8, self.max_tokens, seed=1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.shutdown()
        self.publisher.close()

    async def one(self) -> tuple[int, float]:
        prompt, max_tokens = self.workload.next()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = self.engine.make_request(prompt, params, f"ip-{next(self._ids)}", None)
        return await count_tokens(self.engine.generate(req), lambda out: out.new_token_ids)


class OverGrpc:
    """The same requests through ``ReplicaService.GenerateStream`` of a replica process."""

    def __init__(self, target: str, vocab: int, max_tokens: int):
        self.target = target
        self.workload = Workload(vocab - 8, max_tokens, seed=1)

    async def __aenter__(self) -> OverGrpc:
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = rep_grpc.ReplicaServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()

    async def one(self) -> tuple[int, float]:
        prompt, max_tokens = self.workload.next()
        sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req = rep_pb.ReplicaGenerateRequest(token_ids=prompt, sampling=sampling)
        return await count_tokens(self.stub.GenerateStream(req), lambda delta: delta.token_ids)


async def measure(settings: ReplicaSettings, redis_url: str, targets: dict[str, str], vocab: int, args) -> dict:
    """Alternate the sides' cells (``args.rounds`` of each per concurrency level), so that drift and
    neighbours on the machine hit every side alike. ``targets``: gRPC side name -> replica address."""
    results: dict[tuple[str, int], list[Cell]] = {}
    async with contextlib.AsyncExitStack() as stack:
        sides = [("in-process", await stack.enter_async_context(InProcess(settings, redis_url, args.max_tokens)))]
        for name, target in targets.items():
            sides.append((name, await stack.enter_async_context(OverGrpc(target, vocab, args.max_tokens))))
        for _name, side in sides:
            await closed_loop(4, 1.0, side.one)  # warm-up
        for c in CONCURRENCY:
            for _ in range(args.rounds):
                for name, side in sides:
                    results.setdefault((name, c), []).append(await closed_loop(c, args.seconds, side.one))
    return results


def start_replica_process(
    settings: ReplicaSettings, redis_url: str, *, engine_process: bool, replica_id: str
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "replica", "--port", str(port), "--redis-url", redis_url, "--namespace", "bench",
            "--replica-id", replica_id, "--model-cache-dir", settings.model_cache_dir,
            "--num-blocks", str(settings.num_blocks), "--max-num-seqs", str(settings.max_num_seqs),
            "--device", settings.device, "--torch-threads", str(settings.torch_threads),
            "--engine-process" if engine_process else "--no-engine-process"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    target = f"127.0.0.1:{port}"
    wait_serving(target, proc, "replica", details=lambda: proc.stderr.read() if proc.poll() is not None else "")
    return proc, target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine (default 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="mean output tokens per request")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each cell")
    p.add_argument("--rounds", type=int, default=3, help="alternating cells per side and concurrency")
    p.add_argument("--model-cache-dir", default="", help="where the default model is generated (default: a temp dir)")
    p.add_argument("--stat", choices=("median", "best", "both"), default="median",
                   help="tok/s of a side: median or best of its cells (noise on a shared machine only slows a"
                        " cell), or both tables")
    p.add_argument("--compare-engine-thread", action="store_true",
                   help="add a gRPC side whose engine runs on a thread of the server (engine_process false)")
    args = p.parse_args()

    grpc_sides = {"gRPC": True, **({"gRPC thread": False} if args.compare_engine_thread else {})}
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-") as tmp, RedisServer() as redis_server:
        settings = ReplicaSettings(
            model_cache_dir=args.model_cache_dir or tmp, num_blocks=2048, max_num_seqs=64, device=args.device,
            torch_threads=args.threads,
        )
        procs: list[subprocess.Popen] = []
        try:
            targets = {}
            for i, (name, engine_process) in enumerate(grpc_sides.items()):
                proc, targets[name] = start_replica_process(
                    settings, redis_server.url, engine_process=engine_process, replica_id=f"bench-grpc-{i}"
                )
                procs.append(proc)
            others = busy_cores()  # the replica processes are idle now: this is everyone else
            with grpc.insecure_channel(targets["gRPC"]) as ch:
                info = rep_grpc.ReplicaServiceStub(ch).GetModelInfo(gen_pb.GetModelInfoRequest())
            results = asyncio.run(measure(settings, redis_server.url, targets, info.vocab_size, args))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)

    def tok_s(name: str, c: int, stat: str) -> float:
        pick = max if stat == "best" else statistics.median
        return pick(cell.tok_s for cell in results[(name, c)])

    def ttft_ms(name: str, c: int) -> float:
        return statistics.median(t for cell in results[(name, c)] for t in cell.ttfts) * 1e3

    stats = ("median", "best") if args.stat == "both" else (args.stat,)
    names = ["in-process", *grpc_sides]
    for stat in stats:
        print(f"\nreplica gRPC overhead: {info.model}, device {args.device}, torch threads {args.threads}, prompts"
              f" of {PROMPT_LEN} distinct tokens, {args.max_tokens // 2}-{args.max_tokens * 3 // 2} output tokens,"
              f" greedy; tok/s = {stat} of {args.rounds} alternating {args.seconds:g} s cells per side; KV events"
              " published to Redis on every side; gRPC = engine process"
              + (", gRPC thread = engine thread in the gRPC process" if len(grpc_sides) > 1 else ""))
        head = f"{'streams':>8} {'in-process tok/s':>17}"
        for name in grpc_sides:
            head += f" {name + ' tok/s':>{max(11, len(name) + 6)}} {'overhead':>9}"
        head += "".join(f" {'TTFT p50 ' + n:>{max(14, len(n) + 9)}}" for n in names) + f" {'requests':>16}"
        print(head)
        print("-" * len(head))
        for c in CONCURRENCY:
            a = tok_s("in-process", c, stat)
            line = f"{c:>8} {a:>17,.0f}"
            for name in grpc_sides:
                b = tok_s(name, c, stat)
                line += f" {b:>{max(11, len(name) + 6)},.0f} {1 - b / a:>9.1%}"
            line += "".join(f" {ttft_ms(n, c):>{max(14, len(n) + 9) - 3}.1f} ms" for n in names)
            line += " " + "/".join(str(sum(len(x.ttfts) for x in results[(n, c)])) for n in names).rjust(16)
            print(line)
    if others is not None and others > 0.25:
        print(f"\nnote: other processes kept {others:.1f} of {os.cpu_count()} cores busy before the run; the gRPC"
              " side needs CPU beyond the engine's (its event loop, the client's), so a busy machine inflates"
              " the overhead")
    worst = 1 - tok_s("gRPC", 32, stats[0]) / tok_s("in-process", 32, stats[0])
    verdict = "PASS" if worst <= GOAL_OVERHEAD else "FAIL"
    print(f"\nverdict: {verdict} -- gRPC costs {worst:.1%} of in-process throughput at 32 streams ({stats[0]},"
          f" goal <= {GOAL_OVERHEAD:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
