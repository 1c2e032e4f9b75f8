"""The replica's engine: vLLM v1-style continuous batching over the paged KV cache (DESIGN.md §3.2).

Consumes: requests (token ids or text, SamplingParams, cache_salt), validated before anything is
allocated (``InvalidRequestError`` names the field).
Produces: per-step ``RequestOutput`` deltas (new token ids, text, finish reason, cached tokens),
step stats, and the KV cache events of each step.
Guarantees: one token budget per step shared by decodes and prefill chunks; running requests
first; preemption by recompute of the last running request; admission only when nothing was
preempted; every block is freed when a request finishes or is aborted.

    add_request ─▶ Scheduler ─▶ ModelRunner (model + attention backend) ─▶ Sampler ─▶ detokenizer/stop
                      │ KVCacheManager (replica.kv)

Where the step loop runs: ``async_engine`` (a thread of the server) or its own process, one file
per side of the pipe: ``core_client`` (ProcessLLMEngine, what the server holds), ``core_proc`` (the
loop in the engine process), ``core_messages`` (what crosses). ``step_hook`` is the hook's engine
side (load sample, KV events to the publisher). May import ``kvroute``, ``replica.kv``,
``replica.model``, ``replica.attention``, and (``step_hook`` only) ``replica.publisher`` and
``replica.telemetry``; never ``router``.

Modules: ``engine`` (LLMEngine, the step), ``scheduler``, ``runner`` (the forward pass),
``sampling``, ``detokenizer`` and ``stop``, ``request`` and ``params`` (per-request state),
``config`` (settings, KV cache sizing) with ``profiling`` (the activation memory), ``cuda_graphs``
(decode steps replayed as CUDA graphs), ``step_rates`` (the measured speed the heartbeat carries),
``remote_publisher`` (the server's stand-in for the engine process's publisher), ``errors``.
"""
