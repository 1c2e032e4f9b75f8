"""Rotary position embedding (Su et al. 2021, "RoFormer") in the rotate-half convention of Hugging
Face's Llama: the head dimension is split in two halves ``(x1, x2)`` rotated as ``(x1 cos - x2 sin,
x2 cos + x1 sin)``; the frequencies follow the checkpoint's ``rope_scaling`` (linear, llama3, yarn).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvroute.model_folder import ModelLoadError
from replica.model.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies float32 [head_dim / 2] (radians per position) and the cos/sin scale.

    ``inv_freq[i] = theta ** (-2i / head_dim)`` (RoFormer), then per ``scaling.rope_type``:
    ``linear`` divides by ``factor``; ``llama3`` (Llama 3.1) keeps wavelengths shorter than
    ``orig / high_freq_factor``, divides those longer than ``orig / low_freq_factor`` by ``factor``,
    and interpolates linearly in ``orig / wavelength`` between; ``yarn`` (arXiv:2309.00071 §3)
    blends interpolated and extrapolated frequencies with a linear ramp over the dimensions whose
    rotation count over ``orig`` positions lies between ``beta_slow`` and ``beta_fast``, and scales
    cos/sin by ``attention_factor`` (default ``0.1 ln(factor) + 1``). Computed on the CPU in float32.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    factor = scaling.factor
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    orig = scaling.original_max_position_embeddings
    assert orig is not None  # the config parser guarantees it for llama3 and yarn
    if scaling.rope_type == "llama3":
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(medium, blended, scaled), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling, orig)
    raise ModelLoadError(f"unsupported rope_type {scaling.rope_type!r}")


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling, orig: int
) -> tuple[torch.Tensor, float]:
    factor = scaling.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
    else:
        attention_factor = mscale(factor)

    def dim_of_rotations(rotations: float) -> float:
        # The dimension index whose wavelength fits `rotations` times into `orig` positions.
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of_rotations(scaling.beta_fast), dim_of_rotations(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    blended = (inv_freq / factor) * ramp + inv_freq * extrapolation_weight
    return blended, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin of the step's positions, looked up in tables computed once per device and dtype.

    Table row ``p`` holds ``cos(p * inv_freq)`` and ``sin(p * inv_freq)`` (each half repeated, as
    rotate-half needs), times the attention scaling, computed in float32 exactly as the on-the-fly
    formula would and then cast; the sin half that multiplies ``x2`` is stored negated, so that
    ``apply_rotary`` needs no ``neg`` (``x2 * -s`` is exactly ``-(x2 * s)``). Tables grow by
    doubling to cover the largest position seen (a 128k-context model never builds rows it does
    not use). ``inv_freq`` is a plain float32 attribute rather than a buffer so that
    ``model.to(bfloat16)`` can't round it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq, self.attention_scaling = rope_inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling
        )
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[>= num_positions, 2, head_dim] in ``dtype``: row p is (cos, signed sin) of position p."""
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table.shape[0] < num_positions:
            size = max(64, 1 << (max(num_positions, 1) - 1).bit_length())
            positions = torch.arange(size, dtype=torch.int64, device="cpu")
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
            cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
            table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)
            table = self._tables[key] = table.to(device=device, dtype=dtype)
        return table

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, signed sin), each [T, 1, head_dim] in ``dtype`` (views of
        one gathered [T, 2, head_dim] tensor). ``max_position`` (the largest position, when the
        caller knows it) saves reading it back from ``positions``."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        rows = self.table(max_position + 1, positions.device, dtype).index_select(0, positions)
        return rows[:, 0:1], rows[:, 1:2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos / signed sin [T, 1, head_dim] (``RotaryEmbedding``):
    ``x * cos + cat(x2, x1) * sin``, which is HF's rotate-half ``x * cos + cat(-x2, x1) * sin``
    with the sign folded into the table. Returns a new contiguous tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x2, x1), dim=-1)
    rotated.mul_(sin)
    return torch.mul(x, cos).add_(rotated)
