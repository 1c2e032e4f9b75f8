"""The router: KV events in, routing decisions out, generation proxied (DESIGN.md §5).

Job: pick, for each request, the replica with the lowest estimated time to first token given its
cached prefix and load, and proxy the generation there.
Consumes: the replicas' KV event streams, heartbeats (kvroute.heartbeat) and snapshots
(kvroute.snapshot) in Redis (kvroute.redis_layout), replica discovery (static list, Redis
heartbeats, Kubernetes EndpointSlices), and client requests (text, chat or token ids; gRPC, or
OpenAI-compatible HTTP).
Produces: the proxied response stream with the chosen replica and the predicted cached tokens;
``RouterService.Score`` decisions as data; its in-flight load per replica, shared with other routers.
Guarantees: the index equals the union of the replicas' cached sets within seconds of any event
fault (gap, duplicate, reorder, restart, expiry), by kvroute.ordering's rules; a replica with a
different hash triple gets no traffic (and says why); exact ties are broken at random, never by
list position.
May import: ``kvroute`` (the contract) and third-party libraries; never ``replica``,
``kvroute_tools`` or torch.

    Redis ──▶ consumer ──▶ consumer_feed ──▶ index (BlockIndex) ◀── lookup ── core.Router ◀── proxy ◀── client
      │      (Redis I/O)  (kvroute.ordering)                            │  scoring (pluggable scorers)
      │          └──▶ registry (ReplicaInfo: heartbeat, identity, routable) ◀── discovery
      └──────────────────── load (in-flight, shared between routers) ◀──┘

Modules: ``index`` (pure data structure), ``registry`` (replica states, no I/O), ``consumer``
(the Redis I/O thread), ``consumer_feed`` (what it read, through kvroute.ordering into the index;
no I/O), ``discovery`` (static / redis / kubernetes), prompts -> token ids through ``kvroute.prompt`` (as
the replicas do), ``scoring`` (cost model and the baseline policies), ``policies`` (re-implemented
peer policies: SGLang, llm-d, Dynamo, consistent hashing with bounded load), ``load`` (in-flight
accounting), ``core`` (hash + lookup + score + pick), ``proxy`` (the request path), ``channels``
(replica channels), ``servicers`` / ``server`` (gRPC), ``http_api`` (the OpenAI-compatible HTTP
front over the same proxy), ``settings``, ``telemetry``; ``consumer_reads`` (the consumer's
hostile-input-safe reads of heartbeats and snapshots), ``consumer_streams`` (its blocking XREAD
per event stream, one thread each: a Redis Cluster has each shard in a slot), ``model_limits`` (the limits a request is
checked against), ``speculative`` (a routed request's blocks credited before its events arrive),
``_index`` (the index's compiled loops), ``picker`` (the Envoy endpoint picker).
"""
