"""The ``kvroute`` command line (``python -m kvroute_tools``).

Subcommands import the replica or router packages lazily, so that ``kvroute`` itself stays free of
torch (DESIGN.md §1).

    kvroute simulate [--replicas 8,16] [...]     the trace through N simulated replicas (real scheduler
                                                 and KV manager, timing model) and the real router, per
                                                 policy, against the oracles -- kvroute_tools.simulate
    kvroute demo                                 simulate with small defaults (1,000 requests, 4 replicas,
                                                 round_robin vs kvroute)
    kvroute replica [--flag ...]                 run one replica (gRPC + engine + KV events); its
                                                 flags are ReplicaSettings' (kvroute replica --help)
    kvroute router [--flag ...]                  run one router (KV event consumer + gRPC proxy); its
                                                 flags are RouterSettings' (kvroute router --help)
    kvroute up [--replicas N] [...] [-- CMD ...]  redis + N replicas + a router (--routers M) on this
                                                 machine until Ctrl-C (or, with CMD, until CMD ends;
                                                 {target} in CMD becomes the router's host:port,
                                                 {targets} every router's) -- kvroute_tools.up
    kvroute generate [--target H:P] "text"       stream one generation from a router -- kvroute_tools.client
    kvroute health --target H:P                  exit 0 when the router is ready and has a routable
                                                 replica, else 1 with the reason; --service NAME checks
                                                 one health service of a router or replica (TLS flags
                                                 as generate's) -- kvroute_tools.health
    kvroute bench [--trace F] [--target H:P]     replay a Mooncake trace through a running cluster per
                                                 routing policy and print the table -- kvroute_tools.bench

Argument errors exit 2 with the usage line; a command that cannot reach what it needs exits 1 (up,
generate, health) or 2 (bench) with one line saying why.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from kvroute_tools.trace import TRACE_BLOCK_TOKENS


def int_in(lo: int, hi: int):
    """An argparse ``type``: an int in ``[lo, hi]``, else the usage line and exit 2 naming the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    return parse


def _simulate(args: argparse.Namespace) -> int:
    from kvroute_tools.simulate.run import simulate_main

    return simulate_main(args)


def _replica(args: argparse.Namespace) -> int:
    from replica.server import main as replica_main

    return replica_main(args.passthrough, prog="kvroute replica")


def _router(args: argparse.Namespace) -> int:
    from router.server import main as router_main

    return router_main(args.passthrough, prog="kvroute router")


def _bridge(args: argparse.Namespace) -> int:
    from replica.bridge.service import main as bridge_main

    return bridge_main(args.passthrough, prog="kvroute bridge")


def _up(args: argparse.Namespace) -> int:
    from kvroute_tools.up import up_main

    return up_main(args.config, args.after)


def _generate(args: argparse.Namespace) -> int:
    from kvroute_tools.client import generate_main

    text = sys.stdin.read() if args.text == "-" else args.text
    return generate_main(
        args.target, text, chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature,
        cache_salt=args.cache_salt, ignore_eos=args.ignore_eos, seed=args.seed, timeout=args.timeout,
        credentials=args.credentials, server_name=args.tls_server_name,
    )


def _health(args: argparse.Namespace) -> int:
    from kvroute_tools.health import health_main

    return health_main(args.target, args.timeout, service=args.service, credentials=args.credentials,
                       server_name=args.tls_server_name)


def _check_health(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvroute_tools.client import parse_target

    try:
        parse_target(args.target)
    except ValueError as e:
        p.error(str(e))
    if not args.timeout > 0:
        p.error(f"--timeout: must be > 0, got {args.timeout}")
    _check_tls(p, args)


def _bench(args: argparse.Namespace) -> int:
    from kvroute_tools.bench.run import bench_main

    return bench_main(args.config)


def _check_simulate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvroute_tools.simulate.run import build_plan

    try:
        args.plan = build_plan(args)
    except (OSError, ValueError) as e:
        p.error(str(e))


def _check_up(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from pathlib import Path

    from kvroute_tools.cluster import ClusterConfig

    if args.model and not Path(args.model).expanduser().is_dir():
        what = "is not a folder" if Path(args.model).expanduser().exists() else "does not exist"
        p.error(f"--model: {args.model} {what} (a Hugging Face model folder)")
    try:
        args.config = ClusterConfig(
            replicas=args.replicas, routers=args.routers, host=args.host, router_port=args.router_port,
            base_port=args.base_port,
            router_http_port=args.router_http_port, replica_http_base_port=args.replica_http_base_port,
            redis_url=args.redis_url, redis_cluster=args.redis_cluster, namespace=args.namespace, model=args.model,
            model_cache_dir=args.model_cache_dir, kv_cache_memory_mb=args.kv_cache_memory_mb,
            num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
            torch_threads=args.torch_threads, replica_args=tuple(shlex.split(args.replica_args)),
            router_args=tuple(shlex.split(args.router_args)), log_dir=args.log_dir,
            ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout, metrics=args.metrics,
            keep_going=args.keep_going,
            gateway=args.gateway, gateway_port=args.gateway_port, engine=args.engine, vllm_python=args.vllm_python,
            vllm_args=tuple(shlex.split(args.vllm_args)),
            block_size=args.block_size,
        )
    except ValueError as e:
        p.error(str(e))


def _check_generate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvroute_tools.client import parse_target

    try:
        parse_target(args.target)
    except ValueError as e:
        p.error(str(e))
    if not args.text:
        p.error("text: must not be empty (pass the prompt, or - to read it from stdin)")
    if args.temperature is not None and not args.temperature >= 0:
        p.error(f"--temperature: must be >= 0, got {args.temperature}")
    if args.timeout is not None and args.timeout <= 0:
        p.error(f"--timeout: must be > 0, got {args.timeout}")
    _check_tls(p, args)


def _add_tls_flags(p: argparse.ArgumentParser, server: str) -> None:
    """The client TLS flags of generate and health (``server``: what they dial, for the help)."""
    p.add_argument("--tls-ca-file", default="", help=f"CA bundle (PEM) that verifies the {server}: set = TLS")
    p.add_argument("--tls-cert-file", default="", help=f"client certificate (PEM) for a {server} that requires mTLS")
    p.add_argument("--tls-key-file", default="", help="client private key (PEM) of --tls-cert-file")
    p.add_argument("--tls-server-name", default="",
                   help="the name the server's certificate is checked against (default: the --target host)")


def _check_tls(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.credentials`` from the TLS flags (kvroute.tls.channel_credentials); a half-set or
    unreadable one, or ``--tls-server-name`` without ``--tls-ca-file``, is a usage error naming the flag."""
    from kvroute.tls import channel_credentials

    if args.tls_server_name and not args.tls_ca_file:
        p.error("--tls-server-name: needs --tls-ca-file")
    try:
        args.credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except ValueError as e:  # the message names the settings: say the flags
        message = str(e)
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        p.error(message)


def _admin_token(path: str) -> str:
    """The router's admin token from ``--admin-token-file`` ("" when not given). Raises ValueError."""
    from kvroute.settings import read_secret_file

    return read_secret_file(path, "--admin-token-file") if path else ""


def _check_bench(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvroute_tools.bench.config import BenchConfig
    from kvroute_tools.client import parse_target
    from kvroute_tools.trace import BUNDLED_TRACE

    try:
        for target in args.target.split(","):
            parse_target(target.strip())
        args.config = BenchConfig(
            target=args.target, trace=args.trace or str(BUNDLED_TRACE), requests=args.requests,
            tokens_per_block=args.tokens_per_block, prompt_length=args.prompt_length, output_scale=args.output_scale,
            max_output_tokens=args.max_output_tokens, time_scale=args.time_scale, concurrency=args.concurrency,
            policies=tuple(s.strip() for s in args.policies.split(",")), interleave=args.interleave, out=args.out,
            request_timeout=args.request_timeout, progress=not args.no_progress, api=args.api,
            http_url=args.http_url, admin_token=_admin_token(args.admin_token_file),
        )
    except ValueError as e:
        p.error(str(e))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="Prefix-aware routing cluster for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)
    from kvroute.sampling import MAX_MAX_TOKENS, MAX_SEED
    from kvroute_tools.simulate.flags import add_arguments
    from router.policies.registry import ALL_POLICY_NAMES

    sim = sub.add_parser(
        "simulate", help="a whole cluster in virtual time: the router's and KV manager's code, a timing model",
        description="Replay a Mooncake trace through N simulated replicas (the real scheduler and KV cache "
                    "manager, step times from a timing model) routed by the real router, once per policy, and "
                    "print per policy: hit rate, share of the pooled oracle, TTFT, TPOT, queue, imbalance, "
                    "preemptions, decision time; with the ideal, pooled-LRU and round-robin oracles.",
    )
    add_arguments(sim, requests=None, replicas="16", policies=",".join(ALL_POLICY_NAMES))
    sim.set_defaults(func=_simulate, check=_check_simulate)
    d = sub.add_parser("demo", help="kvroute simulate with small defaults: 1,000 requests, 4 replicas, "
                                    "round_robin vs kvroute")
    add_arguments(d, requests=1000, replicas="4", policies="round_robin,kvroute")
    d.set_defaults(func=_simulate, check=_check_simulate, no_progress=True)
    # The replica's flags are declared by ReplicaSettings, which imports torch: they are parsed by
    # the replica itself (replica.server.main), so that `kvroute --help` stays torch-free.
    r = sub.add_parser("replica", add_help=False, help="run one replica (flags: kvroute replica --help)")
    r.set_defaults(func=_replica, passthrough=[])
    # Same for the router: its flags are RouterSettings', parsed by router.server.main.
    rt = sub.add_parser("router", add_help=False, help="run one router (flags: kvroute router --help)")
    rt.set_defaults(func=_router, passthrough=[])
    # And the bridge beside a stock vLLM server: BridgeSettings', parsed by replica.bridge.service.main.
    br = sub.add_parser("bridge", add_help=False,
                        help="run one bridge beside a vLLM server (flags: kvroute bridge --help)")
    br.set_defaults(func=_bridge, passthrough=[])

    u = sub.add_parser(
        "up", help="run redis + N replicas + a router on this machine until Ctrl-C",
        description="Start an embedded redis-server (unless --redis-url), N replicas and a router (or "
                    "--routers M) as child processes, wait until all are ready, print the endpoints, and stop "
                    "them all on Ctrl-C or SIGTERM. With `-- CMD ...` run CMD once ready ({target} in it becomes "
                    "the (first) router's host:port, {targets} every router's), then stop, exiting with CMD's "
                    "status.",
    )
    u.add_argument("--replicas", type=int, default=2, help="replica processes (default 2)")
    u.add_argument("--routers", type=int, default=1,
                   help="router processes on the one Redis, sharing their load (default 1); the first on "
                        "--router-port ({target}), the others on free ports ({targets}: all, comma-separated)")
    u.add_argument("--host", default="127.0.0.1", help="listen address of every process (default 127.0.0.1)")
    u.add_argument("--router-port", type=int, default=50050, help="the router's port (default 50050; 0 = free)")
    u.add_argument("--router-http-port", type=int, default=0,
                   help="the router's OpenAI-compatible HTTP API ({http_url}; default 0: a free port; -1: off)")
    u.add_argument("--base-port", type=int, default=0, help="replica i on BASE+i (default 0: free ports)")
    u.add_argument("--replica-http-base-port", type=int, default=0,
                   help="replica i also serves the OpenAI HTTP API and /metrics on BASE+i (default 0: off)")
    u.add_argument("--redis-url", default="", help="use this Redis instead of an embedded redis-server")
    u.add_argument("--redis-cluster", action="store_true",
                   help="--redis-url is a seed of a Redis Cluster (or Valkey cluster); a comma-separated"
                        " --redis-url of several seeds implies it (docs/settings.md)")
    u.add_argument("--namespace", default="default", help="Redis key namespace of the cluster")
    u.add_argument("--model", default="", help="model folder (default: the generated default model)")
    u.add_argument("--model-cache-dir", default="", help="where the default model lives (~/.cache/kvroute/models)")
    u.add_argument("--kv-cache-memory-mb", type=int, default=None, help="KV cache budget per replica on CPU, MiB")
    u.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (overrides the budget)")
    u.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per engine step")
    u.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica (default 1)")
    u.add_argument("--replica-args", default="", help="more replica flags, one string (kvroute replica --help)")
    u.add_argument("--router-args", default="", help="more router flags, one string (kvroute router --help)")
    u.add_argument("--metrics", action="store_true",
                   help="a Prometheus /metrics endpoint on every replica and the router (free ports, printed with "
                        "the endpoints)")
    u.add_argument("--log-dir", default="", help="where each process's log goes (default: a new temp folder)")
    u.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    u.add_argument("--keep-going", action="store_true",
                   help="when a replica dies, log it and keep serving with the others (default: stop the whole "
                        "cluster, exit 1); the cluster still stops when no replica is left or Redis, the router "
                        "or Envoy dies")
    u.add_argument("--stop-timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    u.add_argument("--gateway", choices=("proxy", "envoy"), default="proxy",
                   help="the cluster's front: the router's Python proxy (default), or a real Envoy with the router "
                        "as its endpoint picker ({target} becomes Envoy's listener)")
    u.add_argument("--gateway-port", type=int, default=0, help="--gateway envoy: Envoy's listener port (default 0: free)")
    u.add_argument("--engine", choices=("kvroute", "vllm"), default="kvroute",
                   help="the replicas: kvroute's engine (default), or stock vLLM servers with kvroute bridge beside "
                        "each (vLLM from --vllm-python, KVROUTE_VLLM_PYTHON or .venv-vllm: make vllm)")
    u.add_argument("--vllm-python", default="", help="--engine vllm: the python that has vllm installed")
    u.add_argument("--vllm-args", default="",
                   help="--engine vllm: more vLLM server flags, one string (e.g. \"--max-model-len 4096 --dtype float32\")")
    u.add_argument("--block-size", type=int, default=None,
                   help="KV block size of every replica and the router (default 16; 32 with --engine vllm)")
    u.set_defaults(func=_up, check=_check_up, after=[])

    g = sub.add_parser("generate", help="stream one generation from a router",
                       description="Send one prompt to a router (GenerationService.GenerateStream), print the "
                                   "text as it streams, then one line: finish reason, usage, routing.")
    g.add_argument("text", help="the prompt (- reads it from stdin)")
    g.add_argument("--target", default="127.0.0.1:50050", help="the router, HOST:PORT (default 127.0.0.1:50050)")
    g.add_argument("--chat", action="store_true", help="send the text as one user message (chat template)")
    g.add_argument("--max-tokens", type=int_in(1, MAX_MAX_TOKENS), default=32,
                   help="tokens to generate at most (default 32)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the engine's, 1.0)")
    g.add_argument("--seed", type=int_in(0, MAX_SEED), default=None, help="per-request sampling seed")
    g.add_argument("--cache-salt", default="", help="prefix-cache isolation key (tenant)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--timeout", type=float, default=60.0, help="deadline of the call, seconds (default 60)")
    _add_tls_flags(g, "router")
    g.set_defaults(func=_generate, check=_check_generate)

    h = sub.add_parser("health", help="exit 0 when a router is ready and has a routable replica",
                       description="Check a router: grpc.health.v1 readiness must be SERVING and RouterService.Score "
                                   "must list at least one routable replica. Prints one line; exit 0 when healthy, "
                                   "1 otherwise (the line says why). The chart's `helm test`.")
    h.add_argument("--target", default="127.0.0.1:50050", help="the router, HOST:PORT (default 127.0.0.1:50050)")
    h.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds (default 5)")
    h.add_argument("--service", default="",
                   help="check only this grpc.health.v1 service name (readiness, liveness) of a router or replica: "
                        "exit 0 when SERVING (the chart's probes over TLS)")
    _add_tls_flags(h, "router or replica")
    h.set_defaults(func=_health, check=_check_health)

    b = sub.add_parser(
        "bench", help="replay a Mooncake trace through a running cluster, per routing policy",
        description="Replay a Mooncake-format trace through the router at --target once per policy (switched "
                    "with RouterService.SetPolicy, each run with its own cache_salt) and print one table: "
                    "requests, errors, prefix cache hit rate (the replicas' counters), TTFT p50/p99, TPOT p50, "
                    "requests per replica, and the bounds computed from the trace's hash ids.",
    )
    b.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the bundled FAST'25 trace)")
    b.add_argument("--target", default="127.0.0.1:50050",
                   help="the router, HOST:PORT (default 127.0.0.1:50050), or several comma-separated (kvroute up "
                        "--routers: {targets}): request i goes to the (i mod n)-th")
    b.add_argument("--requests", type=int, default=1000, help="the first N trace requests (default 1000)")
    b.add_argument("--tokens-per-block", type=int, default=TRACE_BLOCK_TOKENS,
                   help="tokens per 512-token trace block (default %(default)s, the trace's own; fewer scale the replay down to a small model, as make run does with 16)")
    b.add_argument("--prompt-length", default="input_length", choices=("input_length", "hash_ids"),
                   help="each prompt is the trace's input_length scaled by --tokens-per-block / 512 (default), "
                        "or len(hash_ids) x --tokens-per-block: every hash id a whole block, as "
                        "the harness the peer routers were measured with builds them")
    b.add_argument("--output-scale", type=float, default=0.02,
                   help="output tokens = max(1, round(output_length * S)) (default 0.02)")
    b.add_argument("--max-output-tokens", type=int, default=256, help="cap on output tokens (default 256)")
    b.add_argument("--time-scale", type=float, default=None,
                   help="open loop: send each request at timestamp * X (default: closed loop)")
    b.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: C requests in flight (default 8); with --time-scale, a cap")
    b.add_argument("--policies", default="kvroute,round_robin", help="comma-separated (default kvroute,round_robin)")
    b.add_argument("--interleave", type=int, default=0,
                   help="policies take turns every N requests, so that drift on the machine hits all alike "
                        "(default 0: each policy replays the whole trace in turn)")
    b.add_argument("--out", default=None, help="write bench.json and bench.png into this folder")
    b.add_argument("--request-timeout", type=float, default=300.0, help="deadline per request, seconds")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--admin-token-file", default="",
                   help="file holding the router's admin token, sent with SetPolicy (kvroute up: {admin_token_file})")
    b.add_argument("--api", default="grpc", choices=("grpc", "openai"),
                   help="send the replay over gRPC (default) or the router's OpenAI-compatible HTTP API")
    b.add_argument("--http-url", default="", help="with --api openai: the router's HTTP API, http://HOST:PORT/v1")
    b.set_defaults(func=_bench, check=_check_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    after: list[str] = []
    if argv[:1] == ["up"] and "--" in argv:  # `kvroute up [flags] -- CMD ...`
        i = argv.index("--")
        argv, after = argv[:i], argv[i + 1:]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.func in (_replica, _router, _bridge):
        args.passthrough = rest
    elif rest:
        sub_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(rest)}")
    if args.func is _up:
        args.after = after
    check = getattr(args, "check", None)
    if check is not None:
        check(sub_parser(parser, args.command), args)
    return args.func(args)


def sub_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand's parser, so that its errors print its own usage line."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[name]
    return parser


if __name__ == "__main__":
    sys.exit(main())
