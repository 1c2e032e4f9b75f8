"""``kvroute bridge``: one process beside one stock vLLM server that writes, to Redis, the events,
snapshots and heartbeats a kvroute replica writes (DESIGN.md §3.4), so the router serves vLLM
replicas with the same index and the same contract.

    vLLM PUB ──[topic, seq, msgpack]──▶ decode (vllm_events) ──▶ VllmSequencer (gaps, restarts)
                    ▲ replay (DEALER, on a gap)                     │ batches in order
                    └─────────────────────────────────────────────┘ ▼
              Rekeyer (kvroute's hash chain) ──▶ RedisEventPublisher (engine "vllm", address =
              vLLM's HTTP host:port, load from vLLM's /metrics every heartbeat)

At start it checks what it is told against what the server says: the served model name (``GET
/v1/models``) and the block size (``vllm:cache_config_info`` on ``/metrics``); a mismatch is a
:class:`BridgeRefusedError` naming both, never a silent 0% hit rate. So is an event the router
could not key the same way (rekey.RekeyRefusedError). A new epoch (the sequencer's restart or
overrun) starts a new publisher epoch: the router drops what it knew of this replica and reads the
new snapshot. Torch-free, one thread.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import zmq

from kvroute.engine_info import EngineInfo
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import ENGINE_VLLM, EngineLoad
from kvroute.model_folder import read_json_file
from kvroute.redis_connect import RedisAuth
from kvroute.redis_layout import RedisLayout
from replica.bridge.rekey import Rekeyer, RekeyRefusedError
from replica.bridge.sequence import SeqDecision, VllmSequencer
from replica.bridge.settings import BridgeSettings
from replica.bridge.vllm_events import (
    VllmBatch,
    VllmEventDecodeError,
    decode_message,
    decode_replay_reply,
    replay_request,
)
from replica.publisher import EventPublisher, make_publisher

log = logging.getLogger(__name__)

_HTTP_TIMEOUT_S = 5.0
_PROBE_RETRY_S = 1.0


class BridgeRefusedError(RuntimeError):
    """The vLLM server is not the one the bridge was set up for (model, block size, an event it
    cannot key): nothing is published for it. The message names both sides."""


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> ``name -> [(labels, value)]`` (the few series the bridge reads).

    A line that does not parse is skipped (the bridge reads, it does not validate)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels: dict[str, str] = {}
        if rest:
            for part in rest.rstrip("}").split(","):
                key, eq, val = part.partition("=")
                if eq:
                    labels[key.strip()] = val.strip().strip('"')
        try:
            out.setdefault(name.strip(), []).append((labels, float(value)))
        except ValueError:
            continue
    return out


def load_from_metrics(metrics: Mapping[str, list[tuple[dict[str, str], float]]], num_blocks: int) -> EngineLoad:
    """vLLM's load as kvroute's :class:`EngineLoad`: running and waiting requests, and the KV
    usage (``vllm:kv_cache_usage_perc``, a fraction in [0, 1] of blocks held by running requests)."""

    def total(name: str) -> float:
        return sum(v for _, v in metrics.get(name, ()))

    usage = min(max(total("vllm:kv_cache_usage_perc"), 0.0), 1.0)
    free = int(round((1.0 - usage) * max(num_blocks - 1, 0)))
    return EngineLoad(free_blocks=free, running=int(total("vllm:num_requests_running")),
                      waiting=int(total("vllm:num_requests_waiting")), usage=usage)


class VllmBridge:
    """The bridge of one vLLM server (module docstring). ``run`` blocks until ``stop``.

    Raises (from :meth:`start` / :meth:`run`):
        BridgeRefusedError: the server's model or block size is not the configured one, or an
            event cannot be keyed the router's way.
    """

    def __init__(self, settings: BridgeSettings) -> None:
        self.settings = s = settings
        url = urllib.parse.urlsplit(s.vllm_url)
        if not url.hostname or not url.port:
            raise ValueError(f"vllm_url: expected http://host:port, got {s.vllm_url!r}")
        self.address = s.advertise_address or f"{url.hostname}:{url.port}"
        self.replica_id = s.replica_id or f"vllm-{socket.gethostname()}-{url.port}"
        self.model_name = s.served_model_name or (s.model.rstrip("/").rsplit("/", 1)[-1] if s.model else "")
        self.hasher = BlockHasher(block_size=s.block_size, algorithm=s.hash_algorithm, seed=s.hash_seed)
        self.rekeyer = Rekeyer(self.hasher)
        self.sequencer: VllmSequencer[VllmBatch] = VllmSequencer()
        self._stop = threading.Event()
        self._publisher: EventPublisher | None = None
        self._load = EngineLoad()
        self._info: EngineInfo | None = None
        self._ctx = zmq.Context.instance()
        self._published = False  # events announced in the current epoch
        self._started_at: float | None = None  # the server's process_start_time_seconds
        self.epochs = 0

    # -- checks against the server ------------------------------------------------------------------
    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.settings.vllm_url.rstrip("/") + path, timeout=_HTTP_TIMEOUT_S) as resp:
            return resp.read()

    def probe(self) -> EngineInfo:
        """What the server serves, checked against the settings.

        Raises:
            BridgeRefusedError: another model or block size (the message names both).
            OSError: the server does not answer.
        """
        models = json.loads(self._get("/v1/models"))
        served = [m.get("id", "") for m in models.get("data", [])]
        if not served:
            raise BridgeRefusedError(f"vLLM at {self.settings.vllm_url} lists no model on /v1/models")
        card = next((m for m in models["data"] if m.get("id") == self.model_name), None)
        if self.model_name and card is None:
            raise BridgeRefusedError(f"model: vLLM at {self.settings.vllm_url} serves {', '.join(served)!s}, "
                                     f"the bridge is set up for {self.model_name!r} (the router's tokenizer)")
        card = card or models["data"][0]
        self.model_name = card["id"]
        metrics = parse_metrics(self._get("/metrics").decode(errors="replace"))
        config = next(iter(metrics.get("vllm:cache_config_info", ())), ({}, 0.0))[0]
        vllm_block = config.get("block_size")
        if vllm_block is not None and vllm_block.isdigit() and int(vllm_block) != self.settings.block_size:
            raise BridgeRefusedError(f"block_size: vLLM at {self.settings.vllm_url} runs --block-size {vllm_block}, "
                                     f"the bridge (and the router) {self.settings.block_size}")
        num_blocks = config.get("num_gpu_blocks", "0")
        vocab = 0
        if self.settings.model:
            folder = Path(self.settings.model)
            cfg = read_json_file(folder / "config.json", folder)
            vocab = int(cfg.get("vocab_size") or 0)
        self._load = load_from_metrics(metrics, int(num_blocks) if num_blocks.isdigit() else 0)
        self._started_at = next((v for _, v in metrics.get("process_start_time_seconds", ())), None)
        algorithm, digest, block_size = self.hasher.identity
        return EngineInfo(model=self.model_name, vocab_size=vocab, max_model_len=int(card.get("max_model_len") or 0),
                          block_size=block_size, num_blocks=int(num_blocks) if num_blocks.isdigit() else 0,
                          hash_algorithm=algorithm, hash_seed_digest=digest)

    # -- the publisher (one per epoch) -------------------------------------------------------------
    def _new_epoch(self) -> None:
        """Forget every block and start a new kvroute epoch (the router drops the old one)."""
        assert self._info is not None
        self.rekeyer.reset()
        if self._publisher is not None:
            self._publisher.close()
        s = self.settings
        self._publisher = make_publisher(
            s.redis_url, RedisLayout(s.namespace, s.event_shards), self.replica_id, self._info, self.address,
            heartbeat_interval=s.heartbeat_interval, heartbeat_ttl=s.heartbeat_ttl or None,
            snapshot_interval=s.snapshot_interval, max_waiting=s.max_waiting, auth=RedisAuth.from_settings(s),
            engine=ENGINE_VLLM,
        )
        self._publisher.start()
        self._publisher.on_step([], self._load, self.rekeyer.held)
        self._published = False
        self.epochs += 1
        log.info("bridge %s: epoch %d for vLLM at %s (%s)", self.replica_id, self.epochs, self.address, self.model_name)

    def _apply(self, decision: SeqDecision[VllmBatch]) -> None:
        if decision.new_epoch:
            if self._published:
                self._new_epoch()
            else:  # nothing announced in this epoch yet: it can be the new one
                self.rekeyer.reset()
        assert self._publisher is not None
        for batch in decision.apply:
            try:
                events = self.rekeyer.translate(batch.events)
            except RekeyRefusedError as e:
                raise BridgeRefusedError(f"vLLM at {self.settings.vllm_url}: {e}") from e
            if events:
                self._published = True
                self._publisher.on_step(events, self._load, self.rekeyer.held)

    # -- the loop --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Probe the server (waiting while it does not answer yet: a sidecar starts beside it) and
        open the first epoch (an empty one: vLLM's cache is read from its events from here on).

        Raises:
            BridgeRefusedError: see :meth:`probe` (at once, not retried).
        """
        waited = False
        while True:
            try:
                self._info = self.probe()
                break
            except (OSError, ValueError) as e:  # not up yet (refused, reset, a half-started server's answer)
                if self._stop.is_set():
                    return  # stopped before the server came up: nothing was published
                if not waited:
                    log.info("bridge %s: waiting for vLLM at %s (%s)", self.replica_id, self.settings.vllm_url, e)
                    waited = True
                self._stop.wait(_PROBE_RETRY_S)
        self._new_epoch()

    def _replay(self, start: int) -> list[tuple[int, VllmBatch]] | None:
        """Every batch vLLM's replay buffer holds from ``start`` (None: no replay socket, or no
        answer within ``replay_timeout``)."""
        if not self.settings.kv_replay:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.settings.kv_replay)
            sock.send_multipart(replay_request(start))
            out: list[tuple[int, VllmBatch]] = []
            deadline = time.monotonic() + self.settings.replay_timeout
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000)):
                    break
                batch = decode_replay_reply(sock.recv_multipart())
                if batch is None:
                    return out
                out.append((batch.seq, batch))
            log.warning("bridge %s: vLLM's replay from seq %d did not end within %.1f s", self.replica_id, start,
                        self.settings.replay_timeout)
            return None
        finally:
            sock.close()

    def _follow(self, decision: SeqDecision[VllmBatch]) -> None:
        """Apply ``decision``, then every replay it asks for, until none is asked."""
        self._apply(decision)
        while decision.replay_from is not None:
            got = self._replay(decision.replay_from)
            decision = self.sequencer.replay_failed() if got is None else self.sequencer.replayed(got)
            self._apply(decision)

    def handle(self, frames: Sequence[bytes]) -> None:
        """One message of vLLM's PUB socket: decoded, sequenced, and what is now in order
        published; a gap is filled from the replay socket before this returns.

        Raises:
            BridgeRefusedError: an event the router could not key the same way.
        """
        try:
            batch = decode_message(frames)
        except VllmEventDecodeError as e:
            log.error("bridge %s: dropped an undecodable message (%s); asking for a replay", self.replica_id, e)
            start = self.sequencer.begin_replay()
            if start is not None:
                got = self._replay(start)
                self._follow(self.sequencer.replay_failed() if got is None else self.sequencer.replayed(got))
            return
        self._follow(self.sequencer.live(batch.seq, batch))

    def run(self) -> None:
        """Follow the server's events until :meth:`stop` (call :meth:`start` first)."""
        s = self.settings
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, s.kv_topic.encode())
        sub.connect(s.kv_events)
        next_load = time.monotonic() + s.heartbeat_interval
        try:
            while not self._stop.is_set():
                if sub.poll(int(max(next_load - time.monotonic(), 0.0) * 1000) + 1):
                    self.handle(sub.recv_multipart())
                if time.monotonic() >= next_load:
                    next_load = time.monotonic() + s.heartbeat_interval
                    self._refresh_load()
        finally:
            sub.close()

    def _refresh_load(self) -> None:
        assert self._publisher is not None and self._info is not None
        try:
            metrics = parse_metrics(self._get("/metrics").decode(errors="replace"))
        except (OSError, urllib.error.URLError) as e:
            log.warning("bridge %s: vLLM's /metrics did not answer (%s)", self.replica_id, e)
            return
        self._load = load_from_metrics(metrics, self._info.num_blocks)
        started = next((v for _, v in metrics.get("process_start_time_seconds", ())), None)
        if started is not None and self._started_at is not None and started != self._started_at:
            # A restart the seqs may not show (the new run's seqs can pass the old ones unseen).
            log.warning("bridge %s: vLLM at %s restarted; a new epoch", self.replica_id, self.address)
            self._follow(self.sequencer.restarted())
        self._started_at = started
        self._publisher.on_step([], self._load, self.rekeyer.held)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


async def serve(settings: BridgeSettings) -> None:
    """Run the bridge until SIGTERM / SIGINT."""
    import asyncio
    import signal

    bridge = VllmBridge(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    try:
        await asyncio.to_thread(bridge.start)
        if not bridge.stopped:
            await asyncio.to_thread(bridge.run)
    finally:
        bridge.stop()
        bridge.close()


def main(argv: Sequence[str] | None = None, prog: str = "kvroute bridge") -> int:
    """``kvroute bridge`` / ``python -m replica.bridge``: flags and KVROUTE_* variables (--help)."""
    from kvroute.process import run_main

    return run_main(BridgeSettings, argv, prog, "Beside a stock vLLM server: its KV events, load and address "
                    "into kvroute's Redis contract.", serve, "bridge", plain_errors=(BridgeRefusedError,))


__all__ = ["BridgeRefusedError", "VllmBridge", "load_from_metrics", "main", "parse_metrics", "serve"]
