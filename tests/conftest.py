"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The deterministic default checkpoint (replica.model.default_model), generated once per session."""
    from replica.model.default_model import DEFAULT_MODEL_DIRNAME, ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("default-model") / DEFAULT_MODEL_DIRNAME)
