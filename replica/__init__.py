"""One replica process per GPU: the engine, its gRPC services and its KV event publisher.

Job: serve generations from one model with a paged, prefix-cached KV cache, and tell the routers
what that cache holds.
Consumes: ``ReplicaService`` / ``GenerationService`` calls (token ids, text or chat; prompts become
ids with ``kvroute.prompt``, as on the router) and the same requests over the OpenAI-compatible
HTTP API (``http_api.py``: ``kvroute.openai_http`` over the same frontend); settings from flags and ``KVROUTE_*`` variables.
Produces: streamed generations; every engine step's KV events, a heartbeat with load and identity
(``kvroute.heartbeat``), and cache snapshots in Redis (DESIGN.md §3.3, §4); metrics and spans (§6).
Guarantees: the engine step loop never blocks the gRPC server; bad input is INVALID_ARGUMENT
naming the field before anything is allocated; a cancelled or expired call frees its blocks.
May import: ``kvroute`` (the contract), torch and the other third-party libraries; never ``router``
or ``kvroute_tools``.

    server process                                         engine process (default)
    servicers.py ─▶ frontend.py ─▶ engine/core_client.py ══pipe══▶ engine/core_proc.py ─▶ LLMEngine
      (gRPC)        (admission,     (ProcessLLMEngine)              (step loop)        (engine/: scheduler,
                     in-flight)                                          │ step hook     runner, model, kv/)
    wire.py: statuses, proto <-> engine types                            ▼ (engine/step_hook.py)
    server.py: lifecycle, health                                   publisher/ ──▶ Redis
    settings.py: the process's settings; telemetry.py: metrics and spans; vllm_metrics.py: the
    same numbers under vLLM's Prometheus names

``--no-engine-process`` runs the step loop on a thread of the server instead (AsyncLLMEngine):
simpler, but the engine then shares the GIL with gRPC (bench/replica.py measures the difference).
"""
