"""The router process runs without torch: importing the router's modules (and the tools' CLI)
loads neither torch nor the replica package (DESIGN.md §1; import-linter checks the static graph,
this the imports that actually run)."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvroute_tools.redis_server import RedisServer, free_port
from kvroute_tools.supervise import health
from tests.support import wait_for


def test_the_router_imports_neither_torch_nor_the_replica_package():
    code = ("import sys, router.server, router.proxy, kvroute.prompt, router.telemetry, kvroute_tools.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'replica')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_running_router_started_from_the_cli_has_imported_neither_torch_nor_the_engine(
        tmp_path, default_model_dir):
    """``kvroute router`` started for real (gRPC, HTTP API and metrics on, a live Redis), stopped by
    SIGTERM once serving: what it imported in its whole life is read at its exit."""
    code = ("import atexit, sys; atexit.register(lambda: print('IMPORTED', sorted({m.split('.')[0] for m in "
            "sys.modules} & {'torch', 'replica', 'matplotlib', 'transformers', 'safetensors'}), flush=True)); "
            "from kvroute_tools.cli import main; sys.exit(main())")
    port = free_port()
    with RedisServer() as redis:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "router", "--port", str(port), "--http-port", "0", "--metrics-port", "0",
             "--redis-url", redis.url, "--discovery", "static", "--replicas", f"127.0.0.1:{free_port()}",
             "--model", str(default_model_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                wait_for(lambda: proc.poll() is not None or health(stub, "liveness") is not None, 60, "router up")
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out
    assert "IMPORTED []" in out.splitlines(), out


def test_the_routers_default_model_folder_is_written_without_torch_and_tokenizes_as_the_replicas(
        tmp_path, default_model_dir):
    """``resolve_model --tokenizer-only`` (the chart's router init container, in the router image,
    which has no torch): torch and safetensors blocked, it writes the default model's files but the
    weights, byte for byte the replicas' own."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['safetensors'] = None; "
            "from kvroute_tools.resolve_model import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code, "--tokenizer-only", "", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / default_model_dir.name
    assert done.stdout.strip().splitlines()[-1] == str(folder)
    full = {p.name for p in default_model_dir.iterdir() if not p.name.startswith(".")}
    assert {p.name for p in folder.iterdir()} == full - {"model.safetensors"}
    for name in full - {"model.safetensors"}:
        assert (folder / name).read_bytes() == (default_model_dir / name).read_bytes(), name
    refused = subprocess.run([sys.executable, "-m", "kvroute_tools.resolve_model", "--tokenizer-only", "some/model",
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "the model must be" in refused.stderr
