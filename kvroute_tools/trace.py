"""Mooncake-format block traces: loading, turning hash ids into tokens, and hit-rate bounds.

A Mooncake trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
[...]}`` where each id stands for one 512-token block *together with every block before it*
(prefix-chained), so equal ids mean a reusable KV prefix (DESIGN.md §7). To replay such a trace
through a real engine, each hash id becomes a fixed pseudo-random block of ``tokens_per_block``
tokens (seeded by the id), and the prompt is cut to the input length scaled by the same factor;
or, with ``whole_blocks``, every id (the partial last one too) stays a whole block, so a prompt is
``len(hash_ids) x tokens_per_block`` tokens: the mapping of the
harness with which sglang-router and vllm-router were measured (docs/results.md).

The bounds computed from the ids alone, in prompt tokens: ``ideal`` is one infinite cache that has
seen every earlier request; ``round robin over K`` deals requests to K infinite caches in turn.
A request hits the leading run of ids its cache has seen, weighted ``min(k * block, input_length)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported on first use: the CLI's flag parsers read this module's constants
    import numpy as np

TRACE_BLOCK_TOKENS = 512  # the block size the Mooncake FAST'25 hash ids were computed with
BUNDLED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_fast25_conversation_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    """One trace line. ``timestamp_ms`` is relative to the start of the trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path = BUNDLED_TRACE, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines) in file order, at most ``limit`` requests.

    Raises:
        ValueError: a line is not valid JSON or lacks a field (the message names the line number).
    """
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(
                    TraceRequest(
                        float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]), tuple(d["hash_ids"])
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({e})") from e
    return out


class TraceTokenizer:
    """Maps hash ids to fixed pseudo-random token blocks (equal ids -> equal tokens).

    Args:
        tokens_per_block: tokens standing for one 512-token trace block.
        vocab_size: ids are drawn from [low, vocab_size).
        low: smallest id drawn (keep special tokens out).
        seed: mixes into every block's generator, so different seeds give unrelated prompts.
        whole_blocks: prompts of ``len(hash_ids) * tokens_per_block`` tokens (``input_length``
            unused), instead of ``input_length`` scaled (module docstring).
    """

    def __init__(self, tokens_per_block: int = TRACE_BLOCK_TOKENS, vocab_size: int = 32000, low: int = 0, seed: int = 0,
                 whole_blocks: bool = False):
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: must be >= 1, got {tokens_per_block}")
        if not 0 <= low < vocab_size:
            raise ValueError(f"vocab_size: must exceed low={low}, got {vocab_size}")
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.low = low
        self.seed = seed
        self.whole_blocks = whole_blocks
        self._cache: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        """The token block of ``hash_id`` (int64, shape [tokens_per_block])."""
        blk = self._cache.get(hash_id)
        if blk is None:
            import numpy as np

            rng = np.random.default_rng([self.seed, hash_id])
            blk = rng.integers(self.low, self.vocab_size, self.tokens_per_block, dtype=np.int64)
            self._cache[hash_id] = blk
        return blk

    def prompt_len(self, req: TraceRequest) -> int:
        """The prompt length: ``len(hash_ids) * tokens_per_block`` with ``whole_blocks``, else the
        scaled input length ``input_length * tokens_per_block / 512``, at least 1 and at most that."""
        full = len(req.hash_ids) * self.tokens_per_block
        if self.whole_blocks:
            return full
        return max(1, min(full, round(req.input_length * self.tokens_per_block / TRACE_BLOCK_TOKENS)))

    def token_ids(self, req: TraceRequest) -> list[int]:
        """The request's prompt token ids."""
        if not req.hash_ids:
            raise ValueError("hash_ids: empty")
        import numpy as np

        toks = np.concatenate([self.block(h) for h in req.hash_ids])
        return toks[: self.prompt_len(req)].tolist()


def leading_seen(hash_ids: Sequence[int], seen: set[int]) -> int:
    """How many of ``hash_ids``, from the first, are in ``seen`` (the prefix a cache holds)."""
    k = 0
    for h in hash_ids:
        if h not in seen:
            break
        k += 1
    return k


def hit_rate_bounds(requests: Iterable[TraceRequest], replicas: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> dict:
    """Prompt-token hit rates of one infinite cache (``ideal``) and of round robin over ``replicas``
    infinite caches (``round_robin``), computed from the hash ids alone (see module docstring).

    In tokens, as the replicas measure their hit rate: a request's hit is its leading seen hash ids
    times ``block_tokens``, capped at its ``input_length`` (its last hash id covers a partial
    block), so the bounds differ slightly from hit ids / all ids.

    Returns:
        ``{"prompt_tokens": int, "ideal": float, "round_robin": float}``, the rates in 0..1."""
    ideal_seen: set[int] = set()
    rr_seen: list[set[int]] = [set() for _ in range(replicas)]
    total = ideal_hit = rr_hit = 0
    for i, req in enumerate(requests):
        total += req.input_length
        ideal_hit += min(leading_seen(req.hash_ids, ideal_seen) * block_tokens, req.input_length)
        cache = rr_seen[i % replicas]
        rr_hit += min(leading_seen(req.hash_ids, cache) * block_tokens, req.input_length)
        ideal_seen.update(req.hash_ids)
        cache.update(req.hash_ids)
    return {
        "prompt_tokens": total,
        "ideal": ideal_hit / total if total else 0.0,
        "round_robin": rr_hit / total if total else 0.0,
    }
