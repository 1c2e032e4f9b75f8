"""The model limits the router checks a request against before it routes it (DESIGN.md §5).

The check is the replica's own (:func:`kvroute.sampling.validate_request`); only its inputs come
from here: the ``vocab_size`` and ``max_model_len`` each replica reports in ``GetModelInfo``, the
largest of those known (a request no replica can hold is refused before anything is routed; one
that only some replicas can hold is the pick's to refuse), else the model folder's (the router's
tokenizer and ``config.json``) until a replica has answered. No I/O here: the proxy asks replicas
and hands their answers to :meth:`ModelLimits.learn`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.v1 import generation_pb2 as gen_pb

UNBOUNDED = 2**63 - 1  # a model folder without max_position_embeddings: the replicas' limit applies


class ModelLimits:
    """``current``: (vocab_size, max_model_len) to validate with. Owns ``address -> limits`` of the
    replicas that answered GetModelInfo and the addresses being asked now. Event-loop thread only.

    Args:
        vocab_size: the model folder's vocab_size (the fallback).
        max_model_len: the model folder's max_position_embeddings (0: unknown, no length check
            until a replica answers).
    """

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self._fallback = (vocab_size, max_model_len or UNBOUNDED)
        self._known: dict[str, tuple[int, int]] = {}
        self._asking: set[str] = set()
        self.current = self._fallback

    def missing(self, addresses: Iterable[str]) -> list[str]:
        """The addresses whose limits are neither known nor being asked; marks them as asked."""
        new = [a for a in addresses if a and a not in self._known and a not in self._asking]
        self._asking.update(new)
        return new

    def learn(self, address: str, info: gen_pb.ModelInfo | None) -> None:
        """A replica's GetModelInfo answer (None: the call failed; it is asked again later)."""
        self._asking.discard(address)
        if info is not None and info.vocab_size > 0 and info.max_model_len > 0:
            self._known[address] = (info.vocab_size, info.max_model_len)
            self._update()

    def forget(self, live: Iterable[str]) -> None:
        """Drop the limits of addresses no longer in ``live`` (replicas gone)."""
        live = set(live)
        for address in [a for a in self._known if a not in live]:
            del self._known[address]
        self._update()

    def _update(self) -> None:
        if not self._known:
            self.current = self._fallback
            return
        self.current = (max(v for v, _ in self._known.values()), max(n for _, n in self._known.values()))


__all__ = ["ModelLimits"]
