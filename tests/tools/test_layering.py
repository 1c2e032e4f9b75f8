"""The import-linter contracts in pyproject.toml ([tool.importlinter]) hold for the tree: kvroute at
the bottom, router and replica independent on top of it, kvroute_tools above both; router free of
replica and torch; kvroute free of everything above it; inside router and replica, each module
imports only the layers below its own, and no sibling modules import each other in a circle.
``make test`` runs the same check first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_linter_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"{lint_imports}: install the dev extra (pip install -e '.[dev]')"
    proc = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout
