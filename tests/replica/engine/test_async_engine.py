"""AsyncLLMEngine: the step loop on its own thread streams exactly what the sync engine produces,
a cancelled consumer frees its blocks, and seeded sampling is reproducible."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replica.engine.async_engine import AsyncLLMEngine
from replica.engine.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.engine.params import FinishReason, SamplingParams

torch.set_num_threads(1)

NUM_SPECIAL = 5  # the default model's special tokens are its last 5 ids
TIMEOUT_S = 60.0


def random_tokens(n: int, seed: int, vocab: int = 529) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab - NUM_SPECIAL, (n,), generator=gen).tolist()


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(
        model_dir, EngineConfig(device="cpu", num_blocks=64, max_num_batched_tokens=64, torch_threads=1)
    )


@pytest.fixture
def aengine(default_model_dir):
    eng = AsyncLLMEngine(make_engine(default_model_dir))
    eng.start()
    yield eng
    eng.shutdown()


PROMPTS = [random_tokens(n, seed=30 + i) for i, n in enumerate((9, 70, 33, 150))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
]


async def collect(aengine: AsyncLLMEngine, prompt, params, rid):
    req = aengine.make_request(prompt, params, rid, None)
    outs = [out async for out in aengine.generate(req)]
    return outs


def engine_snapshot(eng: LLMEngine):
    return eng.usage, eng.kv.num_free_blocks, eng.has_unfinished_requests(), dict(eng.kv.req_to_blocks)


def test_async_streams_the_same_tokens_as_the_sync_engine(default_model_dir, aengine):
    sync = make_engine(default_model_dir)
    expected = [r.output_token_ids for r in sync.generate(PROMPTS, PARAMS)]

    async def main():
        streams = [
            collect(aengine, p, sp, f"s{i}") for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True))
        ]
        return await asyncio.wait_for(asyncio.gather(*streams), TIMEOUT_S)

    results = asyncio.run(main())
    for outs, exp in zip(results, expected, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == exp
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].completion_tokens == len(exp)


def test_cancelling_a_consumer_mid_stream_aborts_and_frees_its_blocks(aengine):
    async def main():
        received = asyncio.Event()
        got: list[int] = []

        async def consume():
            req = aengine.make_request(
                PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1000), "long", None
            )
            async for out in aengine.generate(req):
                got.extend(out.new_token_ids)
                if len(got) >= 3:
                    received.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(received.wait(), TIMEOUT_S)
        during = await aengine.call(engine_snapshot)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The inbox is FIFO: the abort the cancelled stream queued runs before this call.
        after = await asyncio.wait_for(aengine.call(engine_snapshot), TIMEOUT_S)
        return got, during, after

    got, during, after = asyncio.run(main())
    assert len(got) >= 3
    assert during[0] > 0 and "long" in during[3]
    usage, free, unfinished, tables = after
    assert usage == 0.0 and free == aengine.engine.num_blocks - 1 and not unfinished and not tables


def test_seeded_sampling_request_gives_the_same_output_twice(aengine):
    prompt = random_tokens(40, seed=40)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)

    async def main():
        alone = await collect(aengine, prompt, seeded, "seed-a")
        # Again, this time batched with other (unseeded, random) traffic.
        again, *_ = await asyncio.gather(
            collect(aengine, prompt, seeded, "seed-b"),
            collect(
                aengine, random_tokens(25, seed=41), SamplingParams(temperature=1.0, max_tokens=20), "noise-1"
            ),
            collect(
                aengine, random_tokens(60, seed=42), SamplingParams(temperature=0.7, max_tokens=8), "noise-2"
            ),
        )
        other_seed = await collect(
            aengine, prompt, SamplingParams(temperature=1.0, seed=4321, max_tokens=16), "s2"
        )
        return alone, again, other_seed

    alone, again, other_seed = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    tokens = [t for o in alone for t in o.new_token_ids]
    assert len(tokens) == 16
    assert [t for o in again for t in o.new_token_ids] == tokens
    assert [t for o in other_seed for t in o.new_token_ids] != tokens  # the seed matters
