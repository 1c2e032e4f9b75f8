"""``kvroute bench``'s flags as one checked value (``kvroute bench --help``), and how they pace
the requests (``mode``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvroute.counted import counted
from kvroute_tools.trace import BUNDLED_TRACE

PROMPT_LENGTHS = ("input_length", "hash_ids")
"""``--prompt-length``: the trace's ``input_length`` scaled, or every hash id a whole block."""


@dataclass(frozen=True)
class BenchConfig:
    """``kvroute bench`` flags (see ``kvroute bench --help``)."""

    target: str  # a router's host:port, or several comma-separated: the requests take turns among them
    trace: str = str(BUNDLED_TRACE)
    requests: int | None = 1000
    tokens_per_block: int = 16
    prompt_length: str = "input_length"  # "hash_ids": len(hash_ids) x tokens_per_block (TraceTokenizer.whole_blocks)
    output_scale: float = 0.02
    max_output_tokens: int = 256
    time_scale: float | None = None
    concurrency: int | None = None
    policies: tuple[str, ...] = ("kvroute", "round_robin")
    interleave: int = 0  # policies take turns every N requests (0: each runs the whole trace in turn)
    out: str | None = None
    request_timeout: float = 300.0
    progress: bool = True
    api: str = "grpc"  # "openai": the requests go through http_url's OpenAI-compatible API
    http_url: str = ""  # with api="openai": http://host:port/v1 (the router's HTTP API)
    admin_token: str = field(default="", repr=False)  # the router's admin token (SetPolicy); from --admin-token-file

    def __post_init__(self) -> None:
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests: must be >= 1, got {self.requests}")
        if self.tokens_per_block < 1:
            raise ValueError(f"--tokens-per-block: must be >= 1, got {self.tokens_per_block}")
        if self.prompt_length not in PROMPT_LENGTHS:
            raise ValueError(f"--prompt-length: expected one of {', '.join(PROMPT_LENGTHS)}, got {self.prompt_length!r}")
        if not (self.output_scale > 0 and math.isfinite(self.output_scale)):
            raise ValueError(f"--output-scale: must be > 0, got {self.output_scale}")
        if self.max_output_tokens < 1:
            raise ValueError(f"--max-output-tokens: must be >= 1, got {self.max_output_tokens}")
        if self.time_scale is not None and not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale: must be >= 0, got {self.time_scale}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency: must be >= 1, got {self.concurrency}")
        if not self.policies or any(not p for p in self.policies):
            raise ValueError(f"--policies: expected comma-separated policy names, got {','.join(self.policies)!r}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies: a policy is listed twice ({','.join(self.policies)})")
        from router.policies.registry import POLICY_NAMES  # here: the bench's modules import no router

        for name in self.policies:
            if name not in POLICY_NAMES:
                raise ValueError(f"--policies: unknown {name!r}; expected some of {', '.join(POLICY_NAMES)}")
        if self.interleave < 0:
            raise ValueError(f"--interleave: must be >= 0, got {self.interleave}")
        if self.api not in ("grpc", "openai"):
            raise ValueError(f"--api: expected grpc or openai, got {self.api!r}")
        if len(set(self.targets)) != len(self.targets) or not all(self.targets):
            raise ValueError(f"--target: expected HOST:PORT or a comma-separated list of distinct ones, got {self.target!r}")
        if self.api == "openai" and len(self.targets) > 1:
            raise ValueError("--target: --api openai sends every request to --http-url; several routers need --api grpc")
        if self.api == "openai" and not self.http_url.startswith(("http://", "https://")):
            raise ValueError(f"--http-url: --api openai needs the HTTP API's URL (http://host:port/v1), got {self.http_url!r}")
        if self.request_timeout <= 0:
            raise ValueError(f"--request-timeout: must be > 0, got {self.request_timeout}")

    @property
    def targets(self) -> list[str]:
        """The routers, in the order the requests take turns among them (request i goes to
        ``targets[i % len(targets)]``)."""
        return [t.strip() for t in self.target.split(",")]

    @property
    def mode(self) -> str:
        """How requests are released: the trace's clock (open loop) and/or a concurrency cap."""
        turns = f"; policies take turns every {counted(self.interleave, 'request')}" if self.interleave else ""
        if len(self.targets) > 1:
            turns += f"; requests take turns among {counted(len(self.targets), 'router')}"
        turns += f"; over the OpenAI-compatible API at {self.http_url}" if self.api == "openai" else ""
        if self.time_scale is None:
            return f"closed loop, concurrency {self.effective_concurrency}{turns}"
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        return f"open loop, trace timestamps x {self.time_scale:g}{cap}{turns}"

    @property
    def effective_concurrency(self) -> int | None:
        if self.time_scale is None:
            return self.concurrency or 8
        return self.concurrency


__all__ = ["PROMPT_LENGTHS", "BenchConfig"]
