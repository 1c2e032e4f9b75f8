"""The contract router and replicas share (DESIGN.md §1, §2, §4).

Block hashing (``hashing``), the KV event dataclasses and their protobuf codec (``events``), the
generated protobuf/gRPC code (``v1``), and the ``kvroute`` CLI. Imports nothing of ``router`` or
``replica`` at import time, and never torch.
"""

__version__ = "0.1.0"
