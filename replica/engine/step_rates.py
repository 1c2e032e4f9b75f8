"""A replica's measured speed: prefill throughput and the step time a running sequence adds, from
the wall time of its recent engine steps (what the heartbeat publishes for the router's cost).

Each step that ran the model is one sample ``(prefill tokens P, decode sequences D, seconds t)``;
the last ``window`` decode-only steps (P = 0) and the last ``window`` large prefill steps
(P >= ``min_prefill_tokens``) are kept, each kind in its own ring::

    decode_seconds_per_running = the slope b of  t = c + b * D   (least squares over decode-only steps)
    prefill_tokens_per_s       = sum(P) / sum(t - D * b)           (over large prefill steps)

Why a slope and not ``sum(t) / sum(D)``: a step has a fixed cost (scheduling, launches and, on a
GPU at small batches, reading the weights) that a new request pays on any replica; what a running
sequence adds to a request's time to first token is its marginal cost, the slope. Why only large
prefill steps: below the roofline's knee a few prompt tokens ride along almost for free, which
says nothing about what prefilling a queue costs; from ``min_prefill_tokens`` on, the step is
compute bound and its fixed part small. A prefill step's time is charged to its prefill after
taking out what its decodes cost at the slope. Either figure is 0 (unknown) until it can be
measured: the rate without a large prefill step (or when its decodes would take the whole step),
the slope without decode-only steps of at least two batch sizes or when it comes out negative.
Torch-free; the engine thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRates:
    """Measured speed (0 = not measured yet): prompt tokens per second of prefill, and seconds a
    running sequence adds to a step."""

    prefill_tokens_per_s: float = 0.0
    decode_seconds_per_running: float = 0.0


class StepTimer:
    """Keeps the last ``window`` decode-only and ``window`` large prefill step samples (module
    docstring) and the rates they give.

    Raises:
        ValueError: ``window`` < 2 or ``min_prefill_tokens`` < 1.
    """

    def __init__(self, window: int = 256, min_prefill_tokens: int = 256) -> None:
        if window < 2:
            raise ValueError(f"window: must be >= 2, got {window}")
        if min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens: must be >= 1, got {min_prefill_tokens}")
        self.min_prefill_tokens = min_prefill_tokens
        self._decode: deque[tuple[int, float]] = deque(maxlen=window)  # (D, t)
        self._prefill: deque[tuple[int, int, float]] = deque(maxlen=window)  # (P, D, t)
        self._rates = StepRates()

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One step that ran the model: ``prefill_tokens`` prompt tokens computed, ``decode_seqs``
        sequences decoded, ``seconds`` of wall time. Steps with a small prefill, or nothing, are
        not samples."""
        if prefill_tokens >= self.min_prefill_tokens:
            self._prefill.append((prefill_tokens, decode_seqs, seconds))
        elif prefill_tokens == 0 and decode_seqs > 0:
            self._decode.append((decode_seqs, seconds))
        else:
            return
        self._rates = self._compute()

    @property
    def rates(self) -> StepRates:
        """The rates as of the last sample."""
        return self._rates

    def _compute(self) -> StepRates:
        # O(window) per sample: a few hundred additions, small next to a step of the model.
        n = len(self._decode)
        slope = 0.0
        if n >= 2:
            mean_d = sum(d for d, _ in self._decode) / n
            mean_t = sum(t for _, t in self._decode) / n
            var = sum((d - mean_d) ** 2 for d, _ in self._decode)
            if var > 0:
                slope = max(sum((d - mean_d) * (t - mean_t) for d, t in self._decode) / var, 0.0)
        tokens = sum(p for p, _, _ in self._prefill)
        prefill_s = sum(t - d * slope for _, d, t in self._prefill)
        rate = tokens / prefill_s if tokens and prefill_s > 0 else 0.0
        return StepRates(prefill_tokens_per_s=rate, decode_seconds_per_running=slope)


__all__ = ["StepRates", "StepTimer"]
