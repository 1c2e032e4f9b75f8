"""The local tools, the top layer: the ``kvroute`` command (cli; ``python -m kvroute_tools``) and
what its subcommands run on one machine.

    cli ─┬─ up        ─▶ up ─▶ cluster (LocalCluster) ─▶ supervise (child processes, readiness)
         │                            └─ redis_server (embedded redis-server), resolve_model (child)
         ├─ generate  ─▶ client (one streamed generation from a router)
         ├─ bench     ─▶ bench/ (config, plan, run, report) over gRPC, trace (Mooncake traces, bounds)
         ├─ demo      ─▶ demo (the trace through in-process KV managers, routed by router.scoring)
         └─ replica / router ─▶ replica.server.main / router.server.main

Consumes: command lines, Mooncake-format traces (data/ bundles one), a router's address.
Produces: running local clusters (redis, replicas, a router as child processes), streamed text,
the bench table / bench.json / bench.png, exit statuses that say what failed.
May import: ``kvroute``, ``router`` and ``replica`` (torch only through replica, and only in the
subcommands that run one: ``kvroute`` itself, ``up``, ``generate`` and ``bench`` stay torch-free).
Nothing imports it but tests and the benchmarks in bench/ (import-linter, pyproject.toml).
"""
