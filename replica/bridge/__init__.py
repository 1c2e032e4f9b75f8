"""The bridge's pure parts: a stock vLLM server's ZMQ KV events turned into kvroute's (DESIGN.md §3.4).

Job: let a vLLM server be a kvroute replica. Consumes: vLLM's KV event messages (PUB socket and
replay socket, msgpack; ``vllm_events``). Produces: kvroute's ``kvroute.events`` types, keyed by
kvroute's own hash chain (``rekey``), in batch order with epochs (``sequence``). Guarantees: no
phantom blocks (a removal or a parent the bridge never saw is counted and skipped), a stream
that cannot be repaired becomes a new epoch, a setting kvroute cannot key (block size, LoRA,
prompt embeddings) is refused naming the field. No I/O here and no torch: the sockets, Redis
and heartbeats live in the running bridge above these modules.

    SUB / DEALER frames ─▶ vllm_events.decode_* ─▶ VllmBatch ─▶ sequence.VllmSequencer ─▶ (new epoch?, batches)
                                                                          │
                          kvroute.events (BlockStored ...) ◀── rekey.Rekeyer ◀──┘

May import: ``kvroute`` and msgpack; never the rest of ``replica`` (it imports torch) or ``router``.
"""
