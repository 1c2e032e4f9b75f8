"""``kvroute bridge`` settings: ``--flag`` or ``KVROUTE_FLAG`` (kvroute.settings). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_SEED, HASH_ALGORITHMS
from kvroute.redis_layout import DEFAULT_NAMESPACE
from kvroute.settings import setting


@dataclass(frozen=True)
class BridgeSettings:
    """Every setting of one bridge beside one vLLM server (flags override ``KVROUTE_*`` variables)."""

    vllm_url: str = setting("http://127.0.0.1:8000", "the vLLM server's OpenAI API base URL")
    kv_events: str = setting("tcp://127.0.0.1:5557", "vLLM's ZMQ KV events endpoint (its PUB socket)")
    kv_replay: str = setting("", "vLLM's ZMQ replay endpoint (its ROUTER socket; empty = no gap filling)")
    kv_topic: str = setting("", "the topic vLLM publishes under (its kv-events-config topic)")
    advertise_address: str = setting("", "host:port routers send requests to (default: vllm_url's)")
    model: str = setting("", "the model folder vLLM serves (the router's tokenizer); its name must be vLLM's")
    served_model_name: str = setting("", "the model name vLLM serves (default: the model folder's name)")
    replica_id: str = setting("", "unique id in the cluster (default vllm-<host>-<port>)")
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "KV block size: vLLM's --block-size and the router's")
    hash_algorithm: str = setting("sha256_cbor", "kvroute's block hash algorithm", choices=HASH_ALGORITHMS)
    hash_seed: str = setting(DEFAULT_SEED, "kvroute's block hash seed (the router's)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis for KV events and heartbeats")
    redis_password: str = setting("", "Redis AUTH password (better from env KVROUTE_REDIS_PASSWORD)", secret=True)
    redis_password_file: str = setting("", "file whose first line is the Redis AUTH password")
    redis_ca_file: str = setting("", "CA bundle that signed the Redis server certificate (rediss:// URLs)")
    redis_cluster: bool = setting(False, "redis_url is a seed node of a Redis Cluster (or Valkey cluster);"
                                         " a comma-separated redis_url of several seeds implies it")
    namespace: str = setting(DEFAULT_NAMESPACE, "Redis key namespace of the cluster")
    event_shards: int = setting(1, "number of event streams the cluster shards over")
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats (and reads of vLLM's /metrics)")
    heartbeat_ttl: float = setting(0.0, "seconds the heartbeat key lives (0 = 3 heartbeats)")
    snapshot_interval: float = setting(30.0, "seconds between snapshots of the blocks vLLM holds")
    replay_timeout: float = setting(5.0, "seconds to wait for vLLM's replay before starting a new epoch")
    max_waiting: int = setting(0, "vLLM's waiting-queue bound, if one is set in front of it (0 = none)")


__all__ = ["BridgeSettings"]
