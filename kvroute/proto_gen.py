"""Regenerate the checked-in protobuf/gRPC code from ``proto/kvroute/v1/*.proto``.

``python -m kvroute.proto_gen`` (``make proto``) writes ``kvroute/v1/*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py``. The proto package ``kvroute.v1`` maps onto the Python package ``kvroute.v1``, so
the generated ``from kvroute.v1 import ...`` lines resolve inside this distribution.
``generate(out_dir)`` is also used by the staleness test, which generates into a temporary folder and
compares bytes with the checked-in files.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    """The .proto sources, sorted, relative paths under ``proto/``."""
    return sorted(p.relative_to(PROTO_DIR) for p in (PROTO_DIR / "kvroute" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc into ``out_dir``; return the generated files (relative to ``out_dir``).

    Raises:
        RuntimeError: protoc failed (its exit status is in the message).
    """
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    try:
        import grpc_tools
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("grpcio-tools is not installed (pip install -e '.[dev]')") from e
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc exited with status {rc}")
    gen_dir = out_dir / "kvroute" / "v1"
    return sorted(p.relative_to(out_dir) for p in gen_dir.glob("*_pb2*"))


def main() -> int:
    generated = generate(ROOT)
    init = ROOT / "kvroute" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC code for proto/kvroute/v1 (make proto)."""\n')
    for p in generated:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
