"""Decode CUDA graphs, the CUDA defaults and the profiled KV sizing: what can be checked on the CPU,
then the GPU tests (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from replica.attention import TorchAttentionBackend
from replica.attention.metadata import cuda_graph_sizes, padded_batch_size
from replica.engine.config import EngineConfig, compute_num_blocks
from replica.engine.cuda_graphs import DecodeCudaGraphs
from replica.engine.engine import LLMEngine
from replica.engine.params import SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[1 + i, 17, 33 + 2 * i, 250, 7] * (1 + i % 3) for i in range(11)]


def test_the_size_ladder_and_padding():
    assert cuda_graph_sizes(1) == (1,)
    assert cuda_graph_sizes(3) == (1, 2, 4)
    assert cuda_graph_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert cuda_graph_sizes(256)[-2:] == (248, 256) and len(cuda_graph_sizes(256)) == 3 + 32
    sizes = cuda_graph_sizes(20)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 24, 25)] == [1, 4, 8, 8, 16, 24, None]
    with pytest.raises(ValueError, match="max_num_seqs"):
        cuda_graph_sizes(0)


def test_cuda_sizing_follows_the_formula_with_the_measured_activations(monkeypatch):
    # 10 GiB device, 1 GiB free: 9 GiB in use, of which this process's torch holds 6 GiB, so
    # others hold 3 GiB. 0.9 * 10 - 3 - weights 2 - activations 1 = 3 GiB = 3072 blocks of 1 MiB.
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 10 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 6 * gib)
    config = EngineConfig(gpu_memory_utilization=0.9)
    n = compute_num_blocks(config, torch.device("cuda"), 2**20, weight_bytes=2 * gib, activation_bytes=gib)
    assert n == int((0.9 * 10 - 3 - 2 - 1) * gib // 2**20)
    with pytest.raises(ValueError, match="leaves"):
        compute_num_blocks(config, torch.device("cuda"), 2**20, weight_bytes=2 * gib, activation_bytes=4 * gib)


def test_dtype_defaults_to_bfloat16_on_cuda_and_float32_on_cpu():
    config = EngineConfig()
    assert config.resolve_dtype(torch.device("cuda")) == torch.bfloat16
    assert config.resolve_dtype(torch.device("cpu")) == torch.float32
    assert EngineConfig(dtype="float16").resolve_dtype(torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8").resolve_dtype(torch.device("cuda"))


def test_graphs_refuse_a_backend_that_reads_host_values():
    class Model:
        attn_backend = TorchAttentionBackend()

    with pytest.raises(ValueError, match="'torch' cannot run under CUDA graphs"):
        DecodeCudaGraphs(Model(), [torch.zeros(1)], 16, 64, (1, 2))


def test_on_cpu_no_graphs_run_and_the_info_names_the_backend(default_model_dir):
    engine = LLMEngine(default_model_dir, EngineConfig(device="cpu", num_blocks=64))
    assert engine.runner.graphs is None
    info = engine.info("m")
    assert (info.attn_backend, info.attn_backend_reason) == ("torch", "device cpu: the CUDA kernels do not run here")


def _greedy(model_dir, max_tokens: list[int], **config) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(model_dir, EngineConfig(device="cuda", attn_backend="triton", num_blocks=512, **config))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = engine.generate(PROMPTS[: len(max_tokens)], params)
    return [list(o.output_token_ids) for o in outs], engine


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "max_tokens"),
    [
        # Different lengths: requests finish at different steps, so decode batches of 11 down to 1
        # (padded up to 16, 8, 4, 2, 1) all occur. In float32 a padded batch's matmuls round
        # differently from an unpadded one's only far below what could flip a greedy pick.
        ("float32", [8 + 3 * i for i in range(11)]),
        # bfloat16 with every batch at a captured size (8 requests in lockstep): the same kernels on
        # the same shapes, so the tokens must match exactly.
        ("bfloat16", [24] * 8),
    ],
)
def test_greedy_output_is_identical_with_graphs_on_and_off(default_model_dir, dtype, max_tokens):
    eager, e = _greedy(default_model_dir, max_tokens, dtype=dtype, enforce_eager=True)
    assert e.runner.graphs is None
    graphed, g = _greedy(default_model_dir, max_tokens, dtype=dtype, max_num_seqs=16)
    assert g.runner.graphs is not None and g.runner.graphs.sizes == (1, 2, 4, 8, 16)
    assert g.runner.num_graph_steps >= 20, "the decode steps replayed graphs"
    assert graphed == eager


@cuda
@pytest.mark.gpu
def test_kv_sizing_on_cuda_measures_activations_and_the_largest_step_fits(default_model_dir):
    config = EngineConfig(device="cuda", attn_backend="triton", gpu_memory_utilization=0.5, max_num_batched_tokens=2048,
                          enforce_eager=True)  # fmt: skip
    engine = LLMEngine(default_model_dir, config)
    # The tiny model's logits alone (2048 x vocab x 4 bytes at most; 256 rows here) bound it below.
    assert engine.activation_bytes >= 256 * engine.vocab_size * 4
    free, total = torch.cuda.mem_get_info()
    assert total - free <= total * 0.5 + 256 * 2**20, "weights + KV + activations stay near the budget"
    # A step of max_num_batched_tokens prompt tokens peaks within the measured activations.
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prompts = [[5 + i % 200 for i in range(1024)], [9 + i % 100 for i in range(1024)]]
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    assert torch.cuda.max_memory_allocated() - base <= engine.activation_bytes * 1.1


def test_a_padded_decode_step_on_the_graph_buffers_equals_the_eager_step(default_model_dir):
    """What a replay computes, without a GPU: the model run on DecodeBuffers filled from a real
    decode step (5 requests padded to 8: seq_len 0, slot -1) with the triton backend (under the
    interpreter without CUDA), against the same step run eagerly on a copy of the cache."""
    from replica.attention import TritonAttentionBackend, build_attention_metadata
    from replica.engine.cuda_graphs import DecodeBuffers
    from replica.model.loader import load_model_folder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_model_folder(default_model_dir, device, torch.float32, attn_backend=TorchAttentionBackend())
    # One layer is enough (and keeps the interpreter, which runs kernel programs one at a time, quick).
    model.model.layers = model.model.layers[:1]
    caches = [torch.zeros(2, 32, 4, 4, 32, device=device)]
    prompt_lens = [3, 6, 1, 9, 4]
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(5)]
    with torch.inference_mode():
        md, pos = build_attention_metadata(prompt_lens, prompt_lens, tables, 4, device=device)
        model(torch.arange(1, 1 + sum(prompt_lens), device=device), pos, caches, md)  # the prompts' K/V, by the torch backend
        model.model.layers[0].self_attn.backend = TritonAttentionBackend()
        md, pos = build_attention_metadata([1] * 5, [n + 1 for n in prompt_lens], tables, 4, device=device)
        ids = torch.tensor([11, 12, 13, 14, 15], device=device)
        eager_caches = [c.clone() for c in caches]
        eager = model(ids, pos, eager_caches, md)
        buffers = DecodeBuffers(cuda_graph_sizes(8), max_blocks=8, max_model_len=32, device=torch.device(device))
        assert buffers.fits(md)
        size = buffers.fill(ids, pos, md)
        assert size == 8
        assert buffers.seq_lens[5:8].tolist() == [0, 0, 0] and buffers.slot_mapping[5:8].tolist() == [-1] * 3
        replay = model(buffers.input_ids[:size], buffers.positions[:size], caches, buffers.metadata(size))
    torch.testing.assert_close(replay[:5], eager, atol=1e-5, rtol=1e-5)
    for c, e in zip(caches, eager_caches, strict=True):  # the same slots written (and nothing else)
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
