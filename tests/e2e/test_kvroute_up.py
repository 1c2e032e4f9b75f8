"""End to end: ``kvroute up`` (2 replicas, small KV, free ports, ``--metrics``) in a subprocess,
``kvroute generate`` streams back, every process's /metrics address in the banner serves its
numbers, ``kvroute bench --requests 30`` prints the table, SIGTERM stops every process."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import scrape_metrics

pytestmark = pytest.mark.slow

KVROUTE = [sys.executable, "-m", "kvroute_tools"]


class _Lines:
    """The lines a process prints, read on a thread so that waiting for one can time out."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            try:
                line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout}s:\n{''.join(self.lines)}") from None
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}:\n{''.join(self.lines)}")
            self.lines.append(line)

    def rest(self, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie nobody reaped yet counts as gone too
        return f.read().split(") ", 1)[1].startswith("Z")


def _in_groups(pgids: set[int]) -> list[str]:
    """Processes whose process group is one of ``pgids`` (each child of `up` leads its own group, so
    this also finds what a child spawned, such as a replica's engine process)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(pid)
    return found


def _check_metrics(banner: str, summary: str) -> None:
    """Each process line of the banner ends with its metrics address; each serves that process's
    numbers: the router counts the generation's decision for the replica that served it, and that
    replica counts the prompt's prefix-cache queries under its own id."""
    urls = dict(re.findall(r"^  (router|replica-\d)\s.*\bpid \d+  metrics (http://\S+/metrics)$", banner, re.M))
    assert sorted(urls) == ["replica-0", "replica-1", "router"], banner
    assert all(u.startswith("http://127.0.0.1:") for u in urls.values()) and len(set(urls.values())) == 3
    served_by = re.search(r"\| (replica-[01]) ", summary).group(1)
    router = scrape_metrics(urls["router"])
    decisions = {lab["kvroute_replica_id"]: v for lab, v in router["kvroute_router_decisions_total"]}
    assert decisions == {served_by: 1.0}
    replica = scrape_metrics(urls[served_by])
    (queries,) = replica["kvroute_replica_prefix_cache_queries_total"]
    assert queries[0]["kvroute_replica_id"] == served_by and queries[1] > 0
    other = "replica-1" if served_by == "replica-0" else "replica-0"
    assert [v for _, v in scrape_metrics(urls[other]).get("kvroute_replica_generation_tokens_total", [])] in ([], [0.0])


def test_up_generate_bench_and_sigterm_leaves_nothing_behind(tmp_path, default_model_dir):
    t0 = time.monotonic()
    up = subprocess.Popen(
        [*KVROUTE, "up", "--replicas", "2", "--router-port", "0", "--num-blocks", "1024", "--model",
         str(default_model_dir), "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "120", "--metrics"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = _Lines(up)
    pids: list[int] = []
    try:
        out.wait_for(r"kvroute up: ready in", timeout=150)
        banner = "".join(out.lines)
        target = re.search(r"^  router\s+(\S+)\s+pid (\d+)", banner, re.M).group(1)
        pids = [int(p) for p in re.findall(r"\bpid (\d+)", banner)]
        assert len(pids) == 4, banner  # router, 2 replicas, redis
        assert f"kvroute generate --target {target}" in banner and "grpcurl -plaintext" in banner
        token_file = re.search(r"^  admin token (\S+) ", banner, re.M).group(1)
        assert token_file == str(tmp_path / "logs" / "admin-token")
        assert os.stat(token_file).st_mode & 0o777 == 0o600

        gen = subprocess.run([*KVROUTE, "generate", "--target", target, "--max-tokens", "8", "--temperature", "0",
                              "The harbour town"], capture_output=True, text=True, timeout=60)
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip()
        summary = gen.stderr.strip().splitlines()[-1]
        assert re.search(r"finish length \| tokens: prompt \d+, completion 8, cached \d+ \| replica-[01] ", summary), summary
        assert "policy kvroute" in summary
        _check_metrics(banner, summary)

        bench = subprocess.run(
            [*KVROUTE, "bench", "--target", target, "--requests", "30", "--concurrency", "4", "--tokens-per-block",
             "16", "--out", str(tmp_path / "bench"), "--admin-token-file", token_file],
            capture_output=True, text=True, timeout=120,
        )
        assert bench.returncode == 0, bench.stdout + bench.stderr
        table = bench.stdout
        assert re.search(r"^policy\s+requests\s+errors\s+hit rate", table, re.M), table
        for policy in ("kvroute", "round_robin"):
            assert re.search(rf"^{policy}\s+30\s+0\s+0\.\d{{3}}", table, re.M), table
        assert "bounds from the hash ids alone (30 requests, infinite caches): ideal" in table
        assert "30/30" in bench.stderr  # the progress bar ran to the end
        report = json.loads((tmp_path / "bench" / "bench.json").read_text())
        token = Path(token_file).read_text().strip()
        assert token and token not in (tmp_path / "bench" / "bench.json").read_text()  # not written unasked
        assert [p["policy"] for p in report["policies"]] == ["kvroute", "round_robin"]
        assert all(p["hit_rate_source"] == "replica counters" for p in report["policies"])
        assert (tmp_path / "bench" / "bench.png").stat().st_size > 0
        # The policy already active needs no SetPolicy, so no admin token.
        one = subprocess.run(
            [*KVROUTE, "bench", "--target", target, "--requests", "4", "--concurrency", "2", "--tokens-per-block",
             "16", "--policies", "kvroute"], capture_output=True, text=True, timeout=60,
        )
        assert one.returncode == 0, one.stdout + one.stderr
        assert re.search(r"^kvroute\s+4\s+0\s", one.stdout, re.M), one.stdout

        t_stop = time.monotonic()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=20) == 0
        stop_s = time.monotonic() - t_stop
        assert "stopped 4 processes" in out.rest()
        assert stop_s < 15, f"stopping took {stop_s:.1f}s"
        deadline = time.monotonic() + 5
        while (not all(_gone(p) for p in pids) or _in_groups(set(pids))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if not _gone(p)] == []
        assert _in_groups(set(pids)) == []
        print(f"e2e: {time.monotonic() - t0:.1f}s in all, stop {stop_s:.1f}s")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for p in pids:  # never leave a cluster behind, even when an assertion failed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p, signal.SIGKILL)


def test_up_stops_what_it_started_when_a_replica_cannot_start(tmp_path):
    missing = tmp_path / "empty-model"  # a folder with no model in it: the processes start, then fail
    missing.mkdir()
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [*KVROUTE, "up", "--replicas", "1", "--router-port", "0", "--model", str(missing), "--log-dir", str(logs),
         "--ready-timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert re.search(r"kvroute up: (replica-0|router) exited with status 1 while starting; last lines of ", proc.stderr), \
        proc.stderr
    # nothing of this cluster is left: no process mentions its model path or its redis folder
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(missing) in cmd or str(logs) in cmd:
            leftovers.append(cmd)
    assert leftovers == []


def test_up_runs_a_command_against_the_ready_cluster_and_exits_with_its_status(tmp_path, default_model_dir):
    # The channel is closed before exit: a channel left to interpreter teardown can abort in gRPC's
    # poller ("epoll_wait error: Bad file descriptor"), which read as status 250 once.
    check = ("import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as hg; "
             "ch = grpc.insecure_channel(sys.argv[1]); "
             "s = hg.HealthStub(ch).Check(h.HealthCheckRequest(service='readiness'), timeout=5).status; "
             "ch.close(); sys.exit(7 if s == h.HealthCheckResponse.SERVING else 1)")
    proc = subprocess.run(
        [*KVROUTE, "up", "--replicas", "1", "--router-port", "0", "--num-blocks", "256", "--model",
         str(default_model_dir), "--log-dir", str(tmp_path), "--", sys.executable, "-c", check, "{target}"],
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 7, proc.stdout + proc.stderr  # the command saw the router serving
    assert re.search(r"kvroute up: running \S+ -c .* 127\.0\.0\.1:\d+$", proc.stdout, re.M), proc.stdout
    assert "kvroute up: stopped 3 processes" in proc.stdout


def test_up_reports_a_command_killed_by_a_signal_as_the_shell_does():
    from kvroute_tools.up import exit_status

    killed = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"])
    assert killed.returncode == -signal.SIGABRT
    assert exit_status(killed.returncode) == 128 + 6  # what `sh -c` reports for the same child
    assert subprocess.run(["sh", "-c", f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), 6)'"]
                          ).returncode == 134
    assert exit_status(7) == 7 and exit_status(0) == 0



def test_up_with_envoy_in_front_generates_through_the_picker(tmp_path, default_model_dir):
    proc = subprocess.run(
        [*KVROUTE, "up", "--replicas", "1", "--router-port", "0", "--num-blocks", "256", "--gateway", "envoy",
         "--model", str(default_model_dir), "--log-dir", str(tmp_path), "--", *KVROUTE, "generate", "--target",
         "{target}", "--max-tokens", "4", "--ignore-eos", "The harbour town woke"],
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    envoy = re.search(r"^  envoy +(127\.0\.0\.1:\d+) +pid \d+ \(the front; admin (http://\S+), log (\S+);", proc.stdout,
                      re.M)
    assert envoy, proc.stdout
    assert f"--target {envoy.group(1)}" in proc.stdout  # {target} is Envoy's listener
    summary = proc.stderr  # kvroute generate's summary line
    # The pick, from the trailers; the policy and the address do not come through a gateway.
    assert "completion 4" in summary and "replica-0 (via a gateway), predicted cached" in summary, summary
    assert "?" not in summary and "policy" not in summary, summary
    assert (tmp_path / "envoy.json").is_file() and envoy.group(3) == str(tmp_path / "envoy.log")
    assert "kvroute up: stopped 4 processes" in proc.stdout


def test_up_keep_going_serves_on_with_the_other_replica_when_one_dies(tmp_path, default_model_dir):
    up = subprocess.Popen(
        [*KVROUTE, "up", "--replicas", "2", "--router-port", "0", "--num-blocks", "512", "--model",
         str(default_model_dir), "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "120", "--keep-going"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = _Lines(up)
    try:
        out.wait_for(r"kvroute up: ready in", timeout=150)
        banner = "".join(out.lines)
        target = re.search(r"^  router\s+(\S+)\s+pid (\d+)", banner, re.M).group(1)
        victim = int(re.search(r"^  replica-0\s+\S+\s+pid (\d+)", banner, re.M).group(1))
        os.kill(victim, signal.SIGKILL)
        out.wait_for(r"replica-0 exited .*", timeout=30)
        out.wait_for(r"kvroute up: serving on with 1 replica \(--keep-going\)", timeout=30)
        for i in range(3):  # the router stops picking it (heartbeat expiry) or retries past it
            gen = subprocess.run([*KVROUTE, "generate", "--target", target, "--max-tokens", "4", "--temperature",
                                  "0", f"Still serving {i}"], capture_output=True, text=True, timeout=60)
            assert gen.returncode == 0, gen.stderr
            assert "replica-1" in gen.stderr.strip().splitlines()[-1], gen.stderr
        assert up.poll() is None, "".join(out.lines)  # the cluster is still up
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0, "".join(out.lines)


def test_up_stops_at_once_with_the_otlp_collector_unreachable(tmp_path, default_model_dir):
    """A collector that accepts connections and never answers (every export would wait for the
    exporters' 10 s timeout): SIGTERM still stops the cluster promptly, every process giving its
    last export half a second (kvroute.telemetry.SHUTDOWN_WAIT_S)."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.extend(silent.accept()[0] for _ in range(16)), daemon=True).start()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
           "OTEL_METRIC_EXPORT_INTERVAL": "500"}
    up = subprocess.Popen(
        [*KVROUTE, "up", "--replicas", "1", "--router-port", "0", "--num-blocks", "256", "--model",
         str(default_model_dir), "--log-dir", str(tmp_path), "--ready-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    out = _Lines(up)
    try:
        out.wait_for(r"kvroute up: ready in", timeout=150)
        target = re.search(r"^  router\s+(\S+)\s+pid", "".join(out.lines), re.M).group(1)
        gen = subprocess.run([*KVROUTE, "generate", "--target", target, "--max-tokens", "2", "traced"],
                             capture_output=True, text=True, timeout=60)  # spans and metrics to export
        assert gen.returncode == 0, gen.stderr
        time.sleep(1.0)  # a metric export in flight, stuck on the silent collector
        assert held, "no process dialed the collector"
        started = time.monotonic()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0, out.rest()
        took = time.monotonic() - started
        print(f"kvroute up stopped in {took:.2f} s with the collector unreachable")
        # Bounded by the one-second wait per process, not by the exporters' 10 s (with a margin
        # for a loaded two-core machine).
        assert took < 5.0, f"stopped in {took:.1f} s:\n{out.rest()}"
    finally:
        if up.poll() is None:
            up.kill()
        silent.close()
