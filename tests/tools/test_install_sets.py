"""The package's install sets (pyproject.toml extras): the router installs without the engine's
and the tools' libraries (DESIGN.md §1; the router image installs ``.[router]``).

The sets are resolved by pip itself (``pip install --dry-run --report``, every dependency resolved
anew from the configured index), not read off pyproject.toml: a library that pulls torch or
matplotlib in indirectly fails here too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "matplotlib", "transformers"}


def resolved(extra: str) -> set[str]:
    """The canonical names pip would install for ``.[extra]`` into an empty environment."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--report", "-", "--quiet", "--ignore-installed",
         "--no-build-isolation", f".[{extra}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {canonicalize_name(item["metadata"]["name"]) for item in json.loads(proc.stdout)["install"]}


@pytest.fixture(scope="module")
def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    out[""] = [Requirement(r) for r in project["dependencies"]]
    return out


def test_the_router_extra_resolves_without_torch_matplotlib_or_transformers():
    names = resolved("router")
    assert {"kvroute", "grpcio", "redis", "kubernetes", "tokenizers", "opentelemetry-sdk"} <= names
    assert names & HEAVY == set()


def test_the_engine_and_the_tools_libraries_live_in_their_own_extras(extras):
    def direct(extra: str) -> set[str]:
        return {canonicalize_name(r.name) for r in extras[extra]}

    assert direct("") & HEAVY == set() and direct("router") & HEAVY == set()
    assert "torch" in direct("replica") and "matplotlib" in direct("tools") and "flash-attn" in direct("gpu")
    # `make venv` installs '.[replica,dev]': dev brings the router's and the tools' extras with it
    assert any(r.name == "kvroute" and r.extras == {"router", "tools"} for r in extras["dev"])
