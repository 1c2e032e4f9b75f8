"""Which attention backend runs: choose_backend's table, and select_backend probing real imports."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from replica.attention import FlashAttnBackend, TorchAttentionBackend, TritonAttentionBackend
from replica.attention.backend import FlashBuild
from replica.attention.selector import BackendChoice, choose_backend, resolve_backend, select_backend

UPSTREAM = FlashBuild("flash_attn", 256)
FORK = FlashBuild("vllm_flash_attn", 16)
BUILDS = {"none": (), "upstream": (UPSTREAM,), "fork": (FORK,), "both": (FORK, UPSTREAM)}
BF16, FP32 = torch.bfloat16, torch.float32

# (device, block_size, builds, triton importable, requested, dtype) -> backend name (and flash module),
# or (exception type, words the message must hold).
TABLE = [
    # auto on CPU: always torch, whatever is installed.
    ("cpu", 16, "both", True, "auto", FP32, "torch"),
    ("cpu", 256, "upstream", True, "auto", BF16, "torch"),
    # auto on CUDA: flash-attn when a build pages the block size, else triton, else torch.
    ("cuda", 16, "fork", True, "auto", BF16, ("flash_attn", "vllm_flash_attn")),
    ("cuda", 16, "both", True, "auto", BF16, ("flash_attn", "vllm_flash_attn")),
    ("cuda", 256, "upstream", True, "auto", BF16, ("flash_attn", "flash_attn")),
    ("cuda", 512, "upstream", False, "auto", torch.float16, ("flash_attn", "flash_attn")),
    ("cuda", 16, "upstream", True, "auto", BF16, "triton"),
    ("cuda", 8, "fork", True, "auto", BF16, "triton"),
    ("cuda", 16, "none", True, "auto", BF16, "triton"),
    ("cuda", 256, "upstream", True, "auto", FP32, "triton"),  # flash-attn takes no float32
    ("cuda", 16, "upstream", False, "auto", BF16, "torch"),
    ("cuda", 16, "none", False, "auto", BF16, "torch"),
    # asked for by name
    ("cpu", 16, "none", False, "torch", FP32, "torch"),
    ("cuda", 16, "both", True, "torch", BF16, "torch"),
    ("cuda", 16, "fork", False, "flash_attn", BF16, ("flash_attn", "vllm_flash_attn")),
    ("cuda", 256, "upstream", False, "flash_attn", BF16, ("flash_attn", "flash_attn")),
    ("cuda", 16, "upstream", True, "flash_attn", BF16, (ValueError, ["block_size 16", "multiples of 256"])),
    ("cuda", 40, "both", True, "flash_attn", BF16, (ValueError, ["block_size 40", "multiples of 16", "multiples of 256"])),
    ("cuda", 16, "none", True, "flash_attn", BF16, (ImportError, ["no flash-attention build"])),
    ("cuda", 16, "fork", True, "flash_attn", FP32, (ValueError, ["float32"])),
    ("cpu", 256, "upstream", True, "flash_attn", BF16, (ValueError, ["needs a CUDA device", "cpu"])),
    ("cuda", 1, "both", True, "triton", FP32, "triton"),
    ("cuda", 16, "both", False, "triton", BF16, (ImportError, ["triton package"])),
    ("cpu", 16, "none", True, "triton", FP32, (ValueError, ["needs a CUDA device"])),
    ("cuda", 16, "both", True, "xformers", BF16, (ValueError, ["unknown attention backend 'xformers'"])),
]


@pytest.mark.parametrize(("device", "block_size", "builds", "triton", "requested", "dtype", "expected"), TABLE)
def test_each_combination_picks_the_documented_backend_or_error(device, block_size, builds, triton, requested, dtype,
                                                                 expected):  # fmt: skip
    def choose() -> BackendChoice:
        return choose_backend(requested, device_type=device, block_size=block_size, dtype=dtype,
                              flash_builds=BUILDS[builds], triton_importable=triton)  # fmt: skip

    if isinstance(expected, tuple) and isinstance(expected[0], type):
        error, words = expected
        with pytest.raises(error) as raised:
            choose()
        for word in words:
            assert word in str(raised.value)
        assert str(raised.value).startswith("attn_backend:"), "the message names the setting"
        return
    choice = choose()
    name, module = expected if isinstance(expected, tuple) else (expected, None)
    assert (choice.name, choice.flash_build) == (name, module)
    assert choice.reason


def test_reasons_say_why_the_fallback_happened():
    def reason(builds, triton, dtype=BF16):
        return choose_backend("auto", device_type="cuda", block_size=16, dtype=dtype, flash_builds=BUILDS[builds],
                              triton_importable=triton).reason  # fmt: skip

    assert reason("upstream", True) == "no flash-attention build pages block_size 16 (flash_attn pages multiples of 256)"
    assert reason("none", True) == "no flash-attention build is importable"
    assert reason("none", False) == "no flash-attention build is importable and triton is not installed (gather + SDPA)"
    assert reason("fork", True, FP32) == "dtype float32: flash-attention takes float16/bfloat16 only"


def _fake_flash(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.flash_attn_varlen_func = lambda *a, **k: None
    return module


@pytest.fixture
def only_upstream_flash(monkeypatch):
    """Upstream flash-attn importable (a stand-in), vLLM's fork not."""
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash("flash_attn"))


def test_select_backend_probes_the_installed_builds(only_upstream_flash, caplog):
    caplog.set_level("INFO", logger="replica.attention.selector")
    choice, backend = resolve_backend("cuda", block_size=256, dtype=BF16)
    assert isinstance(backend, FlashAttnBackend) and backend.module == "flash_attn"
    assert choice.name == "flash_attn"
    choice, backend = resolve_backend("cuda", block_size=16, dtype=BF16)
    assert isinstance(backend, TritonAttentionBackend)
    assert "attention backend triton: no flash-attention build pages block_size 16" in caplog.text
    with pytest.raises(ValueError, match="cannot page block_size 16: flash_attn pages multiples of 256"):
        select_backend("cuda", "flash_attn", block_size=16, dtype=BF16)
    assert isinstance(select_backend("cpu", block_size=16, dtype=FP32), TorchAttentionBackend)
