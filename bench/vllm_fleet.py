"""Fronts for a vLLM fleet: kvroute's router against the peers' routers and round robin, on the same
two vLLM-CPU servers, the same prompts and the same replay client, in one run.

    python bench/vllm_fleet.py --prompts P.jsonl --client replay_openai.py --model DIR
        [--vllm-python PY] [--peers-dir DIR] [--bounds bounds.json] [--runs 1] [--probe 200]
        [--fronts direct_rr,kvroute,kvroute_envoy,sglang_cache_aware,vr_cache_aware,vr_kv_aware]

Inputs, from the peer harness (docs/benchmarks.md, "A vLLM fleet"): the prompts file of its
``mooncake_prompts.py`` (32 characters per trace hash id: one 32-token block of its byte-tokenizer
model), its replay client ``replay_openai.py`` (each request sent at its arrival time as a streamed
``/v1/completions`` call; the cluster prefix-cache hit rate from the servers' own
``vllm:prefix_cache_*`` counters), the ideal bound from its ``hit_bounds.py --json``, and the peers'
virtualenvs (``venv-sgl``: sglang-router; ``venv-vr``: vllm-router) in ``--peers-dir``.

What runs: ``kvroute up --engine vllm --gateway envoy`` with 2 servers (started once, each bound to
its own core, with the harness's server flags: float32, 16,384-token context, 32 sequences,
``--enable-scale-out`` for vllm-router's render endpoint; ``VLLM_SERVER_DEV_MODE=1`` for
``/reset_prefix_cache``), a bridge beside each, Redis, kvroute's router with its default settings
and Envoy with the router as its endpoint picker. Then, per run and front, in turn: both prefix
caches emptied (the bridges' ``AllBlocksCleared`` empties the router's index), the peer router
started fresh when the front is a peer's, the whole prompts file replayed through the front, the
peer router stopped. A first pass straight to the servers (discarded) warms their code paths.

Fronts: ``direct_rr`` (the client alternates between the servers), ``kvroute`` (the router's OpenAI
HTTP front, which proxies to vLLM), ``kvroute_envoy`` (Envoy, the picker choosing the server),
``sglang_cache_aware``, ``sglang_rr``, ``vr_cache_aware``, ``vr_kv_aware`` (vLLM's KV events from
both servers), ``vr_rr``.

The probe (``--probe N``, after the replays): the time to first token each front adds in front of
vLLM. Eight 256-token prompts, each cached on both servers first, so that every call is the same
full prefix hit wherever it lands; N rounds, each sending one call (2 output tokens, streamed, one
kept-alive connection per front, nothing else in flight) to every front in a rotating order. Added =
p50(front) - p50(direct) of the time to the first streamed token.

Goals (the table's verdicts): kvroute's hit rate at least the best peer's; its TTFT p50 no worse
than the best peer's; the best kvroute front adds at most 1 ms to TTFT at p50. All processes share
this machine's cores: hit rates are stable, latencies carry the machine's noise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import print_table  # noqa: E402
from kvroute_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402
from kvroute_tools.redis_server import free_port  # noqa: E402
from kvroute_tools.supervise import Child, stop_all  # noqa: E402

KVROUTE_FRONTS = ("kvroute", "kvroute_envoy")
PEER_FRONTS = ("sglang_cache_aware", "sglang_rr", "vr_cache_aware", "vr_kv_aware", "vr_rr")
FRONTS = ("direct_rr", *KVROUTE_FRONTS, *PEER_FRONTS)
# The peer harness's server flags, so the peers see the servers they were measured on.
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "16384", "--max-num-seqs", "32", "--enable-scale-out")
PROBE_PROMPTS = 8
PROBE_CHARS = 256  # one token per character with the byte tokenizer: 8 full blocks of 32
ADDED_GOAL_MS = 1.0


def post_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def reset_caches(servers: list[str]) -> None:
    """Empty both prefix caches, and run one engine step on each: vLLM sends the reset's
    ``AllBlocksCleared`` with its next step, which the bridge passes on to the router's index."""
    for s in servers:
        if not post_json(f"{s}/reset_prefix_cache").get("success", True):
            raise RuntimeError(f"reset_prefix_cache on {s} failed")
    for s in servers:
        post_json(f"{s}/v1/completions", {"model": MODEL_NAME[0], "prompt": "#", "max_tokens": 1})
    time.sleep(1.0)


MODEL_NAME = [""]  # the served model name (the model folder's), set in main


def peer_argv(front: str, peers_dir: Path, port: int, prom_port: int, servers: list[str],
              events: list[str]) -> list[str]:
    """The peer router's command line, as the peer harness starts it."""
    policy = front.split("_", 1)[1]
    policy = "round_robin" if policy == "rr" else policy
    if front.startswith("sglang_"):
        return [str(peers_dir / "venv-sgl" / "bin" / "sglang-router"), "launch", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", *servers, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port), "--log-level", "warn"]
    argv = [str(peers_dir / "venv-vr" / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *servers, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port), "--log-level", "warning"]
    if policy == "kv_aware":
        for s, e in zip(servers, events, strict=True):
            argv += ["--kv-event-source", f"{s}={e}"]
        argv += ["--kv-event-block-size", "32", "--kv-event-model", MODEL_NAME[0]]
    return argv


def start_peer(front: str, args, servers: list[str], events: list[str], log_dir: Path) -> tuple[Child, str]:
    """A fresh peer router, once it has served a completion (it answers /health before it knows
    the workers)."""
    port, prom = free_port("127.0.0.1"), free_port("127.0.0.1")
    child = Child(front, peer_argv(front, Path(args.peers_dir), port, prom, servers, events),
                  log_dir / f"{front}.log").start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            post_json(f"{url}/v1/completions", {"model": MODEL_NAME[0], "prompt": "####", "max_tokens": 1,
                                                "temperature": 0}, timeout=10)
            return child, url
        except OSError:
            if not child.running() or time.monotonic() > deadline:
                stop_all([child], 5.0)
                raise RuntimeError(f"{front} never served a completion; see {child.log_path}:\n{child.log_tail()}") from None
            time.sleep(0.5)


def replay(args, label: str, urls: list[str], servers: list[str], out: Path) -> dict:
    """One pass of the prompts file through ``urls`` by the replay client; its summary."""
    argv = [sys.executable, args.client, "--prompts", args.prompts, "--label", label, "--warmup", "3",
            "--model", MODEL_NAME[0], "--out", str(out)]
    for u in urls:
        argv += ["--url", u]
    for s in servers:
        argv += ["--backend", s]
    proc = subprocess.run(argv, capture_output=True, text=True)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the replay client failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


class Prober:
    """One kept-alive HTTP/1.1 connection to a front; ``ttft(prompt)`` times one streamed call."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

    def ttft(self, prompt: str) -> float:
        """Seconds from sending the call to its first streamed text (the call read to its end).

        Raises:
            RuntimeError: a status other than 200.
        """
        body = json.dumps({"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": 2, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {resp.read()[:300]!r}")
        first = None
        while line := resp.readline():
            if first is None and line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                first = time.perf_counter() - t0
        return first if first is not None else float("nan")


def probe(fronts: dict[str, list[str]], servers: list[str], rounds: int) -> dict[str, list[float]]:
    """TTFT samples (s) per front over ``rounds`` rotating rounds (module docstring, "The probe")."""
    prompts = [(f"probe {k:02d} " + "!*+,-./:;<=>?@[]^_{|}" * 13)[:PROBE_CHARS] for k in range(PROBE_PROMPTS)]
    for s in servers:  # every probe prompt cached on both servers: a full hit wherever it lands
        for p in prompts:
            for _ in range(2):
                post_json(f"{s}/v1/completions", {"model": MODEL_NAME[0], "prompt": p, "max_tokens": 1})
    probers = {name: [Prober(u) for u in urls] for name, urls in fronts.items()}
    samples: dict[str, list[float]] = {name: [] for name in fronts}
    names = list(fronts)
    for i in range(rounds + 5):  # 5 rounds of warm-up, discarded
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            conns = probers[name]
            t = conns[i % len(conns)].ttft(prompts[i % PROBE_PROMPTS])
            if i >= 5:
                samples[name].append(t)
    return samples


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="prompts JSONL (the peer harness's mooncake_prompts.py)")
    ap.add_argument("--client", required=True, help="the peer harness's replay_openai.py")
    ap.add_argument("--model", required=True, help="the model folder (its name is the served model name)")
    ap.add_argument("--vllm-python", default="", help="python with vllm (default: kvroute up's search)")
    ap.add_argument("--vllm-args", default="", help="more vLLM server flags, one string")
    ap.add_argument("--peers-dir", default=os.path.expanduser("~/.cache/kvroute-peers"),
                    help="folder with venv-sgl and venv-vr (the peer routers)")
    ap.add_argument("--fronts", default="direct_rr,kvroute,kvroute_envoy,sglang_cache_aware,vr_cache_aware,vr_kv_aware")
    ap.add_argument("--runs", type=int, default=1, help="passes per front, interleaved")
    ap.add_argument("--kv-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE per server, GiB")
    ap.add_argument("--bounds", default="", help="hit_bounds.py --json output: the ideal hit rate")
    ap.add_argument("--probe", type=int, default=200, help="probe rounds (0: no probe)")
    ap.add_argument("--out", default="", help="write every summary and sample as JSON here")
    args = ap.parse_args()
    fronts = [f for f in args.fronts.split(",") if f]
    unknown = sorted(set(fronts) - set(FRONTS))
    if unknown:
        ap.error(f"--fronts: unknown {', '.join(unknown)}; choose from {', '.join(FRONTS)}")
    MODEL_NAME[0] = Path(args.model).name
    ideal = None
    if args.bounds:
        with open(args.bounds) as f:
            ideal = json.load(f)["ideal"]["hit_rate"]

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_gib)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-fleet-"))
    print(f"logs: {log_dir}", flush=True)
    cluster = LocalCluster(ClusterConfig(
        replicas=2, engine="vllm", gateway="envoy", router_port=0, model=args.model, vllm_python=args.vllm_python,
        vllm_args=(*SERVER_ARGS, *shlex.split(args.vllm_args)), log_dir=str(log_dir), ready_timeout=600.0))
    cluster.start()
    servers = [f"http://{c.target}" for c in cluster.engines]
    events = [f"tcp://{urlsplit(s).hostname}:{p.events}" for s, p in zip(servers, cluster.vllm_ports, strict=True)]
    kvroute_urls = {"kvroute": [cluster.router_http_url.removesuffix("/v1")], "kvroute_envoy": [f"http://{cluster.front_target}"]}
    results: dict[str, list[dict]] = {f: [] for f in fronts}
    try:
        reset_caches(servers)
        replay(args, "warm", servers, servers, log_dir / "warm.json")
        for run in range(args.runs):
            for front in fronts:
                reset_caches(servers)
                peer = None
                if front in PEER_FRONTS:
                    peer, url = start_peer(front, args, servers, events, log_dir)
                    urls = [url]
                else:
                    urls = servers if front == "direct_rr" else kvroute_urls[front]
                try:
                    results[front].append(replay(args, front, urls, servers, log_dir / f"{front}_r{run}.json"))
                finally:
                    if peer is not None:
                        stop_all([peer], 10.0)
        samples: dict[str, list[float]] = {}
        if args.probe > 0:
            probe_fronts = {"direct": servers, **{f: u for f, u in kvroute_urls.items() if f in fronts}}
            peers = []
            try:
                for front in fronts:
                    if front.endswith("cache_aware"):
                        peer, url = start_peer(front, args, servers, events, log_dir)
                        peers.append(peer)
                        probe_fronts[front] = [url]
                samples = probe(probe_fronts, servers, args.probe)
            finally:
                stop_all(peers, 10.0)
    finally:
        cluster.stop()

    report(results, samples, ideal, fronts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summaries": {k: [r["summary"] for r in v] for k, v in results.items()},
                       "backends": {k: [r["backends"] for r in v] for k, v in results.items()},
                       "probe_ttft_s": samples, "ideal": ideal, "args": vars(args)}, f)
    return 0


def report(results: dict[str, list[dict]], samples: dict[str, list[float]], ideal: float | None,
           fronts: list[str]) -> None:
    """The replay table, the probe table, and the goals' verdicts."""
    med = statistics.median
    rows, hit, ttft = [], {}, {}
    for front in fronts:
        runs = [r["summary"] for r in results[front]]
        if not runs:
            continue
        hit[front] = med(s["hit_rate"] for s in runs)
        ttft[front] = med(s["ttft_p50"] for s in runs)
        shares = [med(b[i]["share"] or 0.0 for b in (r["backends"] for r in results[front])) for i in range(2)]
        rows.append([front, f"{hit[front]:.4f}", f"{hit[front] / ideal:.1%}" if ideal else "-",
                     f"{ttft[front] * 1e3:.1f}", f"{med(s['ttft_p99'] for s in runs) * 1e3:.1f}",
                     f"{med(s['tpot_p50'] for s in runs) * 1e3:.2f}", f"{med(s['e2e_p50'] for s in runs):.3f}",
                     sum(s["errors"] for s in runs), "/".join(f"{x:.2f}" for x in shares)])
    print(f"\nreplay (median of {max(len(v) for v in results.values())} run(s) per front; ideal {ideal or '-'})")
    print_table(["front", "hit rate", "of ideal", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "E2E p50 s",
                 "errors", "share"], rows)
    if samples:
        base = pct(samples["direct"], 50)
        print(f"\nprobe: time to first token, {len(samples['direct'])} calls per front (full prefix hits)")
        print_table(["front", "TTFT p50 ms", "TTFT p99 ms", "added p50 ms"],
                    [[f, f"{pct(v, 50) * 1e3:.2f}", f"{pct(v, 99) * 1e3:.2f}",
                      "-" if f == "direct" else f"{(pct(v, 50) - base) * 1e3:+.2f}"] for f, v in samples.items()])
    peers = [f for f in hit if f in PEER_FRONTS]
    mine = [f for f in hit if f in KVROUTE_FRONTS]
    if peers and mine:
        best_peer = max(peers, key=hit.get)
        best = max(mine, key=hit.get)
        print(f"\ngoal: hit rate >= best peer's ({best_peer} {hit[best_peer]:.4f}): {best} {hit[best]:.4f} "
              f"{'MET' if hit[best] >= hit[best_peer] else 'NOT MET'}")
        fastest_peer = min(peers, key=ttft.get)
        fastest = min(mine, key=ttft.get)
        print(f"goal: TTFT p50 <= best peer's ({fastest_peer} {ttft[fastest_peer] * 1e3:.1f} ms): {fastest} "
              f"{ttft[fastest] * 1e3:.1f} ms {'MET' if ttft[fastest] <= ttft[fastest_peer] else 'NOT MET'}")
    added = {f: (pct(v, 50) - pct(samples["direct"], 50)) * 1e3 for f, v in samples.items() if f in KVROUTE_FRONTS}
    if added:
        f = min(added, key=added.get)
        print(f"goal: the best kvroute front adds <= {ADDED_GOAL_MS:g} ms TTFT p50: {f} {added[f]:+.2f} ms "
              f"{'MET' if added[f] <= ADDED_GOAL_MS else 'NOT MET'}")


if __name__ == "__main__":
    sys.exit(main())
