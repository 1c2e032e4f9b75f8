"""The vLLM baseline of ``bench/engine.py --vllm-python PATH``: vLLM's offline ``LLM.generate`` run
in that interpreter (a child process, its own session) on the engine bench's folder, prompts, dtype
and sampling, with the engine's thread budget (``vllm_env``); the result comes back as one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Run by ``--vllm-python`` in its own interpreter. vLLM's CPU backend starts its engine core and
# worker with the ``spawn`` method, which re-imports ``__main__``: hence the guard. Its KV cache is
# sized explicitly (``kv_cache_memory_bytes``): by default it reserves 92% of NUMA node 0's memory
# and refuses to start when that much is not free.
VLLM_SCRIPT = r"""
import dataclasses, json, statistics, sys, time


def cpu_seconds():
    # CPU time of this process and its children (vLLM's engine core and worker), or None.
    try:
        import psutil
    except ImportError:
        return None
    me, total = psutil.Process(), 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _reset_prefix_cache(llm) -> None:
    # LLM.reset_prefix_cache() returns False when it refuses: the timed run would start warm.
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused reset_prefix_cache (blocks still in use): the timed run would start warm")


def main():
    args = json.loads(open(sys.argv[1]).read())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    kw = dict(model=args["model"], enable_prefix_caching=True, dtype=args["dtype"], seed=0,
              max_model_len=args["max_model_len"], max_num_seqs=max(args["batches"]))
    if "kv_cache_memory_bytes" in {f.name for f in dataclasses.fields(EngineArgs)}:
        kw["kv_cache_memory_bytes"] = args["kv_cache_gib"] << 30
    llm = LLM(**kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=args["max_new_tokens"], ignore_eos=True)
    out = {"version": vllm.__version__, "batches": {}}
    for b, prompts in zip(args["batches"], args["prompts"]):
        reqs = [{"prompt_token_ids": p} for p in prompts]
        _reset_prefix_cache(llm)
        res = llm.generate(reqs, greedy, use_tqdm=False)  # warm-up (as the engine's output-check run)
        times, cpu0 = [], cpu_seconds()
        for _ in range(args["repeats"]):
            _reset_prefix_cache(llm)  # every timed run computes its prompts
            t0 = time.perf_counter()
            llm.generate(reqs, greedy, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        cpu1 = cpu_seconds()
        out["batches"][str(b)] = {"seconds": statistics.median(times),
                                  "cores": None if cpu0 is None else (cpu1 - cpu0) / sum(times),
                                  "outputs": [list(r.outputs[0].token_ids) for r in res]}
        print(f"vLLM batch {b}: {b * args['max_new_tokens'] / statistics.median(times):.1f} tok/s",
              file=sys.stderr, flush=True)
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
"""
VLLM_TIMEOUT_S = 1800  # first start compiles the model (torch.compile): about a minute on 2 cores
VLLM_KV_CACHE_GIB = 1
VLLM_LOG = Path(tempfile.gettempdir()) / "kvroute-bench-vllm.log"


def vllm_env(threads: int) -> dict[str, str]:
    """The child's environment; variables already set win, except OMP_NUM_THREADS.

    With ``--threads N`` (default 1) vLLM gets the engine's CPU budget: scheduler and model in one
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) computing with N OpenMP threads. By default vLLM
    runs its scheduler (a busy loop) and its model worker in processes of their own, with the
    worker's threads bound to every core but one: on 2 cores that is 1 compute thread but 2 cores
    busy, and on this host it was no faster than the one-process run. ``--threads 0`` leaves all
    of that to vLLM."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GIB))  # GiB; older vLLMs read only this
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if env["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":  # the worker's own binding: cores 0..N-1
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    return env


def vllm_root_cause(lines: list[str]) -> str:
    """The first ``SomeError: message`` line of the child's log (a worker's error comes before the
    engine core's and the parent's wrappers of it), without vLLM's ``(proc) ERROR ... [file]`` prefix."""
    for line in lines:
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and "initialization failed" not in m.group(2) and "See root cause" not in m.group(2):
            return f"{m.group(1)}: {m.group(2)}"
    return ""


def vllm_python_path(python: str) -> str:
    """``--vllm-python`` as an absolute path (the child runs in a temp dir), without following the
    venv's symlink (that would lose the venv); exits when it is not an executable."""
    found = shutil.which(python)
    if not found:
        sys.exit(f"--vllm-python {python}: not an executable")
    return os.path.abspath(found)


def run_vllm(
    python: str, model_dir: Path, prompts: dict[int, list[list[int]]], args, dtype: str, max_len: int
) -> tuple[dict | None, str]:
    """Runs VLLM_SCRIPT in ``python``; returns (result, "") or (None, why it failed). The child's
    whole output (vLLM logs to both streams) is kept in VLLM_LOG."""
    with tempfile.TemporaryDirectory() as tmp:
        script, spec = Path(tmp) / "vllm_bench.py", Path(tmp) / "spec.json"
        script.write_text(VLLM_SCRIPT)
        spec.write_text(
            json.dumps(
                {
                    "model": str(model_dir),
                    "dtype": dtype,
                    "max_model_len": max_len,
                    "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats,
                    "kv_cache_gib": VLLM_KV_CACHE_GIB,
                    "batches": list(prompts),
                    "prompts": list(prompts.values()),
                }
            )
        )
        timed_out = False
        with open(VLLM_LOG, "w") as log:
            # A session of its own: on a timeout the engine core and worker processes go too.
            proc = subprocess.Popen(
                [python, str(script), str(spec)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=tmp,
                env=vllm_env(args.threads),
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=VLLM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    lines = VLLM_LOG.read_text(errors="replace").splitlines()
    for line in lines:
        if line.startswith("VLLM_RESULT "):
            res = json.loads(line[len("VLLM_RESULT ") :])
            return {"version": res["version"], **{int(k): v for k, v in res["batches"].items()}}, ""
    why = f"timed out after {VLLM_TIMEOUT_S} s" if timed_out else f"exit status {rc}"
    cause = vllm_root_cause(lines)
    tail = "\n".join("    | " + line for line in lines[-20:])
    return (
        None,
        f"{why}{': ' + cause if cause else ''}\n  last {min(20, len(lines))} lines of {VLLM_LOG}:\n{tail}",
    )
