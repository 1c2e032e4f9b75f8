"""The timing model: how long one engine step takes, in virtual seconds.

A step runs every scheduled token through the weights once and reads the KV cache of every
scheduled request's context. With ``tokens = prefill_tokens + decode_seqs``::

    step_seconds = overhead_s + max(weights_s, tokens * token_s) + kv_tokens_read * kv_token_s

``max(...)``: the matrix multiplies are bound by reading the weights at small batches and by
compute at large ones (the roofline). ``kv_tokens_read`` is, per scheduled request, the context
its chunk attends to (computed tokens + the chunk itself).

Defaults (:data:`H100_LLAMA31_8B`): vLLM V1 serving Llama-3.1-8B in BF16 on one H100-80GB SXM,
from the published hardware figures and the model's shape rather than from a trace of ours:
989 TFLOP/s dense BF16 and 3.35 TB/s HBM3 (NVIDIA H100 datasheet), 8.03e9 parameters (16.1 GB of
weights, 2 FLOPs per parameter per token), 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes
= 128 KiB of KV per token, at the efficiencies vLLM typically reaches there (about 50% of peak
FLOP/s in prefill, 70% of peak bandwidth in decode). That gives about 30k prefill tokens/s and
an 8 ms step for one decode at a 2k context, in line with the ITL and prefill throughputs that
public vLLM benchmarks of this pairing report. Every constant is a flag of ``kvroute simulate``
(``--step-overhead-ms`` ...) or a key of a ``--calibration`` JSON file.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class TimingModel:
    """Step duration constants, in seconds (module docstring). All must be >= 0.

    Attributes:
        overhead_s: fixed cost of a step (scheduling, kernel launches, sampling).
        weights_s: reading the weights once (the floor of any step).
        token_s: compute per scheduled token (prefill or decode) once compute bound.
        kv_token_s: reading one token's K and V in every layer.
        kv_bytes_per_token / kv_budget_bytes: the deployment's KV cache, for the default capacity.
        name: where the constants come from.
    """

    overhead_s: float = 0.001
    weights_s: float = 16.06e9 / (0.7 * 3.35e12)
    token_s: float = 2 * 8.03e9 / (0.5 * 989e12)
    kv_token_s: float = 131072 / (0.7 * 3.35e12)
    kv_bytes_per_token: int = 131072
    kv_budget_bytes: int = int(0.9 * 80e9 - 16.06e9 - 2e9)
    name: str = "vLLM V1, Llama-3.1-8B BF16, one H100-80GB SXM (datasheet roofline at vLLM's typical efficiency)"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"timing model: {f.name} must be a finite number >= 0, got {v!r}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        """One step's duration in seconds (module docstring's formula)."""
        tokens = prefill_tokens + decode_seqs
        return self.overhead_s + max(self.weights_s, tokens * self.token_s) + kv_tokens_read * self.kv_token_s

    def decode_window(self, seqs: int, kv_tokens: int, steps: int) -> float:
        """Seconds of ``steps`` consecutive pure-decode steps of ``seqs`` sequences whose contexts
        hold ``kv_tokens`` tokens before the first (each step reads one more token per sequence):
        the sum of :meth:`step_seconds` over those steps, in closed form."""
        fixed = self.overhead_s + max(self.weights_s, seqs * self.token_s) + kv_tokens * self.kv_token_s
        return steps * fixed + self.kv_token_s * seqs * steps * (steps + 1) / 2

    def capacity_tokens(self, block_size: int) -> int:
        """The deployment's KV cache in tokens, rounded down to whole blocks."""
        return self.kv_budget_bytes // self.kv_bytes_per_token // block_size * block_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_file(cls, path: str | Path, base: TimingModel | None = None) -> TimingModel:
        """``base`` (default: the defaults) with the keys of a JSON calibration file replaced.

        Raises:
            ValueError: the file is not a JSON object, names an unknown key, or a value is invalid.
            OSError: the file cannot be read.
        """
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a calibration file holds one JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
        return replace(base or cls(), **data)


H100_LLAMA31_8B = TimingModel()
