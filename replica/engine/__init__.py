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

May import: ``kvroute`` (hashing, events, engine_info, the prompt rules), ``replica.kv``,
``replica.model``, ``replica.attention`` and torch; never ``router`` or the replica's gRPC layer.
"""
