"""``kvroute generate`` as a user runs it: a real process streaming from a real replica (which serves
the public GenerationService too), interrupted with Ctrl-C (SIGINT) after its first output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch")

from tests.support import thread_replica  # noqa: E402


@pytest.fixture(scope="module")
def replica(default_model_dir):
    with thread_replica(default_model_dir, "cli-replica", num_blocks=256) as r:
        yield r


def test_ctrl_c_while_streaming_prints_nothing_more_and_exits_130(replica):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute_tools", "generate", "--target", replica.target, "--max-tokens", "2000",
         "--ignore-eos", "--temperature", "0", "Once upon a time"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        first = threading.Event()
        out: list[bytes] = []

        def read() -> None:
            while chunk := proc.stdout.read1(4096):
                out.append(chunk)
                first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(120), "no streamed output within 120 s"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        reader.join(10)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130
    assert err == ""  # no traceback, no summary line: nothing more after the interrupted text
