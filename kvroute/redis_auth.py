"""The Redis connection options both sides pass to ``redis.Redis.from_url``: AUTH and TLS.

``redis_auth(password, ca_file)`` is the one place that turns the ``redis_password`` and
``redis_ca_file`` settings into keyword arguments; the password never appears in a URL, a log line
or a repr of ours (the URL stays password-free, so logging it is safe).
"""

from __future__ import annotations

from typing import Any


def redis_auth(password: str = "", ca_file: str = "") -> dict[str, Any]:
    """Keyword arguments of ``redis.Redis.from_url``: ``password`` (None when empty: the URL's own,
    if any) and, with ``ca_file``, ``ssl_ca_certs`` (meaningful for ``rediss://`` URLs only)."""
    options: dict[str, Any] = {"password": password or None}
    if ca_file:
        options["ssl_ca_certs"] = ca_file
    return options


__all__ = ["redis_auth"]
