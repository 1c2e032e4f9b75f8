"""Soak bench: the ``make run`` replay in a loop against one cluster for ``--minutes``, with the
router's and the replicas' memory, the index and the open streams sampled; then a burst of
concurrent streams past the replicas' queue bound.

    python bench/soak.py [--minutes 10] [--requests 1000] [--burst 200] [--sample-every 5]

- The cluster is ``kvroute up``'s (kvroute_tools.cluster.LocalCluster): 4 replicas of 14,336 KV
  blocks and a router, as in ``make run``, with each replica's queue bounded for the burst
  (``--max-num-seqs 16 --max-waiting 16``: the replay's 16 requests in flight still fit in one
  replica's running batch) and the router's Prometheus endpoint on.
- The replay is ``kvroute bench``'s (kvroute_tools.bench.run.run_bench) with ``make run``'s flags
  (1,000 trace requests, 16 tokens per trace block, output x0.02, 16 in flight, kvroute and round
  robin taking turns every 200 requests), once per iteration, each with its own cache salts, until
  ``--minutes`` have passed (the iteration running then finishes), at least twice (the first
  fills the caches; the warm sample is taken after it).
- Sampled every ``--sample-every`` seconds: the resident memory (VmRSS) of the router and of each
  replica with its engine process (the process tree), the router's open file descriptors, the
  index entries (``kvroute_router_index_entries`` summed over replicas), the streams open through
  the router (``in_flight`` of RouterService.Score, summed), and the router's rejected KV events.
- The table: per metric its value at the start (the cluster ready), after the first iteration
  (warm: caches filled), at the end, the largest seen, and the bound it is held to. Bounds: the
  index within the caches (replicas x blocks); memory and descriptors at the end within what the
  warm sample had (+10% and 64 MiB for memory, +16 descriptors); no stream left open; 0 errors in
  every replay; 0 rejected events. Then the burst: ``--burst`` concurrent streams (64-token
  prompts, 32 output tokens) must fail, where they fail, only with RESOURCE_EXHAUSTED, and some
  must (the bound was passed). Exit 1 when a bound is broken.

Numbers are wall-clock on a shared machine: the replay's latencies vary with its load (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench._common import busy_cores, print_table  # noqa: E402
from kvroute.v1 import generation_pb2 as gen_pb  # noqa: E402
from kvroute.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402
from kvroute.v1 import router_pb2 as router_pb  # noqa: E402
from kvroute.v1 import router_pb2_grpc as router_grpc  # noqa: E402
from kvroute_tools.bench.config import BenchConfig  # noqa: E402
from kvroute_tools.bench.run import run_bench  # noqa: E402
from kvroute_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402
from kvroute_tools.redis_server import free_port  # noqa: E402

REPLICAS = 4
NUM_BLOCKS = 14336
MAX_NUM_SEQS = 16
MAX_WAITING = 16
MAKE_RUN = dict(tokens_per_block=16, output_scale=0.02, concurrency=16, interleave=200,
                policies=("kvroute", "round_robin"))
MIB = 2**20


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (Linux /proc); 0 for a process that is gone."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def open_fds(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except OSError:
        return 0


def scrape(url: str, name: str) -> float:
    """The sum of every sample of the metric ``name`` on the Prometheus endpoint ``url``."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


class Sampler:
    """Samples the cluster's numbers every ``every`` seconds on a thread; ``snap()`` takes one now."""

    def __init__(self, cluster: LocalCluster, metrics_url: str, every: float):
        self.cluster, self.metrics_url, self.every = cluster, metrics_url, every
        self.samples: list[dict[str, float]] = []
        self._channel = grpc.insecure_channel(cluster.router_target)
        self._router = router_grpc.RouterServiceStub(self._channel)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def snap(self) -> dict[str, float]:
        c = self.cluster
        assert c.router is not None and c.router.pid is not None
        score = self._router.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=[0])), timeout=10)
        rss = [tree_rss(r.pid) for r in c.replicas if r.pid is not None]
        sample = {
            "router RSS (MiB)": tree_rss(c.router.pid) / MIB,
            "replica RSS max (MiB)": max(rss) / MIB,
            "replicas RSS sum (MiB)": sum(rss) / MIB,
            "router open fds": open_fds(c.router.pid),
            "index entries": scrape(self.metrics_url, "kvroute_router_index_entries"),
            "open streams": sum(r.in_flight for r in score.replicas),
            "rejected events": scrape(self.metrics_url, "kvroute_router_events_rejected_total"),
        }
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.snap()
            except (grpc.RpcError, OSError) as e:  # counted as a failure by the table's error row
                self.samples.append({"sample errors": 1.0})
                print(f"soak: a sample failed: {e}", file=sys.stderr)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (``snap`` still works until ``close``)."""
        self._stop.set()
        self._thread.join(30)

    def close(self) -> None:
        self._channel.close()


def wait_idle(sampler: Sampler, timeout: float = 30.0) -> dict[str, float]:
    """A sample once no stream is open through the router (the last one after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while (sample := sampler.snap())["open streams"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return sample


async def burst(target: str, n: int) -> collections.Counter:
    """``n`` concurrent GenerateStreams through the router; status name -> count (OK for the finished)."""
    rng = random.Random(0)
    sampling = gen_pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    async with grpc.aio.insecure_channel(target) as channel:
        stub = gen_grpc.GenerationServiceStub(channel)
        vocab_size = (await stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30)).vocab_size

        async def one() -> str:
            ids = [rng.randrange(10, vocab_size) for _ in range(64)]
            request = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=sampling)
            try:
                async for _ in stub.GenerateStream(request, timeout=300):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "OK"

        return collections.Counter(await asyncio.gather(*(one() for _ in range(n))))


Check = tuple[str, Callable[[dict[str, float], dict[str, float], dict[str, float], dict[str, float]], bool], str]


def checks(cfg: argparse.Namespace) -> list[Check]:
    """(metric, ok(start, warm, end, max), the bound in words) per sampled metric."""
    bound = REPLICAS * NUM_BLOCKS
    return [
        ("router RSS (MiB)", lambda s, w, e, m: e["router RSS (MiB)"] <= w["router RSS (MiB)"] * 1.1 + 64,
         "end <= warm x1.1 + 64"),
        ("replica RSS max (MiB)",
         lambda s, w, e, m: e["replica RSS max (MiB)"] <= w["replica RSS max (MiB)"] * 1.1 + 64, "end <= warm x1.1 + 64"),
        ("replicas RSS sum (MiB)",
         lambda s, w, e, m: e["replicas RSS sum (MiB)"] <= w["replicas RSS sum (MiB)"] * 1.1 + 256,
         "end <= warm x1.1 + 256"),
        ("router open fds", lambda s, w, e, m: e["router open fds"] <= w["router open fds"] + 16, "end <= warm + 16"),
        ("index entries", lambda s, w, e, m: m["index entries"] <= bound, f"max <= {bound:,} (replicas x blocks)"),
        ("open streams", lambda s, w, e, m: e["open streams"] == 0 and m["open streams"] <= max(cfg.burst, 16),
         f"end 0, max <= {max(cfg.burst, 16)}"),
        ("rejected events", lambda s, w, e, m: m["rejected events"] == 0, "0"),
    ]


def run(cfg: argparse.Namespace) -> int:
    metrics_port = free_port()
    cluster = LocalCluster(ClusterConfig(
        replicas=REPLICAS, router_port=0, num_blocks=NUM_BLOCKS, router_http_port=-1,
        replica_args=("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING)),
        router_args=("--metrics-port", str(metrics_port)),
    ), log=lambda *a, **k: print(*a, file=sys.stderr))
    cluster.start()
    errors: list[int] = []
    try:
        sampler = Sampler(cluster, f"http://127.0.0.1:{metrics_port}/metrics", cfg.sample_every)
        start = sampler.snap()
        sampler.start()
        bench = BenchConfig(target=cluster.router_target, requests=cfg.requests, progress=False,
                            admin_token=cluster.admin_token, **MAKE_RUN)  # type: ignore[arg-type]
        t0 = time.monotonic()
        warm: dict[str, float] | None = None
        while len(errors) < 2 or time.monotonic() - t0 < cfg.minutes * 60:  # warm-up + one to compare
            t_iter = time.monotonic()
            report = asyncio.run(run_bench(bench, log=lambda s: None))
            errors.append(sum(p.errors for p in report.policies))
            rates = ", ".join(f"{p.policy} {p.hit_rate:.3f}" for p in report.policies)
            print(f"soak: replay {len(errors)} in {time.monotonic() - t_iter:.0f} s: {errors[-1]} errors; "
                  f"hit rate {rates}", file=sys.stderr, flush=True)
            if warm is None:
                warm = sampler.snap()
        sampler.stop()
        end = wait_idle(sampler)
        outcomes = asyncio.run(burst(cluster.router_target, cfg.burst))
        after_burst = wait_idle(sampler)
        sampler.close()
    finally:
        cluster.stop()
    samples = [s for s in sampler.samples if "sample errors" not in s]
    peak = {k: max(s[k] for s in samples) for k in start}
    rows, ok = [], True
    for name, check, bound_text in checks(cfg):
        good = check(start, warm, end, peak)
        ok &= good
        rows.append((name, f"{start[name]:,.0f}", f"{warm[name]:,.0f}", f"{end[name]:,.0f}", f"{peak[name]:,.0f}",
                     bound_text, "ok" if good else "BROKEN"))
    failed_samples = len(sampler.samples) - len(samples)
    rows.append(("replay errors", "", "", str(sum(errors)), str(max(errors)), "0", "ok" if not any(errors) else "BROKEN"))
    rows.append(("failed samples", "", "", str(failed_samples), "", "0", "ok" if not failed_samples else "BROKEN"))
    ok &= not any(errors) and not failed_samples
    refused = {code: n for code, n in outcomes.items() if code != "OK"}
    burst_ok = set(refused) <= {"RESOURCE_EXHAUSTED"} and refused.get("RESOURCE_EXHAUSTED", 0) > 0
    ok &= burst_ok and after_burst["open streams"] == 0
    busy = busy_cores(1.0)
    print(f"\nsoak: {len(errors)} replays of {cfg.requests} requests x {len(MAKE_RUN['policies'])} policies in "
          f"{(time.monotonic() - t0) / 60:.1f} min, {len(samples)} samples every {cfg.sample_every:g} s"
          + (f"; {busy:.1f} cores busy at the end (shared machine)" if busy is not None else ""))
    print_table(("metric", "start", "warm", "end", "max", "bound", "verdict"), rows)
    print(f"burst of {cfg.burst} concurrent streams past the queue bound ({REPLICAS} replicas x "
          f"{MAX_NUM_SEQS} running + {MAX_WAITING} waiting): "
          + ", ".join(f"{code} {n}" for code, n in sorted(outcomes.items()))
          + f"; open streams after it {after_burst['open streams']:.0f}: " + ("ok" if burst_ok else "BROKEN"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to loop the replay (default 10)")
    p.add_argument("--requests", type=int, default=1000, help="trace requests per replay (default 1000, as make run)")
    p.add_argument("--burst", type=int, default=200, help="concurrent streams of the final burst (default 200)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default 5)")
    cfg = p.parse_args(argv)
    if cfg.minutes <= 0 or cfg.requests < 1 or cfg.burst < 1 or cfg.sample_every <= 0:
        p.error("--minutes, --sample-every: must be > 0; --requests, --burst: must be >= 1")
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
