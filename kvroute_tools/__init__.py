"""The local tools, the top layer: the ``kvroute`` command (cli; ``python -m kvroute_tools``) and
what its subcommands run on one machine.

    cli ─┬─ up        ─▶ up ─▶ cluster (LocalCluster) ─▶ supervise (child processes, readiness)
         │                            └─ redis_server (embedded redis-server), resolve_model (child)
         ├─ generate  ─▶ client (one streamed generation from a router)
         ├─ bench     ─▶ bench/ (config, plan, run, report) over gRPC, trace (Mooncake traces, bounds)
         ├─ simulate  ─▶ simulate/ (a whole cluster in virtual time: replica.engine's scheduler and
         │                replica.kv over a timing model, router.core's Router), trace; demo = simulate
         ├─ health    ─▶ health (is a router ready to route: helm test's probe)
         └─ replica / router ─▶ replica.server.main / router.server.main

Around ``up``: cluster_ports (the ports of its processes), banner (what runs where), envoy (Envoy
in front, ``--gateway envoy``), binaries (the binaries it starts: the wheel's, else PATH).

Consumes: command lines, Mooncake-format traces (data/ bundles one), a router's address.
Produces: running local clusters (redis, replicas, a router as child processes), streamed text,
the bench table / bench.json / bench.png, the simulation's tables / simulate.json / charts, exit statuses that say what failed.
May import: ``kvroute``, ``router`` and ``replica`` (torch only through replica, and only in the
subcommands that run one: ``kvroute`` itself, ``up``, ``generate``, ``bench`` and ``simulate`` stay torch-free).
Nothing imports it but tests and the benchmarks in bench/ (import-linter, pyproject.toml).
"""
