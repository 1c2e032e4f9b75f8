"""``kvroute bench``: replay a Mooncake-format trace through a running cluster, once per routing
policy, and report what each policy achieved (DESIGN.md §7).

Consumes: a trace file (kvroute_tools.trace), the flags (``config.BenchConfig``) and a router's
address; talks to the router (GenerationService, RouterService) and to the replicas it lists
(ReplicaService.GetLoad) over gRPC only.
Produces: one table per run (``report.format_report``), optionally ``bench.json`` and ``bench.png``;
the exit status of ``kvroute bench`` (``run.bench_main``).

    config ──▶ plan (trace -> prompts, output lengths, send times) ──▶ run (per policy, over gRPC)
           ──▶ report (results, table, json, chart)
    (``--api openai``: openai_send sends each request through the OpenAI HTTP API instead)

May import ``kvroute`` (the generated gRPC code) and the rest of ``kvroute_tools``; no router or
replica code, no torch: the cluster is reached over the network.
"""
