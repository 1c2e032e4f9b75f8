"""One replica process per GPU: the engine, its gRPC service and its KV event publisher.

Consumes: ``ReplicaService`` / ``GenerationService`` calls (token ids, text or chat).
Produces: streamed generations; every engine step's KV events, a heartbeat with load and identity,
and cache snapshots in Redis (DESIGN.md §3.3, §4); metrics and spans (§6).
Guarantees: the engine step loop never blocks the gRPC server; bad input is INVALID_ARGUMENT
naming the field before anything is allocated; a cancelled or expired call frees its blocks.

    server process                      engine process (engine/engine_proc.py, default)
    gRPC (service.py) ──pipe──▶ ProcessLLMEngine ══▶ LLMEngine (engine/: scheduler, runner, model, kv/)
                                                         │ step hook
                                                         ▼
                                                  KVEventPublisher (publisher.py) ──▶ Redis

``--engine-process false`` runs the step loop on a thread instead (AsyncLLMEngine): simpler, but
the engine then shares the GIL with gRPC (12-14% slower at 32 streams, bench/replica.py).
"""
