"""``kvroute simulate``: a whole cluster in virtual time, with the router's and the replicas' own code.

Consumes: a Mooncake-format trace, a cluster shape (replicas, KV blocks, scheduler limits), a
timing model and routing policy names. Produces: per policy, each request's TTFT / TPOT / cached
tokens, the replicas' load and preemptions and the router's decision time (``cluster.PolicyRun``),
beside the oracles' hit rates; a table, JSON and PNG charts (``report``).

    workload ──▶ cluster (event loop) ──▶ router.core.Router (real index, registry, load, policy)
                    │                      ▲ KV events (router.consumer_feed.IndexFeed), heartbeats
                    ▼                      │
                 replica.SimReplica (replica.engine.scheduler.Scheduler + replica.kv.KVCacheManager,
                                     step times from timing.TimingModel)
    oracles (ideal, pooled LRU, round robin over unlimited caches)        run: the CLI's driver

Modules: timing (step durations), workload (trace -> prompts, arrival scaling, modelled
capacity), replica, cluster, oracles, report, run, flags (the argparse flags, importing neither
router nor replica). Policy logic lives in ``router/`` only.
Imports: kvroute, router, replica (the scheduler and KV manager; never torch), kvroute_tools.trace;
matplotlib only when charts are written.
"""
