"""The one way a kvroute process or tool connects to Redis: URL + credentials -> a redis-py client
(DESIGN.md §4, docs/security.md).

    settings (redis_url, redis_cluster, redis_password | redis_password_file, redis_ca_file)
        ──RedisAuth.from_settings──▶ RedisAuth ──connect(url, auth)──▶ redis.Redis | RedisCluster
                                                   (publisher, consumer, load sync, kvroute up)

A password comes from the setting ``redis_password`` (env ``KVROUTE_REDIS_PASSWORD``), from the
file ``redis_password_file`` (its first line), or from the URL itself (``redis://:pw@host``; the
URL's wins, as in redis-py). It is never part of a repr, and :func:`redact` takes it out of a URL
before the URL is logged or put into an error. ``rediss://`` URLs use TLS; ``redis_ca_file`` is
the CA bundle that verifies the server (the system's when empty).

A Redis Cluster (or Valkey cluster): ``redis_cluster`` set, or a comma-separated ``redis_url`` of
seed nodes (``redis://a:7000,redis://b:7000``; the scheme and credentials of the first serve them
all), makes :func:`connect` return redis-py's ``redis.cluster.RedisCluster`` with the same options.
The key layout is the same either way (kvroute.redis_layout: one hash slot per event shard).
``LOST_REDIS_ERRORS`` are the errors that mean Redis, or a node of the cluster, is gone or
failing over: a caller backs off and reconnects, as after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from kvroute.settings import secret_from

if TYPE_CHECKING:  # redis-py is imported on first connect: `kvroute up` and the CLI start without it
    import redis


@dataclass(frozen=True)
class RedisAuth:
    """How to reach the cluster's Redis beyond its URL: credentials, TLS, single or cluster.

    Attributes:
        password: the AUTH password (None = none); left out of ``repr``.
        ca_file: CA bundle (PEM path) that verifies a ``rediss://`` server; "" = the system's.
        cluster: the URL names a Redis Cluster (a comma-separated URL implies it).
    """

    password: str | None = field(default=None, repr=False)
    ca_file: str = ""
    cluster: bool = False

    @classmethod
    def from_settings(cls, settings: Any) -> RedisAuth:
        """From a process's settings (``redis_password``, ``redis_password_file``, ``redis_ca_file``,
        ``redis_cluster``).

        Raises:
            ValueError: both a password and a password file are set, or the file cannot be read
                or is empty (the message names the setting, never the password).
        """
        return cls(password=secret_from(settings, "redis_password"), ca_file=settings.redis_ca_file,
                   cluster=settings.redis_cluster)


def seed_urls(url: str) -> list[str]:
    """The URLs of a comma-separated ``redis_url`` (one for a plain one)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def is_cluster(url: str, auth: RedisAuth | None) -> bool:
    """Whether :func:`connect` makes a Redis Cluster client of ``url`` and ``auth``."""
    return bool(auth and auth.cluster) or len(seed_urls(url)) > 1


def redact(url: str) -> str:
    """``url`` (each URL of a comma-separated list) with the password of its userinfo replaced by
    ``***``; safe to log."""
    if "," in url:
        return ",".join(redact(u) for u in seed_urls(url))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(url: str, auth: RedisAuth | None = None, **options: Any) -> redis.Redis:
    """A client of ``url`` with ``auth``; ``options`` go to redis-py (``socket_timeout``, ``retry``,
    ...). A plain client connects lazily; a cluster client (``auth.cluster``, or several URLs)
    reads the slot map from a seed at once.

    Raises:
        ValueError: ``url`` is not a redis://, rediss:// or unix:// URL, or a cluster seed is not
            redis:// or rediss:// like the first (the message names redis_url, without the password).
        redis.ConnectionError: a cluster none of whose seeds answered, or one that is not a cluster.
    """
    import redis

    auth = auth or RedisAuth()
    kwargs: dict[str, Any] = dict(options)
    if auth.password is not None:
        kwargs["password"] = auth.password
    seeds = seed_urls(url)
    if seeds and seeds[0].startswith("rediss://") and auth.ca_file:
        kwargs["ssl_ca_certs"] = auth.ca_file
    if is_cluster(url, auth):
        return _connect_cluster(url, seeds, kwargs)
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as e:
        raise ValueError(f"redis_url {redact(url)}: {e}") from e


def _connect_cluster(url: str, seeds: list[str], kwargs: dict[str, Any]) -> redis.Redis:
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException

    if not seeds:
        raise ValueError("redis_url: a Redis Cluster needs the URL of a seed node")
    scheme = urlsplit(seeds[0]).scheme
    nodes = []
    for seed in seeds:
        parts = urlsplit(seed)
        if parts.scheme not in ("redis", "rediss") or parts.scheme != scheme or not parts.hostname:
            raise ValueError(f"redis_url {redact(url)}: every seed of a Redis Cluster must be a "
                             f"{scheme if scheme in ('redis', 'rediss') else 'redis'}:// URL with a host, "
                             f"got {redact(seed)!r}")
        nodes.append(ClusterNode(parts.hostname, parts.port or 6379))
    try:
        return RedisCluster(url=seeds[0], startup_nodes=nodes[1:], **kwargs)
    except RedisClusterException as e:  # not a RedisError: the callers' "unreachable" is
        raise redis.ConnectionError(f"Redis Cluster: {e}") from e
    except ValueError as e:
        raise ValueError(f"redis_url {redact(url)}: {e}") from e


def ping(client: redis.Redis) -> None:
    """PING ``client``'s Redis; of a cluster, also that the node answering says the cluster is up
    (one whose master failed answers PING until a replica takes over, and refuses every key).

    Raises:
        LOST_REDIS_ERRORS: Redis, or the cluster, is not up.
    """
    from redis.cluster import RedisCluster
    from redis.exceptions import ClusterDownError

    client.ping()
    if isinstance(client, RedisCluster) and (state := client.cluster_info().get("cluster_state")) != "ok":
        raise ClusterDownError(f"cluster_state {state}")


def describe_error(url: str, error: BaseException) -> str:
    """One line for a failed Redis call on ``url``: the redacted URL, the error, and for an AUTH
    refusal what to set (``redis_password`` / ``redis_password_file``)."""
    import redis

    text = str(error)
    if isinstance(error, redis.AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        text = (f"authentication failed ({error}); "
                "set redis_password (KVROUTE_REDIS_PASSWORD) or redis_password_file")
    return f"redis_url {redact(url)}: {text}"


def _lost_redis_errors() -> tuple[type[BaseException], ...]:
    import redis
    from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError

    # ClusterDownError, TryAgainError and AskError (MOVED too) are ResponseErrors, which otherwise
    # mean a refused command; RedisClusterException (no node for a slot, none reachable) is not
    # even a RedisError.
    return (redis.ConnectionError, redis.TimeoutError, OSError, ClusterDownError, TryAgainError, AskError,
            RedisClusterException)


def __getattr__(name: str) -> Any:  # LOST_REDIS_ERRORS, without importing redis-py with this module
    if name == "LOST_REDIS_ERRORS":
        return _lost_redis_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RedisAuth", "connect", "describe_error", "is_cluster", "ping", "redact", "seed_urls"]
