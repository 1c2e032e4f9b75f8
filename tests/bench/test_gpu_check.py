"""bench/gpu_check.py --dry-run end to end on the CPU, so that the GPU check cannot rot between
GPU runs: every part runs, says what it skipped, and prints its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_says_what_it_skips(default_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--tokenizer-dir", str(default_model_dir)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== 1. GPU tests (dry run: the CUDA tests skip on this machine)" in out
    assert re.search(r"\d+ skipped, \d+ deselected", out), "the gpu-marked tests were collected and skipped"
    assert "triton and flash_attn need CUDA" in out
    assert re.search(r"^torch +16 +4 +128 ", out, re.M) and re.search(r"^torch +256 +4 +128 ", out, re.M)
    assert "attention backend torch (device cpu" in out and "CUDA graphs off" in out
    for batch in (1, 4):  # batch, decode steps (4 tokens: the first comes with the prefill), ...
        assert re.search(rf"^{batch} +3 +[\d.]+ +\d+ +\d+ +[\d.]+$", out, re.M), out
    assert "tests passed" in out
