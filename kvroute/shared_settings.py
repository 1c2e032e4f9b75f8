"""The settings the router and the replica share, declared once (kvroute.settings builds the
flags and ``KVROUTE_*`` variables of each field): how a process reaches Redis, and how it serves
(HTTP and metrics ports, TLS). ``RouterSettings`` and ``ReplicaSettings`` inherit both."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.redis_layout import DEFAULT_NAMESPACE
from kvroute.settings import setting
from kvroute.tls import ServerTlsFiles, server_tls_files


@dataclass(frozen=True)
class RedisSettings:
    """Credentials and key layout of the cluster's Redis (kvroute.redis_connect, kvroute.redis_layout);
    ``redis_url`` itself is each process's own (the replica's may be empty: publish nothing)."""

    redis_password: str = setting(
        "", "Redis AUTH password (better from env KVROUTE_REDIS_PASSWORD; never logged)", secret=True
    )
    redis_password_file: str = setting("", "file whose first line is the Redis AUTH password")
    redis_ca_file: str = setting("", "CA bundle that signed the Redis server certificate (rediss:// URLs)")
    redis_cluster: bool = setting(False, "redis_url is a seed node of a Redis Cluster (or Valkey cluster);"
                                         " a comma-separated redis_url of several seeds implies it")
    namespace: str = setting(DEFAULT_NAMESPACE, "Redis key namespace of the cluster")
    event_shards: int = setting(1, "number of event streams the cluster shards over")


@dataclass(frozen=True)
class ServingSettings:
    """The ports a process serves beside its gRPC one, and its gRPC server's TLS (kvroute.tls)."""

    http_port: int = setting(-1, "OpenAI-compatible HTTP API port (-1 = off, 0 = pick a free one)")
    metrics_port: int = setting(-1, "Prometheus scrape port (-1 = off, 0 = pick a free one)")
    metrics_host: str = setting("", "Prometheus scrape listen address (empty = the host setting's)")
    tls_cert_file: str = setting("", "gRPC server certificate chain (PEM); with tls_key_file turns TLS on")
    tls_key_file: str = setting("", "gRPC server private key (PEM)")
    tls_client_ca_file: str = setting("", "CA bundle (PEM) of client certificates: set = mutual TLS required")
    http_tls: bool = setting(False, "serve the HTTP API over TLS (https) with tls_cert_file / tls_key_file;"
                                    " tls_client_ca_file set = client certificates required")
    metrics_tls: bool = setting(False, "serve the Prometheus endpoint over TLS with the same files")

    def http_tls_files(self) -> ServerTlsFiles | None:
        """The HTTP API's TLS files (None = plain HTTP). Raises ValueError naming the settings."""
        return self._tls_files("http_tls") if self.http_tls else None

    def metrics_tls_files(self) -> ServerTlsFiles | None:
        """The metrics endpoint's TLS files (None = plain HTTP). Raises ValueError naming the settings."""
        return self._tls_files("metrics_tls") if self.metrics_tls else None

    def _tls_files(self, switch: str) -> ServerTlsFiles:
        return server_tls_files(switch, self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


__all__ = ["RedisSettings", "ServingSettings"]
