"""The contract router and replicas share, each part defined once (DESIGN.md §1, §2, §4).

Job: say what crosses the boundary between a replica and a router, and nothing above it.
Inputs and outputs are values, not connections: token ids -> block hashes, KV events <-> bytes,
snapshots <-> bytes, stream entries -> ordering decisions, heartbeats <-> Redis hash fields, a
prompt -> token ids.

- ``hashing``: the block-hash chain (``_hashchain`` compiled, numpy fallback).
- ``events``: BlockStored / BlockRemoved / AllBlocksCleared and the ``KVEventBatch`` codec;
  ``snapshot``: the ``CacheSnapshot`` codec (whole, or just its position from its first bytes);
  ``ordering``: the per-replica event-ordering rules (epoch, seq, gaps) the router's consumer runs.
- ``heartbeat``: the heartbeat record (``Heartbeat``, ``EngineLoad``); ``engine_info``: what an
  engine is (``EngineInfo``); ``redis_layout``: the key names.
- ``prompt`` + ``tokenizer`` + ``model_folder``: prompt (text, chat, token ids) -> token ids,
  exactly as the replica's engine computes them, without torch.
- ``grpc_errors``: typed errors and their gRPC status mapping; ``responses``: helpers over
  response streams; ``openai_api`` (OpenAI JSON <-> our request and response types) and
  ``openai_http`` (the OpenAI-compatible HTTP app over a process's request path, on uvicorn),
  which router and replicas both serve; ``process``: running a server process until a signal; ``settings``,
  ``telemetry``: per-process configuration and OpenTelemetry setup; ``v1``: generated protobuf code.

May import: the standard library and third-party packages; never ``router``, ``replica``,
``kvroute_tools`` or torch (checked by import-linter, pyproject.toml).
"""

__version__ = "0.1.0"
