"""The one way a kvroute process or tool connects to Redis: URL + credentials -> ``redis.Redis``
(DESIGN.md §4, docs/security.md).

    settings (redis_url, redis_password | redis_password_file, redis_ca_file)
        ──RedisAuth.from_settings──▶ RedisAuth ──connect(url, auth)──▶ redis.Redis
                                                   (publisher, consumer, load sync, kvroute up)

A password comes from the setting ``redis_password`` (env ``KVROUTE_REDIS_PASSWORD``), from the
file ``redis_password_file`` (its first line), or from the URL itself (``redis://:pw@host``; the
URL's wins, as in redis-py). It is never part of a repr, and :func:`redact` takes it out of a URL
before the URL is logged or put into an error. ``rediss://`` URLs use TLS; ``redis_ca_file`` is
the CA bundle that verifies the server (the system's when empty).
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
    """Credentials for a Redis connection.

    Attributes:
        password: the AUTH password (None = none); left out of ``repr``.
        ca_file: CA bundle (PEM path) that verifies a ``rediss://`` server; "" = the system's.
    """

    password: str | None = field(default=None, repr=False)
    ca_file: str = ""

    @classmethod
    def from_settings(cls, settings: Any) -> RedisAuth:
        """From a process's settings (``redis_password``, ``redis_password_file``, ``redis_ca_file``).

        Raises:
            ValueError: both a password and a password file are set, or the file cannot be read
                or is empty (the message names the setting, never the password).
        """
        return cls(password=secret_from(settings, "redis_password"), ca_file=settings.redis_ca_file)


def redact(url: str) -> str:
    """``url`` with the password of its userinfo (if any) replaced by ``***``; safe to log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect(url: str, auth: RedisAuth | None = None, **options: Any) -> redis.Redis:
    """A (lazily connecting) client of ``url`` with ``auth``; ``options`` go to redis-py
    (``socket_timeout``, ``retry``, ...).

    Raises:
        ValueError: ``url`` is not a redis://, rediss:// or unix:// URL (the message names redis_url,
            without the password).
    """
    import redis

    auth = auth or RedisAuth()
    kwargs: dict[str, Any] = dict(options)
    if auth.password is not None:
        kwargs["password"] = auth.password
    if url.startswith("rediss://") and auth.ca_file:
        kwargs["ssl_ca_certs"] = auth.ca_file
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as e:
        raise ValueError(f"redis_url {redact(url)}: {e}") from e


def describe_error(url: str, error: BaseException) -> str:
    """One line for a failed Redis call on ``url``: the redacted URL, the error, and for an AUTH
    refusal what to set (``redis_password`` / ``redis_password_file``)."""
    import redis

    text = str(error)
    if isinstance(error, redis.AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        text = (f"authentication failed ({error}); "
                "set redis_password (KVROUTE_REDIS_PASSWORD) or redis_password_file")
    return f"redis_url {redact(url)}: {text}"


__all__ = ["RedisAuth", "connect", "describe_error", "redact"]
