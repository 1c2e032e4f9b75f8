"""The router process's settings: ``kvroute router --flag`` or ``KVROUTE_FLAG`` (kvroute.settings)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from kvroute.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_SEED, HASH_ALGORITHMS
from kvroute.settings import setting
from kvroute.shared_settings import RedisSettings, ServingSettings
from router.policies.registry import POLICY_NAMES
from router.weights import ScoringWeights


@dataclass(frozen=True)
class RouterSettings(ScoringWeights, RedisSettings, ServingSettings):
    """Every setting of one router process (flags override ``KVROUTE_*`` variables): the cost
    model's weights (inherited from ``ScoringWeights``, declared there once) and the rest."""

    host: str = setting("127.0.0.1", "gRPC listen address")
    port: int = setting(50050, "gRPC port (0 = pick a free one)")
    router_id: str = setting("", "unique id among routers (default hostname-port)")
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis holding the replicas' events and heartbeats")
    discovery: str = setting("redis", "how replicas are found", choices=("static", "redis", "kubernetes"))
    replicas: str = setting("", "static discovery: comma-separated host:port list")
    k8s_namespace: str = setting("default", "kubernetes discovery: namespace of the replica Service")
    k8s_service: str = setting("kvroute-replica", "kubernetes discovery: the replica Service name")
    k8s_port_name: str = setting("grpc", "kubernetes discovery: the EndpointSlice port name")
    model: str = setting("", "model folder whose tokenizer.json / tokenizer_config.json the router uses"
                             " (default: the generated default model)")
    model_cache_dir: str = setting("", "where the default model lives (default ~/.cache/kvroute/models)")
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "KV block size; replicas with another one are not routable")
    hash_algorithm: str = setting("sha256_cbor", "block hash algorithm", choices=HASH_ALGORITHMS)
    hash_seed: str = setting(DEFAULT_SEED, "block hash seed (must match the replicas')")
    policy: str = setting("kvroute", "routing policy", choices=POLICY_NAMES)
    seed: int = setting(-1, "seed of the tie-breaking generator (-1 = random)")
    speculative_ttl: float = setting(2.0, "seconds a speculative index entry lives (0 = off)")
    heartbeat_poll_interval: float = setting(0.5, "seconds between heartbeat scans")
    load_sync_interval: float = setting(
        0.2, "seconds between exchanges of in-flight load and speculative entries with the other routers"
             " (a change reaches them within two of these)"
    )
    max_retries: int = setting(2, "other replicas tried when one fails before the first token")
    replica_tls_ca_file: str = setting("", "CA bundle (PEM) that verifies the replicas: set = TLS to replicas")
    replica_tls_cert_file: str = setting("", "client certificate chain (PEM) shown to replicas that require mTLS")
    replica_tls_key_file: str = setting("", "client private key (PEM) for replica_tls_cert_file")
    replica_tls_server_name: str = setting(
        "", "name every replica certificate is checked against instead of the address dialed"
            " (e.g. a wildcard or Service name; default: the address's host)"
    )
    admin_token: str = setting("", "bearer token RouterService.SetPolicy requires (empty = SetPolicy off)", secret=True)
    admin_token_file: str = setting("", "file whose first line is the admin token")
    picker_port: int = setting(
        -1, "endpoint picker (Envoy ext_proc, the Gateway API Inference Extension's EPP) port"
            " (-1 = off, 0 = pick a free one; EPPs conventionally use 9002)"
    )
    picker_streams: int = setting(
        1024, "endpoint picker: calls in flight through the gateway, one thread each for as long as the call;"
              " past it a call is refused at once with RESOURCE_EXHAUSTED (HTTP 429) naming the limit"
    )
    picker_fallbacks: int = setting(
        0, "endpoint picker: next-best endpoints listed after the pick (0 for Envoy's ORIGINAL_DST, which takes one)"
    )

    @property
    def resolved_router_id(self) -> str:
        return self.router_id or f"{socket.gethostname()}-{self.port}"
