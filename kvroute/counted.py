"""A count and its noun for messages: ``counted(1, "request")`` is ``1 request``, any other count
takes the plural. Every message that shows a count of something is formed with it."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None, *, spec: str = "") -> str:
    """``n`` formatted with ``spec`` (a format spec: ``","`` groups thousands), then ``noun`` when
    ``n == 1``, else ``plural`` (default ``noun + "s"``)."""
    return f"{n:{spec}} {noun if n == 1 else (plural or noun + 's')}"
