"""``kvroute bench``'s run: replay a Mooncake-format trace through a running cluster, once per routing
policy, and report what each policy achieved (DESIGN.md §7).

    trace lines ──TraceTokenizer──▶ prompts (hash id -> fixed block of tokens: equal ids, equal prefixes)
       │                            max_tokens = max(1, round(output_length * output_scale)), capped; ignore_eos
       ▼
    for each policy:  RouterService.SetPolicy(policy)
                      ReplicaService.GetLoad on every replica  (prefix-cache counters before)
                      GenerationService.GenerateStream x N     (cache_salt unique to this run and policy;
                                                                open loop at timestamp * time_scale,
                                                                or closed loop at a concurrency)
                      ReplicaService.GetLoad on every replica  (counters after)
    table: requests, errors, hit rate = delta hits / delta queries (tokens, the replicas' own
           counters), TTFT p50/p99 and TPOT p50 (client side), requests per replica; next to it the
           bounds computed from the hash ids alone (kvroute_tools.trace.hit_rate_bounds)

Policies can take turns (``--interleave N``: N requests under one, the same N under the next, then
the next N, ...), so that drift in the machine's load (neighbours, thermal, a noisy CI box) hits
every policy alike, as bench/replica.py alternates its cells. Each policy still sees the whole
trace in order, with its own salt, so its hit rate is what a run alone would get as long as the
replicas' KV caches hold both working sets; only its pipeline drains at each turn.

Why a salt per policy: the salt enters block 0's hash (DESIGN.md §2), so the runs share no KV
block: the second policy can never hit what the first one cached, and a later bench against the
same cluster (a fresh random run id) cannot hit this one's. Other traffic on the cluster during the
run is counted in the replicas' counters; bench on a cluster nobody else uses.

Several routers (``--target a,b``: routers splitting one stream, as ``kvroute up --routers``
starts them): request i goes to the (i mod n)-th, every router gets the SetPolicy, and they must
agree on the routable replicas before the run starts.

Replica addresses come from ``RouterService.Score`` (every replica the router knows, with the
address it dials). When a replica cannot be reached from here (say, the cluster is behind a
Kubernetes Service), the hit rate falls back to the responses' usage: cached / prompt tokens.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvroute.counted import counted
from kvroute.responses import MD_PREDICTED, MD_REPLICA
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from kvroute_tools.bench.config import BenchConfig
from kvroute_tools.bench.openai_send import OpenAISender
from kvroute_tools.bench.plan import PlannedRequest, hit_bounds, plan_requests, routed_past
from kvroute_tools.bench.report import BenchReport, PolicyResult, RequestResult, format_report, write_outputs
from kvroute_tools.client import describe_rpc_error
from kvroute_tools.trace import TraceTokenizer, load_mooncake

_RPC_TIMEOUT_S = 10.0


class BenchError(Exception):
    """The bench cannot run (the message says why and names the flag or the target)."""


class _Cluster:
    """The routers' stubs (``targets``: request i goes to the (i mod n)-th) and the replicas'
    (addresses from the first router's ``Score``)."""

    def __init__(self, targets: Sequence[str], openai: OpenAISender | None = None, admin_token: str = ""):
        self.targets = list(targets)
        self._admin = (("authorization", f"Bearer {admin_token}"),) if admin_token else ()
        self.channels = [grpc.aio.insecure_channel(t) for t in self.targets]
        self.gens = [gen_grpc.GenerationServiceStub(ch) for ch in self.channels]
        self.routers = [router_grpc.RouterServiceStub(ch) for ch in self.channels]
        self._replica_channels: dict[str, grpc.aio.Channel] = {}
        self.openai = openai  # --api openai: the requests go there (SetPolicy and counters stay gRPC)
        self.model = ""
        self.policies = [""] * len(self.targets)  # each router's active policy, as last read or set

    @property
    def gen(self) -> gen_grpc.GenerationServiceStub:
        """The first router's GenerationService (model info)."""
        return self.gens[0]

    def gen_for(self, p: PlannedRequest) -> gen_grpc.GenerationServiceStub:
        """The router request ``p`` is sent to: the routers take turns, request by request."""
        return self.gens[p.index % len(self.gens)]

    async def close(self) -> None:
        if self.openai is not None:
            await self.openai.close()
        for ch in [*self.channels, *self._replica_channels.values()]:
            await ch.close(grace=None)

    async def replicas(self) -> tuple[dict[str, str], list[str], list[str]]:
        """(routable replica_id -> address, every known replica line, each router's current policy),
        from every router's ``Score``.

        Raises:
            BenchError: two routers do not see the same routable replicas.
        """
        request = router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=[0]))
        views = []
        for target, stub in zip(self.targets, self.routers, strict=True):
            try:
                views.append(await stub.Score(request, timeout=_RPC_TIMEOUT_S))
            except grpc.aio.AioRpcError as e:
                raise BenchError(describe_rpc_error(e, target)) from e
        resp = views[0]
        routable = {r.replica_id: r.address for r in resp.replicas if r.routable}
        for target, other in zip(self.targets[1:], views[1:], strict=True):
            theirs = {r.replica_id: r.address for r in other.replicas if r.routable}
            if theirs != routable:
                raise BenchError(f"the routers at {self.targets[0]} and {target} route to different replicas "
                                 f"({', '.join(sorted(routable)) or 'none'} against {', '.join(sorted(theirs)) or 'none'})")
        lines = [f"{r.replica_id} {r.address} {'routable' if r.routable else 'NOT routable: ' + r.reason}"
                 for r in resp.replicas]
        self.policies = [v.policy for v in views]
        return dict(sorted(routable.items())), lines, list(self.policies)

    async def set_policy(self, name: str) -> None:
        """Make ``name`` every router's policy."""
        await self.set_policies([name] * len(self.targets))

    async def set_policies(self, names: Sequence[str]) -> None:
        """Make ``names[k]`` router k's policy: no call (so no admin token needed) to a router whose
        policy it already is.

        Raises:
            BenchError: a router refused (the message names it, and the admin token when that is why).
        """
        for k, (target, stub, name) in enumerate(zip(self.targets, self.routers, names, strict=True)):
            if self.policies[k] == name:
                continue
            try:
                resp = await stub.SetPolicy(router_pb.SetPolicyRequest(policy=name), timeout=_RPC_TIMEOUT_S,
                                            metadata=self._admin)
            except grpc.aio.AioRpcError as e:
                hint = ("; pass --admin-token-file (kvroute up: {admin_token_file})"
                        if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) else "")
                raise BenchError(f"{describe_rpc_error(e, target)}{hint}") from e
            self.policies[k] = resp.policy

    async def counters(self, replicas: dict[str, str]) -> dict[str, rep_pb.Load | None]:
        """Each replica's Load (None where it cannot be reached from here)."""

        async def one(address: str) -> rep_pb.Load | None:
            ch = self._replica_channels.get(address)
            if ch is None:
                ch = self._replica_channels[address] = grpc.aio.insecure_channel(address)
            try:
                return await rep_grpc.ReplicaServiceStub(ch).GetLoad(rep_pb.GetLoadRequest(), timeout=3.0)
            except grpc.aio.AioRpcError:
                return None

        loads = await asyncio.gather(*(one(a) for a in replicas.values()))
        return dict(zip(replicas, loads, strict=True))


async def _send(cluster: _Cluster, p: PlannedRequest, salt: str, run_id: str, timeout: float) -> RequestResult:
    if cluster.openai is not None:
        return await cluster.openai.send(p, salt, cluster.model, timeout)
    req = gen_pb.GenerateRequest(
        request_id=f"bench-{run_id}-{p.index}",
        token_ids=gen_pb.TokenIds(ids=p.token_ids),
        sampling=gen_pb.SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True),
        cache_salt=salt,
    )
    res = RequestResult(p.index)
    t0 = time.perf_counter()
    first = last = None
    final = None
    try:
        call = cluster.gen_for(p).GenerateStream(req, timeout=timeout)
        async for resp in call:
            now = time.perf_counter()
            if resp.token_ids:
                first = first if first is not None else now
                last = now
            if resp.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                final = resp
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"
        return res
    res.latency_s = time.perf_counter() - t0
    if final is None:
        res.error = "the stream ended without a final message"
        return res
    u = final.usage
    res.measured(t0, first, last, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    res.replica_id = final.routing.replica_id
    res.predicted_cached_tokens = final.routing.predicted_cached_tokens
    if not res.replica_id:  # behind a gateway the picker reports the pick in the trailers instead
        md = dict(await call.trailing_metadata() or ())
        res.replica_id = md.get(MD_REPLICA, "")
        res.predicted_cached_tokens = int(md.get(MD_PREDICTED, "0") or 0)
    return res


class _Progress:
    """One tqdm bar per policy (stacked), or nothing."""

    def __init__(self, policies: Sequence[str], total: int, enabled: bool):
        self.bars: dict[str, Any] = {}
        if enabled:
            from tqdm import tqdm

            width = max(map(len, policies))
            # Stacked bars move the cursor; into a log file (not a terminal) each bar just prints a
            # line now and then instead.
            tty = sys.stderr.isatty()
            self.bars = {
                name: tqdm(total=total, desc=f"{name:<{width}}", unit="req", file=sys.stderr,
                           position=k if tty else None, dynamic_ncols=tty, mininterval=0.5 if tty else 15.0,
                           leave=True)
                for k, name in enumerate(policies)
            }

    def update(self, policy: str, errors: int) -> None:
        bar = self.bars.get(policy)
        if bar is not None:
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors, refresh=False)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


@dataclass
class _PolicyRun:
    """What one policy has accumulated over its segments."""

    policy: str
    salt: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    counters: dict[str, int | None] = field(
        default_factory=lambda: {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "preemptions": 0}
    )

    def add_counters(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        for attr, total in self.counters.items():
            d = _delta(before, after, attr)
            self.counters[attr] = None if d is None or total is None else total + d

    def result(self) -> PolicyResult:
        return PolicyResult(
            policy=self.policy, cache_salt=self.salt, wall_s=self.wall_s,
            results=sorted(self.results, key=lambda r: r.index), **self.counters,
        )


async def _run_segment(
    cluster: _Cluster, planned: Sequence[PlannedRequest], run: _PolicyRun, run_id: str, cfg: BenchConfig,
    progress: _Progress,
) -> list[RequestResult]:
    """Release each request at its arrival time (relative to the segment's first) and/or when a
    concurrency slot frees up; return when all have ended."""
    limit = cfg.effective_concurrency
    sem = asyncio.Semaphore(limit) if limit else None

    async def one(p: PlannedRequest) -> RequestResult:
        try:
            res = await _send(cluster, p, run.salt, run_id, cfg.request_timeout)
        finally:
            if sem is not None:
                sem.release()
        run.results.append(res)
        progress.update(run.policy, sum(1 for r in run.results if r.error))
        return res

    loop = asyncio.get_running_loop()
    start = loop.time()
    t_first = planned[0].arrival_s if planned else 0.0
    tasks = []
    try:
        for p in planned:
            delay = start + (p.arrival_s - t_first) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            tasks.append(asyncio.create_task(one(p)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def _delta(before: dict[str, Any], after: dict[str, Any], attr: str) -> int | None:
    if any(v is None for v in (*before.values(), *after.values())):
        return None
    return sum(getattr(after[k], attr) - getattr(before[k], attr) for k in after)


async def run_bench(cfg: BenchConfig, log=print) -> BenchReport:
    """Replay the trace once per policy through the router at ``cfg.target`` (in alternating
    segments of ``cfg.interleave`` requests when set).

    Raises:
        BenchError: the router cannot be reached, has no routable replica, or refuses a policy;
            the trace cannot be read.
    """
    try:
        trace = load_mooncake(cfg.trace, limit=cfg.requests)
    except FileNotFoundError as e:
        raise BenchError(f"--trace: no such file {cfg.trace!r}") from e
    except ValueError as e:
        raise BenchError(f"--trace: {e}") from e
    if not trace:
        raise BenchError(f"--trace: {cfg.trace} holds no request")
    cluster = _Cluster(cfg.targets, OpenAISender(cfg.http_url) if cfg.api == "openai" else None, cfg.admin_token)
    try:
        try:
            info = await cluster.gen.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise BenchError(describe_rpc_error(e, cfg.targets[0])) from e
        cluster.model = info.model
        replicas, lines, original_policies = await cluster.replicas()
        if not replicas:
            known = "; ".join(lines) or "none"
            raise BenchError(f"the router at {cfg.targets[0]} has no routable replica (known: {known})")
        for policy in cfg.policies:  # refuse an unknown policy before anything runs
            try:
                await cluster.set_policy(policy)
            except BenchError as e:
                raise BenchError(f"--policies: {e}") from e

        whole_blocks = cfg.prompt_length == "hash_ids"
        tok = TraceTokenizer(cfg.tokens_per_block, vocab_size=info.vocab_size, whole_blocks=whole_blocks)
        planned, truncated = plan_requests(
            trace, tok, output_scale=cfg.output_scale, max_output_tokens=cfg.max_output_tokens,
            time_scale=cfg.time_scale, max_model_len=info.max_model_len,
        )
        report = BenchReport(
            config=cfg, model=info.model, block_size=info.block_size, replicas=replicas,
            bounds=hit_bounds(trace, len(replicas), tokens_per_block=cfg.tokens_per_block,
                              block_size=info.block_size, whole_blocks=whole_blocks), num_requests=len(planned),
            prompt_tokens=sum(len(p.token_ids) for p in planned), truncated=truncated,
        )
        run_id = secrets.token_hex(4)
        log(f"kvroute bench: {counted(len(planned), 'request')} of {cfg.trace} ({report.prompt_tokens:,} prompt tokens, "
            f"{cfg.tokens_per_block} per trace block{', every hash id whole' if whole_blocks else ''}; {sum(p.max_tokens for p in planned):,} output tokens) "
            f"through {cfg.target}: model {info.model}, {counted(len(replicas), 'replica')}; {cfg.mode}; run id {run_id}")
        if cfg.tokens_per_block % info.block_size:
            log(f"note: --tokens-per-block {cfg.tokens_per_block} is not a multiple of the KV block size "
                f"{info.block_size}, so trace blocks and KV blocks do not line up; the bounds are looser")
        if whole_blocks and not cfg.tokens_per_block % info.block_size:
            log(f"note: the bounds count whole KV blocks of {info.block_size} with the last prompt token "
                "recomputed (the engine's lookup rule)")
        if truncated:
            log(f"note: {counted(truncated, 'prompt')} {'was' if truncated == 1 else 'were'} cut to the model's max_model_len {info.max_model_len}")
        runs = [_PolicyRun(p, f"kvroute-bench:{run_id}:{p}") for p in cfg.policies]
        step = cfg.interleave or len(planned)
        progress = _Progress(cfg.policies, len(planned), cfg.progress)
        try:
            for a in range(0, len(planned), step):
                for run in runs:
                    await cluster.set_policy(run.policy)
                    before = await cluster.counters(replicas)
                    t0 = time.perf_counter()
                    await _run_segment(cluster, planned[a:a + step], run, run_id, cfg, progress)
                    run.wall_s += time.perf_counter() - t0
                    run.add_counters(before, await cluster.counters(replicas))
        finally:
            progress.close()
            try:
                await cluster.set_policies([p or cluster.policies[k] for k, p in enumerate(original_policies)])
            except BenchError as e:
                log(f"warning: could not restore the routers' policies {', '.join(original_policies)}: {e}")
        report.policies = [run.result() for run in runs]
        for p in report.policies:
            p.routed_past = routed_past([planned[r.index].token_ids for r in p.results],
                                        ["" if r.error else r.replica_id for r in p.results], info.block_size)
        return report
    finally:
        await cluster.close()


def bench_main(cfg: BenchConfig) -> int:
    """``kvroute bench``: 0 when every request succeeded, 1 when some failed, 2 when it cannot run,
    130 on Ctrl-C."""
    try:
        report = asyncio.run(run_bench(cfg, log=lambda s: print(s, flush=True)))
    except BenchError as e:
        print(f"kvroute bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvroute bench: interrupted", file=sys.stderr)
        return 130
    print()
    print(format_report(report), flush=True)
    if cfg.out:
        json_path, png_path = write_outputs(report, cfg.out)
        print(f"wrote {json_path} and {png_path}")
    return 1 if any(p.errors for p in report.policies) else 0


__all__ = ["BenchError", "bench_main", "run_bench"]
