"""The replica process's settings: ``kvroute replica --flag`` or ``KVROUTE_FLAG`` (kvroute.settings)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from kvroute.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_SEED, HASH_ALGORITHMS
from kvroute.settings import setting
from kvroute.shared_settings import RedisSettings, ServingSettings
from replica.attention.selector import BACKEND_NAMES
from replica.engine.config import EngineConfig


@dataclass(frozen=True)
class ReplicaSettings(RedisSettings, ServingSettings):
    """Every setting of one replica process (flags override ``KVROUTE_*`` variables)."""

    model: str = setting("", "model folder (Hugging Face layout); empty = the generated default model")
    model_cache_dir: str = setting("", "where the default model is generated (default ~/.cache/kvroute/models)")
    host: str = setting("127.0.0.1", "gRPC listen address")
    port: int = setting(50051, "gRPC port (0 = pick a free one)")
    advertise_address: str = setting("", "host:port the router dials (default host:port)")
    replica_id: str = setting("", "unique id in the cluster (default hostname-port)")
    redis_url: str = setting("", "Redis for KV events and heartbeats (empty = do not publish)")
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats")
    heartbeat_ttl: float = setting(
        0.0, "seconds the heartbeat key lives, at least one interval (0 = 3 heartbeats): how long routers keep a"
        " replica that stopped heartbeating"
    )
    snapshot_interval: float = setting(30.0, "seconds between periodic cache snapshots")
    event_buffer: int = setting(10000, "event batches buffered while Redis is slow or down")
    stream_maxlen: int = setting(100000, "approximate MAXLEN of the event stream")
    max_waiting: int = setting(256, "requests waiting in the queue before RESOURCE_EXHAUSTED")
    drain_timeout: float = setting(
        30.0, "on SIGTERM: seconds the requests in flight get to finish (no new ones admitted) before they are aborted"
    )
    engine_process: bool = setting(
        True, "run the engine step loop in its own process (false: a thread of the gRPC process)"
    )
    device: str = setting("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = setting("auto", "float32, float16, bfloat16 or auto")
    attn_backend: str = setting(
        "auto", "attention backend (auto: flash_attn on CUDA when a build pages block_size, else triton; torch off CUDA)",
        choices=BACKEND_NAMES,
    )
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "KV block size in tokens")
    num_blocks: int = setting(0, "KV blocks (0 = size from the memory budget)")
    kv_cache_memory_mb: int = setting(256, "KV cache budget on CPU, MiB")
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory for weights + KV cache")
    max_num_batched_tokens: int = setting(2048, "token budget per engine step")
    max_num_seqs: int = setting(256, "most running requests")
    max_model_len: int = setting(0, "most tokens per sequence (0 = the model's, capped by the KV cache)")
    enable_prefix_caching: bool = setting(True, "prefix caching on/off")
    hash_algorithm: str = setting("sha256_cbor", "block hash algorithm", choices=HASH_ALGORITHMS)
    hash_seed: str = setting(DEFAULT_SEED, "block hash seed (must match the router's)")
    cpu_offload_blocks: int = setting(0, "CPU-tier KV blocks (0 = no CPU tier)")
    torch_threads: int = setting(0, "torch intra-op threads (0 = torch's default)")
    seed: int = setting(0, "seed of the shared sampling generator")
    enforce_eager: bool = setting(False, "never run decode steps as CUDA graphs")

    @property
    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{self.port}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            device=self.device,
            dtype=self.dtype,
            attn_backend=self.attn_backend,
            block_size=self.block_size,
            num_blocks=self.num_blocks or None,
            kv_cache_memory_bytes=self.kv_cache_memory_mb * 2**20,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len or None,
            enable_prefix_caching=self.enable_prefix_caching,
            hash_algorithm=self.hash_algorithm,
            hash_seed=self.hash_seed,
            cpu_offload_blocks=self.cpu_offload_blocks,
            seed=self.seed,
            torch_threads=self.torch_threads or None,
            enforce_eager=self.enforce_eager,
        )
