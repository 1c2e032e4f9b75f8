"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The deterministic default checkpoint (replica.model.default_model), generated once per session."""
    from replica.model.default_model import DEFAULT_MODEL_DIRNAME, ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("default-model") / DEFAULT_MODEL_DIRNAME)


# -- gRPC stubs for a module that serves something: it defines ``grpc_target`` ------------------------
@pytest.fixture(scope="module")
def channel(grpc_target: str):
    import grpc

    ch = grpc.insecure_channel(grpc_target)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def gen(channel):
    from kvroute.v1 import generation_pb2_grpc

    return generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def rep(channel):
    from kvroute.v1 import replica_pb2_grpc

    return replica_pb2_grpc.ReplicaServiceStub(channel)
