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
        self._window = window
        self._decode: deque[tuple[int, float]] = deque()  # (D, t)
        self._prefill: deque[tuple[int, int, float]] = deque()  # (P, D, t)
        # Running sums over the two rings (ints exact; the float sums drift by rounding only).
        self._d_n = self._d_sum = self._d_sq = 0
        self._d_t = self._d_dt = 0.0
        self._p_tokens = self._p_seqs = 0
        self._p_t = 0.0
        self._rates: StepRates | None = StepRates()

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One step that ran the model: ``prefill_tokens`` prompt tokens computed, ``decode_seqs``
        sequences decoded, ``seconds`` of wall time. Steps with a small prefill, or nothing, are
        not samples. O(1)."""
        if prefill_tokens >= self.min_prefill_tokens:
            self._prefill.append((prefill_tokens, decode_seqs, seconds))
            self._add_prefill(prefill_tokens, decode_seqs, seconds, 1)
            if len(self._prefill) > self._window:
                self._add_prefill(*self._prefill.popleft(), -1)
        elif prefill_tokens == 0 and decode_seqs > 0:
            self._decode.append((decode_seqs, seconds))
            self._add_decode(decode_seqs, seconds, 1)
            if len(self._decode) > self._window:
                self._add_decode(*self._decode.popleft(), -1)
        else:
            return
        self._rates = None

    def _add_prefill(self, p: int, d: int, t: float, sign: int) -> None:
        self._p_tokens += sign * p
        self._p_seqs += sign * d
        self._p_t += sign * t

    def _add_decode(self, d: int, t: float, sign: int) -> None:
        self._d_n += sign
        self._d_sum += sign * d
        self._d_sq += sign * d * d
        self._d_t += sign * t
        self._d_dt += sign * d * t

    @property
    def rates(self) -> StepRates:
        """The rates as of the last sample (computed when first asked for after it)."""
        if self._rates is None:
            self._rates = self._compute()
        return self._rates

    def _compute(self) -> StepRates:
        n = self._d_n
        var = n * self._d_sq - self._d_sum * self._d_sum  # n^2 x the variance of D, exact
        slope = max((n * self._d_dt - self._d_sum * self._d_t) / var, 0.0) if n >= 2 and var > 0 else 0.0
        prefill_s = self._p_t - self._p_seqs * slope
        rate = self._p_tokens / prefill_s if self._p_tokens and prefill_s > 0 else 0.0
        return StepRates(prefill_tokens_per_s=rate, decode_seconds_per_running=slope)


__all__ = ["StepRates", "StepTimer"]
