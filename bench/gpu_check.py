"""The prepared GPU check: one script, under 8 minutes on one GPU.

    python bench/gpu_check.py            # on a CUDA machine
    python bench/gpu_check.py --dry-run  # anywhere: tiny shapes, CUDA-only parts skipped (said so)

Three parts, each printing a table:

1. The GPU tests: pytest on the files below (every ``gpu``-marked test, and the Triton kernels
   against the float64 reference, compiled on the GPU): each backend on decode, prefill and mixed
   batches at block sizes 16 and 256; CUDA-graph greedy output equal to eager; the profiled KV
   sizing.
2. Decode attention per layer at Llama-8B's attention shape (32 query heads, 8 KV heads, head
   dim 128, bf16), for every backend that runs here, against the bandwidth bound: the K/V bytes
   the step must read divided by the device's copy bandwidth (measured: a device-to-device copy
   of ``2 * size`` bytes moved, read plus write).
3. The engine on a generated Llama of 8B shape (random bf16 weights written to a temporary folder)
   at batch 1, 32 and 128: decode tokens/s, and its ratio to the weights-bandwidth bound
   ``batch / (weight bytes / copy bandwidth)`` (every decode step reads every weight once; the KV
   reads come on top, so the bound is optimistic at long contexts).

``--dry-run`` runs the same code on the CPU with tiny shapes: the pytest part runs (its CUDA tests
skip), attention times the torch backend only, the engine runs a tiny model at batch 1 and 4.
tests/bench/test_gpu_check.py runs it, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._common import print_table  # noqa: E402
from bench._synthetic_llama import LLAMA_8B, LLAMA_TINY, write_synthetic_llama  # noqa: E402
from replica.attention import (  # noqa: E402
    FlashAttnBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    allocate_kv_caches,
    build_attention_metadata,
)
from replica.attention.flash_attn_backend import flash_attn_builds  # noqa: E402
from replica.attention.triton_backend import triton_available  # noqa: E402
from replica.engine.config import EngineConfig  # noqa: E402
from replica.engine.engine import LLMEngine  # noqa: E402
from replica.engine.params import SamplingParams  # noqa: E402

GPU_TESTS = (
    "tests/replica/attention/test_backends_cuda.py",
    "tests/replica/attention/test_triton_backend.py",
    "tests/replica/attention/test_flash.py",
    "tests/replica/engine/test_cuda_graphs.py",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, CUDA-only parts skipped")
    p.add_argument("--skip-tests", action="store_true", help="leave out part 1 (pytest)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per request in part 3")
    p.add_argument("--tokenizer-dir", type=Path, help="a default-model folder to copy the tokenizer from (default: generate)")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` calls after one warm-up."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a ``copy_`` of ``nbytes`` moves (read + write), on ``device``."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, iters=10)
    return 2 * nbytes / seconds


def run_tests(dry_run: bool) -> int:
    print("\n== 1. GPU tests" + (" (dry run: the CUDA tests skip on this machine)" if dry_run else ""))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *GPU_TESTS]
    if dry_run:
        cmd += ["-m", "gpu"]  # only the CUDA tests, which skip here: the list and the selection are checked
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-12:]
    print("\n".join(tail))
    return proc.returncode


def attention_backends(device: torch.device, block_size: int) -> list[tuple[str, object]]:
    """(label, backend) for every backend that runs on ``device`` at ``block_size``."""
    found: list[tuple[str, object]] = [("torch", TorchAttentionBackend())]
    if device.type != "cuda":
        return found
    if triton_available():
        found.append(("triton", TritonAttentionBackend()))
    build = next((b for b in flash_attn_builds() if block_size % b.block_multiple == 0), None)
    if build is not None:
        found.append((f"flash_attn ({build.module})", FlashAttnBackend(build.module)))
    return found


def decode_case_rows(
    device: torch.device, dtype: torch.dtype, bandwidth: float, shape: tuple[int, int, int], block_size: int,
    batch: int, context: int,
) -> list[tuple[object, ...]]:
    """One table row per backend: ``batch`` decodes of ``context`` tokens each, one layer."""
    heads, kv_heads, head_dim = shape
    blocks_per = -(-context // block_size)
    (cache,) = allocate_kv_caches(1, batch * blocks_per + 1, block_size, kv_heads, head_dim, dtype, device)
    cache.normal_()
    tables = [list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per)) for i in range(batch)]
    md, _ = build_attention_metadata([1] * batch, [context] * batch, tables, block_size, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
    bound = kv_bytes / bandwidth
    rows = []
    for label, backend in attention_backends(device, block_size):
        if device.type == "cuda" and label == "torch" and batch * context > 64 * 1024:
            continue  # the gather path: slow, and not what runs on a GPU
        seconds = timed(lambda b=backend: b._attend(q, (q, q), cache, md, head_dim**-0.5), device, iters=20)
        rows.append((label, block_size, batch, context, f"{kv_bytes / 2**20:.1f}", f"{seconds * 1e6:.1f}",
                     f"{bound * 1e6:.1f}", f"{bound / seconds:.2f}"))  # fmt: skip
    return rows


def attention_table(device: torch.device, dtype: torch.dtype, bandwidth: float, dry_run: bool) -> None:
    print("\n== 2. Decode attention per layer against the bandwidth bound"
          + (" (dry run: tiny shapes, torch backend only; triton and flash_attn need CUDA)" if dry_run else ""))  # fmt: skip
    shape = (8, 2, 64) if dry_run else (32, 8, 128)  # query heads, KV heads, head dim
    cases = [(4, 128)] if dry_run else [(32, 1024), (128, 1024), (32, 4096)]  # (batch, context)
    rows = []
    for block_size in (16, 256):
        for batch, context in cases:
            rows += decode_case_rows(device, dtype, bandwidth, shape, block_size, batch, context)
    print_table(("backend", "block", "batch", "context", "KV MiB", "us/layer", "bound us", "of bound"), rows)


def engine_table(
    device: torch.device, bandwidth: float, dry_run: bool, decode_tokens: int, tokenizer_dir: Path | None
) -> None:
    shape = LLAMA_TINY if dry_run else LLAMA_8B
    batches = (1, 4) if dry_run else (1, 32, 128)
    prompt_len = 16 if dry_run else 128
    dtype = torch.float32 if dry_run else torch.bfloat16
    print(f"\n== 3. The engine on a generated Llama ({shape.num_hidden_layers} layers, hidden {shape.hidden_size}, "
          f"random {str(dtype).removeprefix('torch.')} weights)"
          + (" (dry run: tiny shape on the CPU, no CUDA graphs)" if dry_run else ""))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvroute-gpu-check-") as tmp:
        t0 = time.perf_counter()
        folder = Path(tmp) / "llama"
        weight_bytes = write_synthetic_llama(folder, shape, dtype=dtype, device=device.type, tokenizer_dir=tokenizer_dir)
        written = time.perf_counter() - t0
        config = EngineConfig(device=device.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(batches),
                              max_model_len=prompt_len + decode_tokens + 16, num_blocks=512 if dry_run else None,
                              max_num_batched_tokens=8192)  # fmt: skip
        engine = LLMEngine(folder, config)
        loaded = time.perf_counter() - t0 - written
        print(f"weights {weight_bytes / 2**30:.2f} GiB, written in {written:.0f} s, engine up in {loaded:.0f} s; "
              f"attention backend {engine.attn_backend.name} ({engine.attn_backend.reason}); CUDA graphs "
              f"{'on, sizes up to ' + str(engine.runner.graphs.sizes[-1]) if engine.runner.graphs else 'off'}")  # fmt: skip
        step_bound = weight_bytes / bandwidth
        rows = []
        for batch in batches:
            gen = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(1000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
            params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
            reqs = [engine.add_request(p, params) for p in prompts]
            while not all(r.output_token_ids for r in reqs):  # the prefills, untimed
                engine.step()
            done, steps = sum(len(r.output_token_ids) for r in reqs), 0
            sync(device)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            sync(device)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.output_token_ids) for r in reqs) - done
            rate, bound = tokens / seconds, batch / step_bound
            rows.append((batch, steps, f"{seconds * 1e3 / steps:.2f}", f"{rate:.0f}", f"{bound:.0f}", f"{rate / bound:.2f}"))
            engine.kv.reset_prefix_cache()
        print_table(("batch", "decode steps", "ms/step", "tokens/s", "bound tokens/s", "of bound"), rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    bandwidth = copy_bandwidth(device, (64 if args.dry_run else 2048) * 2**20)
    print(f"device {name}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    rc = 0 if args.skip_tests else run_tests(args.dry_run)
    attention_table(device, torch.float32 if args.dry_run else torch.bfloat16, bandwidth, args.dry_run)
    engine_table(device, bandwidth, args.dry_run, 4 if args.dry_run else args.decode_tokens, args.tokenizer_dir)
    print(f"\ndone in {time.perf_counter() - started:.0f} s; tests {'passed' if rc == 0 else f'FAILED (pytest rc {rc})'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
