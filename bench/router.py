"""Router benchmark: the routing decision, event ingest, index memory and the proxy's added latency,
in one table with a verdict per goal.

    python bench/router.py [--decisions 2000] [--replicas 64,256,1024] [--requests 300]
                           [--skip-proxy | --proxy-only] [--bare aio,sync-st] [--no-envoy]

The decision, memory and ingest rows come once per replica count (``--replicas``; 64, 256 and
1,024 by default):

- **decision overhead** (hash + lookup + score: ``Router.decide``) for 8k-token prompts. The index
  is built directly with ``BlockIndex.add``: as many shared documents of 8,192 tokens as replicas;
  each replica holds a random-length prefix (0-512 blocks) of 16 of them (so a document's prefixes
  are on 16 replicas on average, at every size), plus random blocks up to 1M / replicas entries
  (1M entries at 64 replicas, about 1.1M at 256 and 4.2M at 1,024, where the prefixes alone pass
  1M). Each request is a random document's first 8,176 tokens plus 16 fresh ones (512 blocks, the
  last one new), so lookups walk long shared chains; every block of every prompt is hashed (the
  router keeps no memo of earlier prompts: the compiled hash chain, ``BlockHasher.implementation``,
  hashes a block faster than a memo's dict walk finds it). Every replica is routable and scored.
  Goal: CPU p50 <= 0.25 ms at 64 replicas and <= 1 ms at 1,024 (none at 256), with sha256_cbor
  (the default); xxhash_cbor is printed for reference at the first size.
- **index memory per entry**: the bytes of that index / its (replica, block) entries: tracemalloc's
  traced bytes while it is built (Python objects) plus what its compiled tables hold, counted by
  the tables themselves (C allocations, which tracemalloc does not see). Goal: <= 64 B.
- **event ingest**, in block hashes per second on one core: through the consumer's apply path
  (``IndexFeed.entry``: the ordering rules, protobuf decode of a ``KVEventBatch`` + the index calls
  under the index lock; batches of one ``BlockStored`` of 64 blocks with their token ids, as
  replicas publish them, dealt to the replicas in turn) and, for reference, through
  ``BlockIndex.add`` alone (64 hashes per call). Goal: >= 2M/s on the apply path.
- **proxy added latency**: ``python -m replica`` and ``python -m router`` as child processes (one
  Redis), a client here; the same 64-token prompt (warm in the prefix cache), 8 output tokens,
  sent in turn to the replica's GenerationService, to the router's, and to each bare pass-through
  named by ``--bare`` (``bench/_passthrough.py``, run as this file's ``--passthrough``: one server
  handler forwarding to one client call, nothing else; designs in ``BARE_VARIANTS``) -- the floor of that kind of Python gRPC hop on
  this machine. Added = p50(side) - p50(direct), for the time to the first token and for the whole
  request. Goal: <= 1 ms at p50.
- **Envoy in front** (unless ``--no-envoy``; bench/_gateway.py), in the same turns: the time to
  first token added by (a) Envoy alone (the client names the replica in the destination header),
  (b) Envoy + the kvroute endpoint picker (``kvroute up --gateway envoy``'s bootstrap), (c) the
  Python proxy, and, when ``node`` is on PATH, (b0) the same Envoy with a fixed-answer ext_proc
  server in compiled HTTP/2 (bench/_ext_proc_floor.js: no routing, no Python), the floor of (b) for
  any picker on this machine; then the router process's CPU seconds per 1,000 streamed requests through (b) and
  (c), net of its idle rate, at 8 output tokens (the verdict) and at ``LONG_TOKENS`` (the proxy's
  cost grows with every streamed delta, the picker's does not). Goals: (b) adds <= 1 ms p50; (b)
  costs the router >= 3x less than (c).
- **HTTP front vs gRPC front**: in the same run and the same turns, the same prompt (as token ids)
  through the router's OpenAI-compatible API (``POST /v1/completions``, streamed, one kept-alive
  ``http.client`` connection; TTFT at the first ``data:`` event of a token) against its gRPC front:
  TTFT and whole-request p50 / p99 of each, and the HTTP front's difference.

Why the router stays on grpc.aio: every Python hop adds, per message, one more loopback write and
the wake-up of a thread in another process, plus grpc's own thread handoffs inside the proxy (aio:
event-engine thread -> poller thread -> event loop; sync-st: event-engine thread -> handler thread);
with the replica computing on a core of a small machine, every wake-up waits for a core. The
``--bare`` designs measure that floor side by side with the router (docs/results.md keeps the results):
sync-st is cheaper than aio at TTFT, but it serves each stream on a pool thread (long LLM streams x
threads x one GIL). The router's own share before the upstream call is itemised in router/proxy.py.

Verdicts on the decision and the ingest use the benchmark thread's CPU time (``time.thread_time``:
"on one core"), so that neighbours on a shared machine do not decide them; the decision's wall time
(p50 / p99, and its hash / lookup / score split at p50) is shown next to it. The proxy's added
latency can only be wall time: a note is printed when other processes kept cores busy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench._common import busy_cores, print_table  # noqa: E402
from bench._gateway import router_cpu_per_1000, start_gateways  # noqa: E402
from bench._http_front import HttpStream  # noqa: E402
from bench._passthrough import BARE_VARIANTS, passthrough  # noqa: E402
from kvroute.events import BlockStored, encode_batch  # noqa: E402
from kvroute.hashing import BlockHasher  # noqa: E402
from kvroute.heartbeat import Heartbeat  # noqa: E402
from kvroute.v1 import generation_pb2 as gen_pb  # noqa: E402
from kvroute.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402
from kvroute_tools.redis_server import RedisServer, free_port  # noqa: E402
from kvroute_tools.supervise import wait_serving  # noqa: E402
from router.consumer_feed import IndexFeed  # noqa: E402
from router.core import Router  # noqa: E402
from router.index import BlockIndex  # noqa: E402
from router.load import LoadTracker  # noqa: E402
from router.policies.registry import make_policy  # noqa: E402
from router.registry import ReplicaRegistry  # noqa: E402

B = 16
PROMPT_TOKENS = 8192
REPLICA_COUNTS = (64, 256, 1024)
NUM_ENTRIES = 1_000_000  # at least: past that, the replicas' document prefixes alone
DOCS_PER_REPLICA = 16  # as many documents as replicas: a document's prefixes are on 16 replicas, on average
VOCAB = 32000
GOAL_P50_MS = {64: 0.25, 1024: 1.0}  # decision CPU p50 by replica count (none set at 256)
GOAL_INGEST = 2_000_000  # block hashes per second on one core, the consumer's apply path
GOAL_BYTES_PER_ENTRY = 64
GOAL_ADDED_MS = 1.0
LONG_TOKENS = 64  # the router CPU row at a longer output (n // 3 requests per side, at least 50)
ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def replica_name(r: int) -> str:
    return f"r{r:04d}"


def heartbeat(rid: str, i: int, hasher: BlockHasher) -> Heartbeat:
    algorithm, digest, block_size = hasher.identity
    return Heartbeat.from_redis({
        "replica_id": rid, "address": f"10.0.{i // 250}.{i % 250}:50051", "epoch": "1", "last_seq": "0",
        "model": "m", "block_size": str(block_size), "hash_algorithm": algorithm, "hash_seed_digest": digest,
        "num_blocks": "100000", "free_blocks": "50000", "running": str(i % 7), "waiting": "0",
        "usage": "0.5", "queued_prefill_tokens": str(100 * (i % 5)), "ts": "0",
    })


def build_index(rng: random.Random, docs_hashes: list[list[int]], num_replicas: int) -> tuple[BlockIndex, int]:
    """``num_replicas`` replicas, each holding a random-length prefix of ``DOCS_PER_REPLICA`` of the
    documents, topped up with random blocks to ``NUM_ENTRIES / num_replicas``: (index, entries)."""
    index = BlockIndex(speculative_ttl=2.0)
    per_replica = NUM_ENTRIES // num_replicas
    total = 0
    for r in range(num_replicas):
        rid = replica_name(r)
        held = 0
        for d in rng.sample(range(len(docs_hashes)), DOCS_PER_REPLICA):
            n = rng.randrange(0, len(docs_hashes[d]) + 1)
            index.add(rid, docs_hashes[d][:n])
            held += n
        filler = [rng.getrandbits(64) for _ in range(max(per_replica - held, 0))]
        for k in range(0, len(filler), 64):
            index.add(rid, filler[k:k + 64])
        total += held + len(filler)
    return index, total


@dataclass
class DecisionRun:
    """One replica count's decisions: timings in ms by part, the hash implementation, and the
    index they looked up (its entries, its bytes per entry)."""

    timings: dict[str, list[float]]
    implementation: str
    entries: int
    bytes_per_entry: float
    table_bytes: int


def bench_decisions(algorithm: str, n: int, rng: random.Random, num_replicas: int) -> DecisionRun:
    """``n`` decisions over one index of ``num_replicas`` replicas. Every prompt gets a fresh last
    block, drawn before its timer starts. The index's memory is measured as it is built:
    tracemalloc's traced bytes (Python objects) plus what its compiled tables hold (C allocations,
    which tracemalloc does not see)."""
    hasher = BlockHasher(algorithm)
    tokens = range(VOCAB)
    docs = [rng.choices(tokens, k=PROMPT_TOKENS) for _ in range(num_replicas)]
    docs_hashes = [hasher.event_ints(d) for d in docs]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index, entries = build_index(rng, docs_hashes, num_replicas)
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    table = index.table_bytes()
    registry = ReplicaRegistry(hasher.identity, "redis")
    for i in range(num_replicas):
        registry.update_from_heartbeat(heartbeat(replica_name(i), i, hasher), now=0.0)
    router = Router(hasher, index, registry, LoadTracker(), make_policy("kvroute", seed=0))
    timings: dict[str, list[float]] = {k: [] for k in ("hash", "lookup", "score", "total", "cpu")}
    for i in range(-16, n):  # 16 warm-up decisions
        prompt = rng.choice(docs)[: PROMPT_TOKENS - B] + rng.choices(tokens, k=B)
        c0 = time.thread_time()
        d = router.decide(prompt)
        cpu = (time.thread_time() - c0) * 1e3
        if i < 0:
            continue
        timings["cpu"].append(cpu)
        for k in ("hash", "lookup", "score", "total"):
            timings[k].append(d.timings[k] * 1e3)
    return DecisionRun(timings, hasher.implementation, entries, (traced + table) / entries, table)


def bench_ingest(rng: random.Random, num_replicas: int, total_blocks: int = 1_000_000,
                 per_event: int = 64) -> tuple[float, float]:
    """(consumer apply path, BlockIndex.add alone) in block hashes per second, the batches dealt to
    ``num_replicas`` replicas in turn."""
    batches = []
    tokens = range(VOCAB)
    for k in range(total_blocks // per_event):
        hashes = tuple(rng.getrandbits(64) for _ in range(per_event))
        batches.append((replica_name(k % num_replicas), hashes,
                        encode_batch([BlockStored(hashes, None, rng.choices(tokens, k=per_event * B), B)],
                                     time.time())))
    registry = ReplicaRegistry(BlockHasher().identity, "redis")
    feed = IndexFeed(BlockIndex(), registry, threading.Lock())
    t0 = time.thread_time()
    for k, (rid, _, data) in enumerate(batches):  # each replica's entries in seq order
        feed.entry(rid, 1, k // num_replicas + 1, data, history=False)
    apply_rate = feed.blocks_applied / (time.thread_time() - t0)
    index = BlockIndex()
    t0 = time.thread_time()
    for rid, hashes, _ in batches:
        index.add(rid, hashes)
    add_rate = len(batches) * per_event / (time.thread_time() - t0)
    return apply_rate, add_rate


# -- the proxy -------------------------------------------------------------------------------------------
def start(args: list[str], target: str, what: str, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_serving(target, proc, what, details=log.read_text)
    return proc


def timed_stream(stub: gen_grpc.GenerationServiceStub, request: gen_pb.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft = None
    for _ in stub.GenerateStream(request, timeout=30, metadata=metadata):
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0


def bench_proxy(n: int, tmp: Path, bare_variants: Sequence[str], gateways: bool
                ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """({side_ttft | side_total: milliseconds per request} for side = direct, routed (the router's gRPC
    front), routed-http (its OpenAI HTTP front), bare-VARIANT...,
    and with ``gateways`` envoy and picker (bench/_gateway.py); {side: router CPU s per 1,000 requests}
    for routed and picker (empty without ``gateways``)."""
    with RedisServer() as redis_server:
        rport, xport, hport, pport = free_port(), free_port(), free_port(), free_port()
        replica = start(["-m", "replica", "--port", str(rport), "--redis-url", redis_server.url, "--replica-id",
                         "bench-replica", "--model-cache-dir", str(tmp), "--num-blocks", "512", "--torch-threads",
                         "1", "--heartbeat-interval", "0.5"], f"127.0.0.1:{rport}", "replica", tmp / "replica.log")
        procs: list[subprocess.Popen] = []
        try:
            procs.append(start(["-m", "router", "--port", str(xport), "--http-port", str(hport), "--picker-port",
                                str(pport), "--redis-url",
                                redis_server.url, "--model-cache-dir", str(tmp)], f"127.0.0.1:{xport}", "router",
                               tmp / "router.log"))
            targets = {"direct": rport, "routed": xport}
            for variant in bare_variants:
                bport = targets[f"bare-{variant}"] = free_port()
                procs.append(start([str(Path(__file__).resolve()), "--passthrough", str(bport), f"127.0.0.1:{rport}",
                                    "--variant", variant], f"127.0.0.1:{bport}", f"pass-through {variant}",
                                   tmp / f"passthrough-{variant}.log"))
            addresses = {side: f"127.0.0.1:{p}" for side, p in targets.items()}
            with contextlib.ExitStack() as stack:
                metadata: dict[str, tuple[tuple[str, str], ...]] = {}
                if gateways:
                    more, metadata = start_gateways(stack, addresses["routed"], f"127.0.0.1:{pport}",
                                                    addresses["direct"], tmp)
                    addresses.update(more)
                channels = {side: grpc.insecure_channel(a) for side, a in addresses.items()}
                for ch in channels.values():
                    stack.enter_context(ch)
                request = gen_pb.GenerateRequest(
                    token_ids=gen_pb.TokenIds(ids=[(7 * i + 3) % 500 + 1 for i in range(64)]),
                    sampling=gen_pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                )
                stubs = {side: gen_grpc.GenerationServiceStub(ch) for side, ch in channels.items()}
                calls = {side: functools.partial(timed_stream, stub, request, metadata.get(side, ()))
                         for side, stub in stubs.items()}
                http_stream = HttpStream(hport, request)
                stack.callback(http_stream.close)
                calls["routed-http"] = http_stream
                routed = stubs["routed"]
                deadline = time.monotonic() + 30
                while True:  # until the router sees the replica
                    try:
                        routed.Generate(request, timeout=10)
                        break
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                for _ in range(30):
                    for call in calls.values():
                        call()
                out: dict[str, list[float]] = {f"{side}_{what}": [] for side in calls for what in ("ttft", "total")}
                for _ in range(n):  # in turn, so that drift and neighbours hit every side alike
                    for side, call in calls.items():
                        ttft, total = call()
                        out[f"{side}_ttft"].append(ttft * 1e3)
                        out[f"{side}_total"].append(total * 1e3)
                cpu = {}
                if gateways:  # 8 tokens (the verdict's), then LONG_TOKENS: the proxy's share grows per delta
                    long_request = gen_pb.GenerateRequest()
                    long_request.CopyFrom(request)
                    long_request.sampling.max_tokens = LONG_TOKENS
                    for key, req, count in (("", request, n), ("long-", long_request, max(n // 3, 50))):
                        cpu.update({f"{key}{side}": v for side, v in router_cpu_per_1000(procs[0].pid, {
                            side: functools.partial(timed_stream, stubs[side], req) for side in ("direct", "routed", "picker")
                        }, count).items()})
                return out, cpu
        finally:
            for proc in (*reversed(procs), replica):
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=2000, help="decisions timed per hash algorithm")
    p.add_argument("--requests", type=int, default=300, help="requests per side for the proxy latency")
    p.add_argument("--replicas", type=lambda s: tuple(int(n) for n in s.split(",")), default=REPLICA_COUNTS,
                   help="replica counts of the decision, memory and ingest rows, comma-separated (default: %(default)s)")
    p.add_argument("--skip-proxy", action="store_true", help="no replica / router processes")
    p.add_argument("--proxy-only", action="store_true", help="only the proxy's added latency")
    p.add_argument("--bare", default="aio,sync-st", help="bare pass-through designs measured next to the router,"
                   f" comma-separated ({', '.join(BARE_VARIANTS)}; '' for none)")
    p.add_argument("--no-envoy", action="store_true", help="no Envoy sides (bench/_gateway.py)")
    p.add_argument("--passthrough", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    p.add_argument("--variant", default="aio", choices=BARE_VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.passthrough:
        passthrough(int(args.passthrough[0]), args.passthrough[1], args.variant)
        return 0
    bare = [v for v in args.bare.split(",") if v]
    if unknown := [v for v in bare if v not in BARE_VARIANTS]:
        p.error(f"--bare: unknown {', '.join(unknown)}; expected some of {', '.join(BARE_VARIANTS)}")
    t_start = time.monotonic()
    others = busy_cores()
    rng = random.Random(0)

    rows: list[tuple[str, str, str, str]] = []  # (metric, measured, goal, verdict)

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    sizes = () if args.proxy_only else args.replicas
    for num_replicas in sizes:
        for algorithm in ("sha256_cbor", "xxhash_cbor") if num_replicas == sizes[0] else ("sha256_cbor",):
            run = bench_decisions(algorithm, args.decisions, rng, num_replicas)
            timings = run.timings
            p50, p99 = statistics.median(timings["cpu"]), pct(timings["cpu"], 0.99)
            w50, w99 = statistics.median(timings["total"]), pct(timings["total"], 0.99)
            parts = ", ".join(f"{k} {statistics.median(timings[k]):.3f}" for k in ("hash", "lookup", "score"))
            goal = GOAL_P50_MS.get(num_replicas) if algorithm == "sha256_cbor" else None
            rows.append((f"decision, {num_replicas:,} replicas, {algorithm} [{run.implementation}]",
                         f"CPU p50 {p50:.3f} / p99 {p99:.3f} ms; wall p50 {w50:.3f} / p99 {w99:.3f} ms ({parts} ms)",
                         f"p50 <= {goal:g} ms" if goal else "(for reference)", verdict(p50 <= goal) if goal else "-"))
        rows.append((f"index memory per (replica, block) entry, {num_replicas:,} replicas",
                     f"{run.bytes_per_entry:.1f} B ({run.entries:,} entries"
                     + (f"; C tables {run.table_bytes / run.entries:.1f} B)" if run.table_bytes else ")"),
                     f"<= {GOAL_BYTES_PER_ENTRY} B", verdict(run.bytes_per_entry <= GOAL_BYTES_PER_ENTRY)))
        apply_rate, add_rate = bench_ingest(rng, num_replicas)
        rows.append((f"event ingest, consumer apply path, {num_replicas:,} replicas", f"{apply_rate / 1e6:.2f} M blocks/s",
                     f">= {GOAL_INGEST / 1e6:g} M blocks/s", verdict(apply_rate >= GOAL_INGEST)))
        rows.append((f"event ingest, BlockIndex.add alone, {num_replicas:,} replicas", f"{add_rate / 1e6:.2f} M blocks/s",
                     "(for reference)", "-"))

    if not args.skip_proxy:
        gateways = not args.no_envoy
        with tempfile.TemporaryDirectory(prefix="kvroute-bench-router-") as tmp:
            lat, cpu = bench_proxy(args.requests, Path(tmp), bare, gateways)
        for what in ("ttft", "total"):
            d, r = (statistics.median(lat[f"{side}_{what}"]) for side in ("direct", "routed"))
            floors = ", ".join(f"{v} {statistics.median(lat[f'bare-{v}_{what}']) - d:+.2f}" for v in bare)
            label = "time to first token" if what == "ttft" else "whole request (8 tokens)"
            rows.append((f"proxy added latency, {label}",
                         f"{r - d:+.2f} ms p50 (direct {d:.2f}, routed {r:.2f} ms"
                         + (f"; bare pass-through {floors})" if bare else ")"),
                         f"<= {GOAL_ADDED_MS:g} ms", verdict(r - d <= GOAL_ADDED_MS)))
        if gateways:
            d = statistics.median(lat["direct_ttft"])
            floor = "(the floor of (b))"
            for side, label, goal in (("envoy", "(a) Envoy alone", "-"),
                                      ("floor", "(b0) Envoy + a fixed-answer ext_proc", floor),
                                      ("picker", "(b) Envoy + kvroute picker", f"<= {GOAL_ADDED_MS:g} ms"),
                                      ("routed", "(c) Python proxy", "-")):
                if f"{side}_ttft" not in lat:  # the floor, without node
                    rows.append((f"TTFT added, {label}", "skipped: node is not on PATH", goal, "-"))
                    continue
                added = statistics.median(lat[f"{side}_ttft"]) - d
                how = " (compiled HTTP/2, no routing)" if side == "floor" else ""
                rows.append((f"TTFT added, {label}", f"{added:+.2f} ms p50 (direct {d:.2f} ms){how}", goal,
                             verdict(added <= GOAL_ADDED_MS) if side == "picker" else "-"))
            for key, tokens in (("", 8), ("long-", LONG_TOKENS)):
                picker, proxy = cpu[f"{key}picker"], cpu[f"{key}routed"]
                ratio = proxy / picker if picker > 0 else float("inf")
                rows.append((f"router CPU per 1,000 streamed requests ({tokens} tokens)", f"(b) picker {picker:.2f} s,"
                             f" (c) proxy {proxy:.2f} s: {ratio:.1f}x less",
                             "(b) >= 3x less than (c)" if not key else "(for reference)",
                             verdict(ratio >= 3) if not key else "-"))
        for what in ("ttft", "total"):
            g, h = lat["routed_" + what], lat["routed-http_" + what]
            g50, g99, h50, h99 = statistics.median(g), pct(g, 0.99), statistics.median(h), pct(h, 0.99)
            label = "time to first token" if what == "ttft" else "whole request (8 tokens)"
            rows.append((f"HTTP front vs gRPC front, {label}",
                         f"{h50 - g50:+.2f} ms p50, {h99 - g99:+.2f} ms p99 (gRPC {g50:.2f} / {g99:.2f}, "
                         f"HTTP {h50:.2f} / {h99:.2f} ms)", "-", "-"))

    parts = [] if args.proxy_only else [
        f"{', '.join(f'{n:,}' for n in sizes)} replicas, >= {NUM_ENTRIES / 1e6:g}M indexed entries,"
        f" {PROMPT_TOKENS}-token prompts ({PROMPT_TOKENS // B} blocks), {args.decisions} decisions per row"]
    if not args.skip_proxy:
        parts.append(f"proxy: {args.requests} requests per side, one replica, loopback")
    print(f"\nrouter benchmark: {'; '.join(parts)}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print_table(("metric", "measured", "goal", "verdict"), rows)
    if others is not None and others > 0.25:
        print(f"\nnote: other processes kept {others:.1f} of {os.cpu_count()} cores busy at the start; latencies"
              " are inflated accordingly")
    print(f"\n({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
