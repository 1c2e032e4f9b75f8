"""The captured vLLM KV event files of tests/data/vllm_events, read back as frames and records."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm_events"
VARIANTS = ("int", "bytes")


@dataclass(frozen=True)
class Capture:
    """One capture file: its meta line, the live PUB messages in arrival order, the completion
    calls (each with ``live_frames``: live messages received once its events had settled), and the
    replay requests with their replies."""

    meta: dict
    live: list[list[bytes]]
    requests: list[dict]
    reset: dict
    replays: list[dict]

    def request(self, name: str) -> dict:
        return next(r for r in self.requests if r["name"] == name)

    def frames_before(self, name: str) -> int:
        """Live messages received before call ``name`` was sent."""
        i = self.requests.index(self.request(name))
        return self.requests[i - 1]["live_frames"] if i else 0


def _frames(encoded: list[str]) -> list[bytes]:
    return [base64.b64decode(f) for f in encoded]


def load(variant: str) -> Capture:
    lines = [json.loads(line) for line in (DATA / f"{variant}_hashes.jsonl").read_text().splitlines()]
    by_kind: dict[str, list[dict]] = {}
    for rec in lines:
        by_kind.setdefault(rec["kind"], []).append(rec)
    replays = [{**r, "request": _frames(r["request"]), "replies": [_frames(m) for m in r["replies"]]}
               for r in by_kind["replay"]]
    return Capture(meta=by_kind["meta"][0], live=[_frames(r["frames"]) for r in by_kind["frame"]],
                   requests=by_kind["request"], reset=by_kind["reset"][0], replays=replays)
