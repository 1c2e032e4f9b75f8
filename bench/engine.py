"""Engine benchmark: one table, every baseline measured in the same run, on the default model.

    python bench/engine.py [--vllm-python PATH] [--device auto] [--threads N]

Rows:
- decode throughput (output tokens / s, wall time of the whole batch: prefill + decode +
  detokenization) at batch 1, 8 and 32, against transformers' ``generate`` on the same weights,
  same prompts (mixed lengths; transformers batches them with left padding), greedy, same
  ``max_new_tokens``. Goal: >= 3x transformers at batch 32.
- time to first token of a 2,048-token prompt, uncached vs 90% cached (the first 1,843 tokens are
  shared with an earlier prompt, so 115 blocks of 16 = 1,840 tokens hit). Goal: cached <= 0.25x.
- peak RSS of this process (``resource.getrusage``): the engine alone (read before transformers
  loads) and the whole run.
- with ``--vllm-python PATH``: vLLM offline (``LLM(model=folder, enable_prefix_caching=True)``) run
  in that interpreter on the same folder, prompts, dtype and sampling, with the engine's thread
  budget (``vllm_env``), one warm-up per batch and the prefix cache reset before each timed run.
  Goal: kvroute >= 1.0x vLLM at batch 32. Its whole log goes to ``VLLM_LOG``; a failure prints
  the root cause and the log's tail.

Every timing is the median of ``--repeats`` runs after a warm-up; engine and transformers runs
alternate, so that both see the same background load. One torch thread by default (``--threads``):
on a shared CPU host, multi-threaded runs of the step loop's many small ops swung up to 10x from
run to run (OpenMP barriers over oversubscribed cores). Outputs are checked: the
engine's greedy tokens are compared with transformers' (the count of identical sequences is
printed; left padding can flip a near-tie, so this is reported, not asserted).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import print_table  # noqa: E402
from bench._vllm import VLLM_LOG, run_vllm, vllm_env, vllm_python_path  # noqa: E402
from replica.engine.config import EngineConfig  # noqa: E402
from replica.engine.engine import LLMEngine  # noqa: E402
from replica.engine.params import SamplingParams  # noqa: E402
from replica.model.default_model import DEFAULT_MODEL_DIRNAME, SPECIAL_TOKENS, ensure_default_model  # noqa: E402

BATCHES = (1, 8, 32)
TTFT_PROMPT_LEN = 2048
TTFT_SHARED = int(TTFT_PROMPT_LEN * 0.9)  # 1,843 tokens: 115 full blocks of 16 hit
GOAL_DECODE_X = 3.0
GOAL_TTFT_RATIO = 0.25
GOAL_VLLM_X = 1.0
NUM_SPECIAL = len(SPECIAL_TOKENS)  # the default model's special tokens are its last ids: never in prompts

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", help="a Python interpreter with vllm installed (runs the vLLM baseline)")
    p.add_argument("--model-dir", help="model folder (default: the default model, generated into a temp dir)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared host, OpenMP barriers over oversubscribed cores make the"
        " step loop's many small ops far slower and erratic from run to run; 0 = torch's choice)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="mean prompt length of the decode rows")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is reported)")
    return p.parse_args(argv)


def make_prompts(n: int, mean_len: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` random prompts of token ids in [0, vocab) and mixed lengths in [mean/2, 3*mean/2]."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, mean_len // 2), mean_len + mean_len // 2 + 1, (n,), generator=gen).tolist()
    return [torch.randint(vocab, (k,), generator=gen).tolist() for k in lens]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# -- the engine ---------------------------------------------------------------------------------
def engine_decode(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    engine.kv.reset_prefix_cache(must_succeed=True)  # every timed run computes its prompts (no warm cache)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def engine_ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the step that returns the first token."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    while not req.output_token_ids:
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return dt


# -- transformers -------------------------------------------------------------------------------
def hf_decode(
    hf_model, prompts: list[list[int]], max_new_tokens: int, device: torch.device
) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


# -- the run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vllm_python:
        args.vllm_python = vllm_python_path(args.vllm_python)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        tmp = tempfile.mkdtemp(prefix="kvroute-bench-")
        model_dir = ensure_default_model(Path(tmp) / DEFAULT_MODEL_DIRNAME)
    try:
        return _run(args, model_dir, started)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def engine_ttft_rows(engine: LLMEngine, repeats: int, vocab: int) -> tuple[float, float, int]:
    """Median TTFT of fresh 2,048-token prompts, and of prompts sharing their first 90% with one
    of those (run right after it); returns (uncached s, cached s, tokens hit)."""
    gen = torch.Generator().manual_seed(7)
    uncached, cached, hits = [], [], []
    engine.kv.reset_prefix_cache(must_succeed=True)
    engine_ttft(engine, torch.randint(vocab, (TTFT_PROMPT_LEN,), generator=gen).tolist())  # warm-up
    for _ in range(repeats):
        base = torch.randint(vocab, (TTFT_PROMPT_LEN,), generator=gen).tolist()
        uncached.append(engine_ttft(engine, base))
        tail = torch.randint(vocab, (TTFT_PROMPT_LEN - TTFT_SHARED,), generator=gen).tolist()
        hits_before = engine.kv.stats.hits
        cached.append(engine_ttft(engine, base[:TTFT_SHARED] + tail))
        hits.append(engine.kv.stats.hits - hits_before)
    return statistics.median(uncached), statistics.median(cached), min(hits)


def load_transformers(model_dir: Path, device: torch.device, dtype: torch.dtype):
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def decode_rows(args, engine: LLMEngine, hf, prompts: dict[int, list[list[int]]], vocab: int):
    """Decode tok/s per batch for both, timed runs alternating engine / transformers so that both
    see the same background load; returns (ours, theirs, our outputs, identical-output counts)."""
    device = engine.device
    engine_decode(engine, make_prompts(2, 16, seed=1, vocab=vocab), 8)  # warm-up
    hf_decode(hf, make_prompts(2, 16, seed=1, vocab=vocab), 8, device)
    ours, theirs, outputs, same = {}, {}, {}, {}
    n = args.max_new_tokens
    for b, ps in prompts.items():
        outputs[b] = engine_decode(engine, ps, n)
        same[b] = sum(a == o for a, o in zip(outputs[b], hf_decode(hf, ps, n, device), strict=True))
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            t_ours.append(median_time(lambda ps=ps: engine_decode(engine, ps, n), 1))
            t_hf.append(median_time(lambda ps=ps: hf_decode(hf, ps, n, device), 1))
        ours[b] = b * n / statistics.median(t_ours)
        theirs[b] = b * n / statistics.median(t_hf)
        print(
            f"  batch {b:>2}: kvroute {ours[b]:8.1f} tok/s, transformers {theirs[b]:8.1f} tok/s"
            f" ({same[b]}/{b} outputs identical)",
            flush=True,
        )
    return ours, theirs, outputs, same


def _run(args: argparse.Namespace, model_dir: Path, started: float) -> int:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"] - NUM_SPECIAL
    prompts = {b: make_prompts(b, args.prompt_len, seed=100 + b, vocab=vocab) for b in BATCHES}
    engine = LLMEngine(model_dir, EngineConfig(device=args.device, max_num_seqs=max(BATCHES)))
    dtype_name = str(engine.dtype).removeprefix("torch.")
    print(
        f"kvroute engine bench: model {model_dir.name} ({sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f}M"
        f" params, {dtype_name}), device {engine.device}, torch threads {torch.get_num_threads()},"
        f" KV {engine.num_blocks} blocks of {engine.config.block_size}, max_new_tokens {args.max_new_tokens},"
        f" {args.repeats} runs per row (median)",
        flush=True,
    )
    t_unc, t_hit, hit = engine_ttft_rows(engine, args.repeats, vocab)
    print(f"  TTFT {TTFT_PROMPT_LEN}: uncached {t_unc * 1e3:.1f} ms, cached ({hit} hit) {t_hit * 1e3:.1f} ms")
    # ru_maxrss only grows: the engine's peak is read before transformers loads.
    rss_engine = peak_rss_mib()
    hf = load_transformers(model_dir, engine.device, engine.dtype)
    ours_tps, hf_tps, ours_out, _ = decode_rows(args, engine, hf, prompts, vocab)
    max_len = engine.max_model_len
    del engine, hf

    vllm_res, vllm_err = None, "not run (pass --vllm-python)"
    if args.vllm_python:
        print(f"  running vLLM (log: {VLLM_LOG}) ...", flush=True)
        vllm_res, vllm_err = run_vllm(args.vllm_python, model_dir, prompts, args, dtype_name, max_len)
        if vllm_res is None:
            print(f"  vLLM failed: {vllm_err}", flush=True)
            vllm_err = "failed (see above)"
    rss_end = peak_rss_mib()

    # The table.
    rows = []
    for b in BATCHES:
        x = ours_tps[b] / hf_tps[b]
        goal = f">= {GOAL_DECODE_X:.1f}x" if b == 32 else ""
        result = ("PASS" if x >= GOAL_DECODE_X else "MISS") if b == 32 else ""
        rows.append(
            (f"decode tok/s, batch {b}", f"{ours_tps[b]:.0f}", f"{hf_tps[b]:.0f}", f"{x:.2f}x", goal, result)
        )
    ratio = t_hit / t_unc
    rows.append((f"TTFT {TTFT_PROMPT_LEN} tok, uncached (ms)", f"{t_unc * 1e3:.1f}", "", "", "", ""))
    rows.append(
        (
            f"TTFT {TTFT_PROMPT_LEN} tok, 90% cached (ms)",
            f"{t_hit * 1e3:.1f}",
            "",
            f"{ratio:.2f}x",
            f"<= {GOAL_TTFT_RATIO:.2f}x",
            "PASS" if ratio <= GOAL_TTFT_RATIO else "MISS",
        )
    )
    # The baseline column is the whole run's peak (engine + transformers in this process).
    rows.append(("peak RSS (MiB)", f"{rss_engine:.0f}", f"whole run {rss_end:.0f}", "", "", ""))
    if vllm_res is not None:
        for b in BATCHES:
            v = b * args.max_new_tokens / vllm_res[b]["seconds"]
            x = ours_tps[b] / v
            rows.append(
                (
                    f"vs vLLM: decode tok/s, batch {b}",
                    f"{ours_tps[b]:.0f}",
                    f"vLLM {v:.0f}",
                    f"{x:.2f}x",
                    f">= {GOAL_VLLM_X:.1f}x" if b == 32 else "",
                    ("PASS" if x >= GOAL_VLLM_X else "MISS") if b == 32 else "",
                )  # fmt: skip
            )
        same_v = [
            f"{sum(a == o for a, o in zip(ours_out[b], vllm_res[b]['outputs'], strict=True))}/{b}"
            for b in BATCHES
        ]
        rows.append(("  vLLM outputs identical", " ".join(same_v), "", "", "", ""))
    else:
        rows.append(("vs vLLM: decode tok/s, batch 32", "", vllm_err, "", f">= {GOAL_VLLM_X:.1f}x", ""))

    print()
    print("baseline: transformers generate (greedy, left padding), same weights, prompts and device")
    if vllm_res is not None:
        env = vllm_env(args.threads)
        if env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            how = f"scheduler and model in one process, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}"
        else:
            how = (
                "scheduler and model worker in processes of their own,"
                f" VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}"
            )
        cores = vllm_res[32].get("cores")
        print(
            f"vLLM {vllm_res['version']}: offline LLM.generate, {dtype_name}, prefix caching on (reset before each"
            f" run), {how}" + (f"; {cores:.1f} cores busy at batch 32" if cores is not None else "")
        )
    print_table(("metric", "kvroute", "baseline", "ratio", "goal", "result"), rows)
    print(f"\ntotal bench time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
