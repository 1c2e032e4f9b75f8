"""Helpers the test modules share (``from tests.support import ...``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 10.0, what: str = "condition", *, interval: float = 0.02) -> T:
    """Poll ``pred()`` until it returns a truthy value, and return that value.

    Raises:
        AssertionError: not within ``timeout`` seconds (the message names ``what`` and the last value).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def replica_idle(rep) -> bool:
    """Nothing running or waiting on the replica behind the ``ReplicaServiceStub`` ``rep``, and
    no KV block in use (``GetLoad``)."""
    from kvroute.v1 import replica_pb2 as rep_pb

    load = rep.GetLoad(rep_pb.GetLoadRequest())
    return load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0


def concurrent_stream_outcomes(target: str, n: int, max_tokens: int = 4) -> dict[str, int]:
    """Open ``n`` ReplicaService.GenerateStream calls at once against ``target`` (9-token prompts,
    greedy, ``max_tokens``) and count the outcomes: "OK" for a stream that delivered exactly
    ``max_tokens`` tokens and ended with FINISH_REASON_LENGTH, else the status code's name."""
    import asyncio

    import grpc

    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb
    from kvroute.v1 import replica_pb2_grpc as rep_grpc

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = rep_grpc.ReplicaServiceStub(ch)

            async def one(i: int) -> str:
                req = rep_pb.ReplicaGenerateRequest(
                    token_ids=[1 + i % 400, 2, 3, 4, 5, 6, 7, 8, 9],
                    sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                )
                try:
                    deltas = [d async for d in stub.GenerateStream(req)]
                except grpc.aio.AioRpcError as e:
                    return e.code().name
                assert sum(len(d.token_ids) for d in deltas) == max_tokens
                assert deltas[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
                return "OK"

            return await asyncio.gather(*(one(i) for i in range(n)))

    outcomes = asyncio.run(run())
    return {k: outcomes.count(k) for k in set(outcomes)}


def scrape_metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET a Prometheus endpoint (``http://host:port/metrics``) -> {sample name: [(labels, value), ...]}
    (sample names as exposed: ``_total``, ``_bucket``, ``_count`` and ``_sum`` included)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


NUM_SPECIAL = 5  # the default model's special tokens are its last 5 ids: never in random prompts


def random_tokens(n: int, seed: int, vocab: int = 529) -> list[int]:
    """``n`` token ids drawn by torch's generator from ``seed`` (reproducible), below the default
    model's special tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab - NUM_SPECIAL, (n,), generator=gen).tolist()


def make_cpu_engine(model_dir, *, num_blocks: int, block_size: int = 16, **overrides):
    """An ``LLMEngine`` on CPU with one torch thread and ``num_blocks`` KV blocks."""
    from replica.engine.config import EngineConfig
    from replica.engine.engine import LLMEngine

    cfg = dict(device="cpu", block_size=block_size, num_blocks=num_blocks, torch_threads=1)
    cfg.update(overrides)
    return LLMEngine(model_dir, EngineConfig(**cfg))


@contextlib.contextmanager
def thread_replica(model_dir, replica_id: str, num_blocks: int = 64) -> Iterator:
    """A BackgroundReplica on loopback serving ``model_dir`` with its engine on a thread (no engine
    process, no Redis): for tests that only need something real to answer gRPC."""
    from replica.server import BackgroundReplica
    from replica.settings import ReplicaSettings

    settings = ReplicaSettings(host="127.0.0.1", port=0, model=str(model_dir), num_blocks=num_blocks,
                               torch_threads=1, replica_id=replica_id, engine_process=False)
    with BackgroundReplica(settings) as r:
        yield r


def started_stream(gen, request, n: int, timeout: float | None = None):
    """``gen.GenerateStream(request, timeout=timeout)`` after its first ``n`` deltas, each of which
    carried exactly one token (the call is then in flight on a replica)."""
    stream = gen.GenerateStream(request, timeout=timeout)
    got = [next(stream) for _ in range(n)]
    assert all(len(d.token_ids) == 1 for d in got)
    return stream


def deltas_before_deadline(stream) -> int:
    """Consume a server stream that must fail with DEADLINE_EXCEEDED; returns how many messages
    arrived before it did."""
    import grpc
    import pytest

    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            received += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return received


def abort_mid_stream(gen, rep, request_id: str, sampling) -> list:
    """Start a public stream with ``request_id``, ``Abort`` it after its first delta (found), and
    return the rest of the stream, which ends with FINISH_REASON_ABORT; a second ``Abort`` finds
    nothing."""
    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb

    stream = gen.GenerateStream(gen_pb.GenerateRequest(request_id=request_id, text="abort me", sampling=sampling))
    next(stream)
    assert rep.Abort(rep_pb.AbortRequest(request_id=request_id)).found
    rest = list(stream)
    assert rest[-1].finish_reason == gen_pb.FINISH_REASON_ABORT
    assert not rep.Abort(rep_pb.AbortRequest(request_id=request_id)).found
    return rest


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_duplicate_request_id_refused(gen, rep, request_id: str, sampling) -> None:
    """While a public stream with ``request_id`` is in flight, a ReplicaService call reusing the id
    fails INVALID_ARGUMENT naming ``request_id``; the stream is then cancelled and the replica drains."""
    import grpc
    import pytest

    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb

    stream = gen.GenerateStream(gen_pb.GenerateRequest(request_id=request_id, text="a long one", sampling=sampling))
    next(stream)
    try:
        with pytest.raises(grpc.RpcError) as err:
            rep.Generate(rep_pb.ReplicaGenerateRequest(request_id=request_id, token_ids=[1, 2, 3]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request_id: ")
    finally:
        stream.cancel()
    wait_for(lambda: replica_idle(rep))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Autouse, per module: torch on one intra-op thread while the module's tests run, the previous
    count restored after. A test module opts in with ``from tests.support import one_torch_thread``.
    Their tensors are tiny: with two OpenMP threads on a busy 2-core machine every op waits on a
    barrier, which costs far more than the op."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
