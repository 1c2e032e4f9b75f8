"""The router: KV events in, routing decisions out, generation proxied (DESIGN.md §5). Never imports
torch or the replica package.

Consumes: the replicas' KV event streams, heartbeats and snapshots in Redis (kvroute.redis_layout),
replica discovery (static list, Redis heartbeats, Kubernetes EndpointSlices), and client requests
(text, chat or token ids).
Produces: for each request, the replica with the lowest estimated time to first token given its
cached prefix and load; the proxied response stream with the chosen replica and the predicted
cached tokens; ``RouterService.Score`` decisions as data.
Guarantees: the index equals the union of the replicas' cached sets within seconds of any event
fault (gap, duplicate, reorder, restart, expiry); a replica with a different hash triple gets no
traffic (and says why); exact ties are broken at random, never by list position.

    Redis ──▶ consumer ──▶ index (BlockIndex) ◀── lookup ── core.Router ◀── proxy (gRPC) ◀── client
      │          │                                    │  scoring (pluggable scorers)
      │          └──▶ registry (ReplicaInfo: heartbeat, identity, routable) ◀── discovery
      └──────────────────── load (in-flight, shared between routers) ◀──┘

Modules: ``index`` (pure data structure), ``registry`` (replica states), ``consumer`` (Redis I/O),
``discovery`` (static / redis / kubernetes), ``tokenize`` (text / chat -> token ids, as the replicas do), ``scoring`` (cost model), ``load`` (in-flight
accounting), ``core`` (hash + lookup + score + pick), ``proxy`` / ``server`` (gRPC), ``settings``,
``telemetry``.
"""
