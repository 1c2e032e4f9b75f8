"""The checked-in protobuf/gRPC code is what ``make proto`` generates from proto/kvroute/v1/*.proto."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) is needed to regenerate")

from kvroute import proto_gen  # noqa: E402

CHECKED_IN = Path(proto_gen.ROOT) / "kvroute" / "v1"


def test_generated_protobuf_code_is_byte_identical_to_the_checked_in_files(tmp_path):
    generated = proto_gen.generate(tmp_path)
    assert generated, "protoc generated nothing"
    names = {p.name for p in generated}
    checked_in = {p.name for p in CHECKED_IN.glob("*_pb2*")}
    hint = "the checked-in protobuf code is stale: run `make proto` and commit kvroute/v1/"
    assert names == checked_in, f"{hint} (generated {sorted(names)}, checked in {sorted(checked_in)})"
    stale = [p.name for p in generated if (tmp_path / p).read_bytes() != (CHECKED_IN / p.name).read_bytes()]
    assert not stale, f"{hint} (differs: {', '.join(sorted(stale))})"


def test_every_proto_file_has_generated_messages():
    stems = {p.stem for p in proto_gen.proto_files()}
    assert stems >= {"events"}
    for stem in stems:
        assert (CHECKED_IN / f"{stem}_pb2.py").exists(), f"kvroute/v1/{stem}_pb2.py missing: run `make proto`"
