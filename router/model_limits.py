"""The model limits the router checks a request against before it routes it (DESIGN.md §5).

The check is the replica's own (the prompt's token ids against the vocabulary, then
:func:`kvroute.sampling.validate_request`); only its inputs come from here::

    heartbeats ─▶ ReplicaRegistry: ReplicaInfo.vocab_size / max_model_len (0: the heartbeat does not say)
                    └─ ReportedLimits.of(the routable replicas), rebuilt with the routable set
    a request  ─▶ ReportedLimits.resolve(the model folder's limits) ─▶ (vocab_size, max_model_len)

The rule, per limit: the largest a routable replica can take, a replica whose heartbeat does not
say (one older than these fields) counting as the model folder's (the router's tokenizer and
``config.json``); the folder's when no replica is routable. So a request is refused before
anything is routed only when no routable replica could take it. One that only some replicas can
hold is routed like any other, and refused by the pick's own check if the pick cannot hold it
(INVALID_ARGUMENT, passed through unchanged): the router does not steer by limits. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

UNBOUNDED = 2**63 - 1  # a model folder without max_position_embeddings: no length check of the router's own


@dataclass(frozen=True)
class ReportedLimits:
    """What the routable replicas' heartbeats say of the model limits, per limit: the largest value
    reported (0: none reports one) and whether some routable replica does not report it (also True
    when no replica is routable)."""

    vocab_size: int = 0
    max_model_len: int = 0
    vocab_size_unsaid: bool = True
    max_model_len_unsaid: bool = True

    @classmethod
    def of(cls, limits: Iterable[tuple[int, int]]) -> ReportedLimits:
        """From each routable replica's ``(vocab_size, max_model_len)``, 0 (or less) where it does not say."""
        pairs = list(limits)
        vocabs = [v for v, _ in pairs if v > 0]
        lengths = [n for _, n in pairs if n > 0]
        return cls(
            vocab_size=max(vocabs, default=0), max_model_len=max(lengths, default=0),
            vocab_size_unsaid=not pairs or len(vocabs) < len(pairs),
            max_model_len_unsaid=not pairs or len(lengths) < len(pairs),
        )

    def resolve(self, fallback: tuple[int, int]) -> tuple[int, int]:
        """``(vocab_size, max_model_len)`` to validate with (the module's rule), ``fallback`` being
        the model folder's (``UNBOUNDED`` for a length it does not give)."""
        vocab_size, max_model_len = fallback
        return (
            max(self.vocab_size, vocab_size) if self.vocab_size_unsaid else self.vocab_size,
            max(self.max_model_len, max_model_len) if self.max_model_len_unsaid else self.max_model_len,
        )


__all__ = ["UNBOUNDED", "ReportedLimits"]
