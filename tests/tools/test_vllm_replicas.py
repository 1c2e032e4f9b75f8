"""``kvroute up --engine vllm``'s server plan (kvroute_tools.vllm_replicas): the cores each vLLM
server binds to and the flags it gets, against hand-worked values. No vLLM needed."""

from __future__ import annotations

import pytest

from kvroute_tools.vllm_replicas import VllmPorts, cpu_share, vllm_child


@pytest.mark.parametrize(("count", "cores", "expected"), [
    (1, [0, 1], ["auto"]),
    (2, [0, 1], ["0", "1"]),
    (3, list(range(8)), ["0-2", "3-5", "6-7"]),  # 8 = 3 + 3 + 2
    (2, [0, 2, 4, 6], ["0,2", "4,6"]),  # not contiguous: listed
    (3, [0, 1], ["0", "1", "0"]),  # more servers than cores: they share, round robin
])
def test_cpu_share_splits_the_allowed_cores(count, cores, expected):
    assert [cpu_share(i, count, cores) for i in range(count)] == expected


def test_cpu_share_refuses_an_index_out_of_range():
    with pytest.raises(ValueError, match="server index 2 not in"):
        cpu_share(2, 2, [0, 1])


def test_vllm_child_appends_the_extra_flags_and_binds_its_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    child = vllm_child("vllm-1", "/x/bin/python", "/models/tiny", "127.0.0.1", VllmPorts(8001, 5001, 5002), 32,
                       tmp_path, extra_args=("--max-model-len", "4096"), cpus="1")
    argv = child.argv
    assert argv[-2:] == ["--max-model-len", "4096"]
    assert argv[argv.index("--block-size") + 1] == "32" and argv[argv.index("--port") + 1] == "8001"
    assert child.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's setting wins
    assert vllm_child("v", "/x/bin/python", "/m", "h", VllmPorts(1, 2, 3), 32, tmp_path).env[
        "VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
