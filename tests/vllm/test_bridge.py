"""``kvroute bridge`` beside a real vLLM server (replica/bridge/service.py, DESIGN.md §3.4): the
router's index holds the blocks vLLM reported, a request sharing a prefix goes to vLLM with the
prediction vLLM's own ``cached_tokens`` confirms, a bridge started late fills its gap from vLLM's
replay, ``/reset_prefix_cache`` empties the index, and a bridge set up for another model or block
size is refused naming both."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import zmq

from kvroute.hashing import BlockHasher
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from replica.bridge.service import BridgeRefusedError, VllmBridge
from replica.bridge.settings import BridgeSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.vllm.conftest import BLOCK_SIZE, restart_vllm, start_vllm, stop_vllm

T = 120.0
B = BLOCK_SIZE


@pytest.fixture(scope="module")
def redis_server():
    from kvroute_tools.redis_server import RedisServer

    with RedisServer() as s:
        yield s


def bridge_settings(redis_server, vllm_server, default_model_dir, **kw) -> BridgeSettings:
    base = dict(vllm_url=vllm_server.url, kv_events=vllm_server.events, kv_replay=vllm_server.replay,
                kv_topic="kv", model=str(default_model_dir), replica_id="vllm-0", block_size=B,
                redis_url=redis_server.url, heartbeat_interval=0.2, heartbeat_ttl=5.0)
    return BridgeSettings(**{**base, **kw})


class RunningBridge:
    def __init__(self, settings: BridgeSettings) -> None:
        self.bridge = VllmBridge(settings)
        self.bridge.start()
        self.thread = threading.Thread(target=self.bridge.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.bridge.stop()
        self.thread.join(10)
        self.bridge.close()


@pytest.fixture(scope="module")
def bridge(redis_server, vllm_server, default_model_dir):
    b = RunningBridge(bridge_settings(redis_server, vllm_server, default_model_dir))
    yield b.bridge
    b.close()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, bridge):
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(default_model_dir),
                              block_size=B, heartbeat_poll_interval=0.1, speculative_ttl=0.0)
    with BackgroundRouter(settings) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["vllm-0"], what="vLLM routable")
        yield r


def prompt(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 500 for i in range(n)]


def matched(router, ids: list[int], replica_id: str = "vllm-0") -> int:
    scores = router.server.routing.score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids)))
    return next((r.gpu_matched_blocks for r in scores.replicas if r.replica_id == replica_id), -1)


def direct(vllm_server, ids: list[int], n: int = 1) -> dict:
    return vllm_server.post("/v1/completions", {"model": vllm_server.model, "prompt": ids, "max_tokens": n,
                                                "temperature": 0.0, "ignore_eos": True})


def test_the_index_holds_the_blocks_vllm_stored_keyed_as_the_router_hashes_prompts(router, bridge, vllm_server):
    ids = prompt(1, 5 * B + 10)  # 5 full blocks and a partial one (never published)
    direct(vllm_server, ids)
    wait_for(lambda: matched(router, ids) == 5, timeout=30.0, what="the 5 blocks in the router's index")
    hasher = BlockHasher(block_size=B)
    held = set(bridge.rekeyer.held()["GPU"])
    assert set(hasher.event_ints(ids)) <= held  # kvroute's own keys of the prompt: the bridge announced them
    assert matched(router, ids[: 3 * B]) == 3


def test_a_request_sharing_the_prefix_is_routed_there_and_vllm_confirms_the_prediction(router, vllm_server):
    first = prompt(2, 4 * B)
    direct(vllm_server, first)
    wait_for(lambda: matched(router, first) == 4, timeout=30.0, what="the first request's blocks indexed")
    second = first[: 3 * B] + prompt(3, 40)
    with grpc.insecure_channel(router.target) as ch:
        out = gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=second),
            sampling=gen_pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)), timeout=T)
    assert out.routing.replica_id == "vllm-0"
    assert out.routing.predicted_cached_tokens == 3 * B
    assert out.usage.cached_tokens == out.routing.predicted_cached_tokens  # vLLM's own count


def test_a_bridge_started_late_fills_the_history_from_vllms_replay(router, redis_server, vllm_server,
                                                                   default_model_dir):
    ids = prompt(4, 3 * B)
    direct(vllm_server, ids)
    wait_for(lambda: matched(router, ids) == 3, timeout=30.0, what="indexed through the first bridge")
    late = RunningBridge(bridge_settings(redis_server, vllm_server, default_model_dir, replica_id="vllm-late"))
    try:
        direct(vllm_server, prompt(5, 2 * B))  # a live batch past seq 0: the late bridge replays from 0
        wait_for(lambda: matched(router, ids, "vllm-late") == 3, timeout=30.0,
                 what="the late bridge's replica holds the earlier request's blocks")
        assert set(BlockHasher(block_size=B).event_ints(ids)) <= set(late.bridge.rekeyer.held()["GPU"])
    finally:
        late.close()


def test_a_dropped_message_is_filled_from_vllms_replay(router, redis_server, vllm_server, default_model_dir):
    # A bridge fed by hand from its own subscription, one message dropped on the way.
    b = VllmBridge(bridge_settings(redis_server, vllm_server, default_model_dir, replica_id="vllm-drop"))
    b.start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(vllm_server.events)
    try:
        time.sleep(1.0)  # the subscription reaches vLLM's PUB socket
        prompts = [prompt(20 + i, 2 * B) for i in range(3)]
        frames = []
        for p in prompts:
            direct(vllm_server, p)
            while sub.poll(3000):
                frames.append(sub.recv_multipart())
                if not sub.poll(300):
                    break
        assert len(frames) >= 3
        for i, f in enumerate(frames):
            if i == len(frames) - 2:
                continue  # lost: the next message's seq shows the gap
            b.handle(f)
        hasher = BlockHasher(block_size=B)
        # The dropped batch came back from vLLM's replay: every prompt's blocks are there, once.
        assert {h for p in prompts for h in hasher.event_ints(p)} <= set(b.rekeyer.held()["GPU"])
        wait_for(lambda: all(matched(router, p, "vllm-drop") == 2 for p in prompts), timeout=30.0,
                 what="the router's index of the hand-fed bridge")
    finally:
        sub.close()
        b.close()


def test_a_replay_buffer_overrun_starts_a_new_epoch_with_nothing_phantom(redis_server, default_model_dir,
                                                                          tmp_path):
    small = start_vllm(default_model_dir, tmp_path / "vllm-small.log", events_config={"buffer_steps": 2})
    try:
        prompts = [prompt(40 + i, 2 * B) for i in range(5)]
        for p in prompts:  # one or more batches each: the first ones leave the 2-batch buffer
            direct(small, p)
        b = RunningBridge(bridge_settings(redis_server, small, default_model_dir, replica_id="vllm-small"))
        try:
            last = prompt(50, 2 * B)
            direct(small, last)  # a live batch past seq 0: the bridge replays from 0, vLLM has only the last 2
            hasher = BlockHasher(block_size=B)
            wait_for(lambda: set(hasher.event_ints(last)) <= set(b.bridge.rekeyer.held().get("GPU", ())),
                     timeout=30.0, what="the live batch applied after the overrun")
            held = set(b.bridge.rekeyer.held()["GPU"])
            assert b.bridge.sequencer.epochs >= 1
            assert not set(hasher.event_ints(prompts[0])) & held  # overrun: never announced
            assert held <= {h for p in [*prompts, last] for h in hasher.event_ints(p)}  # nothing phantom
        finally:
            b.close()
    finally:
        stop_vllm(small)


def test_reset_prefix_cache_empties_the_index(router, vllm_server):
    ids = prompt(6, 2 * B)
    direct(vllm_server, ids)
    wait_for(lambda: matched(router, ids) == 2, timeout=30.0, what="indexed")
    vllm_server.post("/reset_prefix_cache", {})
    direct(vllm_server, prompt(7, 8))  # vLLM sends AllBlocksCleared with its next engine step
    wait_for(lambda: matched(router, ids) == 0, timeout=30.0, what="the index emptied by AllBlocksCleared")


def test_a_vllm_restart_is_a_new_epoch_and_the_index_holds_only_the_new_servers_blocks(
        router, bridge, vllm_server, default_model_dir):
    old = prompt(8, 3 * B)
    direct(vllm_server, old)
    wait_for(lambda: matched(router, old) == 3, timeout=30.0, what="indexed before the restart")
    epochs = bridge.epochs
    restarted = restart_vllm(vllm_server, default_model_dir)  # same ports: the bridge follows it
    vllm_server.process = restarted.process  # the module fixture stops the new one
    new = prompt(9, 2 * B)
    direct(restarted, new)
    wait_for(lambda: matched(router, new) == 2, timeout=60.0, what="the restarted server's blocks indexed")
    assert bridge.epochs > epochs
    assert matched(router, old) == 0  # the old server's cache is gone, and so is its index entry
    assert set(bridge.rekeyer.held()["GPU"]) == set(BlockHasher(block_size=B).event_ints(new))


@pytest.mark.parametrize(("override", "names"), [
    ({"block_size": 16}, ("16", "32")),
    ({"served_model_name": "another-model"}, ("another-model", "kvroute-tiny-llama")),
])
def test_a_bridge_set_up_for_another_model_or_block_size_is_refused_naming_both(override, names, redis_server,
                                                                                 vllm_server, default_model_dir):
    with pytest.raises(BridgeRefusedError) as err:
        VllmBridge(bridge_settings(redis_server, vllm_server, default_model_dir, replica_id="wrong", **override)).start()
    for name in names:
        assert name in str(err.value)
