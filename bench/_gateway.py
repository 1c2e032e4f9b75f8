"""bench/router.py's gateway sides: a real Envoy (kvroute_tools.envoy) in front of the same replica,
alone and with the router as its endpoint picker, and the router process's CPU per request.

- ``envoy``: Envoy without the ext_proc filter; the client names the replica itself in
  ``x-gateway-destination-endpoint`` (what Envoy's hop alone costs).
- ``picker``: Envoy asking the router (ext_proc) for every call, as ``kvroute up --gateway envoy`` runs it.
- ``floor`` (when ``node`` is on PATH): the same Envoy asking bench/_ext_proc_floor.js, a compiled
  HTTP/2 server (Node's nghttp2) that answers every call with the same fixed pick, no Python and no
  routing: what any endpoint picker behind this Envoy costs at least on this machine.

Router CPU: user + system seconds of the router process (``/proc/PID/stat``) over ``n`` streamed
requests sent through one side at a time, minus what the router burns meanwhile without traffic
(heartbeat polling, load sync: measured over the same requests sent to the replica direct).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvroute.responses import MD_REPLICA
from kvroute_tools.envoy import DESTINATION_HEADER, EnvoyFront
from kvroute_tools.redis_server import free_port
from router.picker import protocol

_TICKS = os.sysconf("SC_CLK_TCK")


def start_gateways(stack: contextlib.ExitStack, router_target: str, picker_target: str, replica_target: str, tmp: Path
                   ) -> tuple[dict[str, str], dict[str, tuple[tuple[str, str], ...]]]:
    """Start the Envoys (stopped by ``stack``), and the floor's server when ``node`` is on PATH:
    ({side: target}, {side: the metadata its calls carry})."""
    alone = stack.enter_context(EnvoyFront(router_target, folder=tmp / "envoy-alone"))
    picker = stack.enter_context(EnvoyFront(router_target, picker_target=picker_target, folder=tmp / "envoy-picker"))
    targets = {"envoy": alone.target, "picker": picker.target}
    if (node := shutil.which("node")) is not None:
        floor_target = start_floor_picker(stack, node, replica_target)
        # No trailers message: the fixed server answers every message alike, with a body response.
        targets["floor"] = stack.enter_context(EnvoyFront(router_target, picker_target=floor_target,
                                                          folder=tmp / "envoy-floor", trailers_percent=0)).target
    return targets, {"envoy": ((DESTINATION_HEADER, replica_target),)}


def start_floor_picker(stack: contextlib.ExitStack, node: str, replica_target: str) -> str:
    """Start bench/_ext_proc_floor.js answering every call with a pick of ``replica_target`` (the
    router's own answer for it, ``protocol.destination``); its host:port once it listens."""
    port = free_port()
    answer = protocol.destination([replica_target], routing={MD_REPLICA: "floor"}).SerializeToString()
    proc = subprocess.Popen([node, str(Path(__file__).with_name("_ext_proc_floor.js")), str(port), answer.hex()],
                            stdout=subprocess.PIPE, text=True)
    stack.callback(proc.wait, 10)
    stack.callback(proc.terminate)
    if proc.stdout is None or proc.stdout.readline().strip() != "serving":
        raise RuntimeError(f"bench/_ext_proc_floor.js did not start (exit status {proc.poll()})")
    return f"127.0.0.1:{port}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of stat(5))


def router_cpu_per_1000(pid: int, sides: dict[str, Callable[[], object]], n: int) -> dict[str, float]:
    """{side: router CPU seconds per 1,000 requests, net of its idle rate} for each side except
    ``direct``, whose run measures that idle rate. Each side's ``n`` requests run back to back."""
    spent: dict[str, tuple[float, float]] = {}
    for side, send in sides.items():
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        for _ in range(n):
            send()
        spent[side] = (cpu_seconds(pid) - c0, time.perf_counter() - t0)
    idle_cpu, idle_wall = spent.pop("direct")
    idle_rate = idle_cpu / idle_wall if idle_wall > 0 else 0.0
    return {side: max(cpu - idle_rate * wall, 0.0) * 1000 / n for side, (cpu, wall) in spent.items()}
