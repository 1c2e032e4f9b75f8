"""``config.json`` of a Hugging Face Llama-family checkpoint, parsed into one frozen ``ModelConfig``.

Pure Python (json only, no torch), so that anything can read a model's shape without loading it.
Both spellings of the RoPE fields are accepted: transformers v4 writes ``rope_theta`` +
``rope_scaling``, v5 writes one ``rope_parameters`` dict (``rope_type``, ``rope_theta``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.model_folder import ModelLoadError, read_json_file

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
CONFIG_FILENAME = "config.json"

# A config without "architectures" (e.g. a bare LlamaConfig().save_pretrained) still names its model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_REQUIRED = object()


@dataclass(frozen=True)
class RopeScaling:
    """RoPE context-extension parameters (the non-default ``rope_type`` of a config).

    - ``linear``: every inverse frequency divided by ``factor`` (position interpolation).
    - ``llama3``: Llama 3.1's frequency-dependent rule; needs ``low_freq_factor``,
      ``high_freq_factor`` and ``original_max_position_embeddings``.
    - ``yarn``: YaRN (Peng et al. 2023, arXiv:2309.00071): a ramp between interpolated and
      extrapolated frequencies between the ``beta_fast`` / ``beta_slow`` rotation counts, plus an
      ``attention_factor`` that scales cos/sin (default ``0.1 * ln(factor) + 1``).
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2).

    Lengths are in tokens. ``attention_bias`` is the bias on the q/k/v projections (Qwen2 always has
    it); ``o_proj_bias`` the bias on the output projection (Llama's ``attention_bias`` sets both,
    Qwen2 has none). ``eos_token_ids`` is a tuple because configs may list several.
    ``sliding_window`` is kept for information: the engine computes full attention, so it must cap
    the context at ``max_model_len``, where full and windowed attention still agree.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output, tokens) this implementation computes exactly."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = CONFIG_FILENAME) -> ModelConfig:
        """Build from the parsed JSON of a ``config.json``.

        ``source`` names the file in error messages. Raises ``ModelLoadError`` for an unsupported
        architecture (naming it and the supported ones), a missing or ill-typed field, an
        unsupported RoPE type or activation, or inconsistent head counts.
        """
        architecture = _architecture(raw, source)
        model_type = str(raw.get("model_type") or "")
        hidden_size = _int(raw, "hidden_size", source)
        num_heads = _int(raw, "num_attention_heads", source)
        num_kv_heads = _int(raw, "num_key_value_heads", source, default=num_heads)
        head_dim = _int(raw, "head_dim", source, default=None)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ModelLoadError(
                    f"{source}: hidden_size {hidden_size} is not a multiple of num_attention_heads "
                    f"{num_heads} and no head_dim is given",
                    path=source,
                )
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}",
                path=source,
            )
        if head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim {head_dim} must be even for RoPE", path=source)
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(
                f"{source}: hidden_act {hidden_act!r} is not supported (Llama-family models use 'silu')",
                path=source,
            )
        rope_theta, rope_scaling = _rope(raw, source)

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(raw.get("attention_bias", False))
        sliding_window = _int(raw, "sliding_window", source, default=None)
        if is_qwen2 and not raw.get("use_sliding_window", False):
            sliding_window = None

        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_int(raw, "intermediate_size", source),
            num_hidden_layers=_int(raw, "num_hidden_layers", source),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(raw, "rms_norm_eps", source, default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(raw, "max_position_embeddings", source, default=2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else llama_bias,
            o_proj_bias=False if is_qwen2 else llama_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=_int(raw, "bos_token_id", source, default=None, minimum=0),
            eos_token_ids=_token_ids(raw.get("eos_token_id"), "eos_token_id", source),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding_window,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        """Read ``<folder>/config.json``. Raises ``ModelLoadError`` naming the file and folder when it
        is missing or not valid JSON, and as ``from_dict`` does."""
        folder = Path(folder)
        path = folder / CONFIG_FILENAME
        return cls.from_dict(read_json_file(path, folder), source=str(path))


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if archs:
        names = [archs] if isinstance(archs, str) else list(archs)
        for name in names:
            if name in SUPPORTED_ARCHITECTURES:
                return name
        found = ", ".join(map(str, names))
    else:
        model_type = raw.get("model_type")
        if model_type in _ARCHITECTURE_OF_MODEL_TYPE:
            return _ARCHITECTURE_OF_MODEL_TYPE[model_type]
        found = f"none listed (model_type {model_type!r})"
    raise ModelLoadError(
        f"{source}: unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        path=source,
    )


def _rope(raw: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        raise ModelLoadError(f"{source}: rope_parameters / rope_scaling must be objects", path=source)
    # v5 folds everything into rope_parameters; v4 has rope_theta at top level and rope_scaling.
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise ModelLoadError(f"{source}: rope_theta must be a positive number, got {theta!r}", path=source)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
            path=source,
        )
    prf = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ModelLoadError(f"{source}: partial_rotary_factor {prf} is not supported", path=source)
    if rope_type == "default":
        return float(theta), None

    max_pos = _int(raw, "max_position_embeddings", source, default=2048)
    orig = _int(merged, "original_max_position_embeddings", source, default=None)
    factor = _float(merged, "factor", source, default=None)
    if rope_type == "linear":
        if factor is None:
            raise ModelLoadError(f"{source}: linear RoPE scaling needs 'factor'", path=source)
        return float(theta), RopeScaling("linear", factor)
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if merged.get(k) is None]
        if missing or orig is None:
            missing += [] if orig is not None else ["original_max_position_embeddings"]
            raise ModelLoadError(f"{source}: llama3 RoPE scaling needs {', '.join(missing)}", path=source)
        low = _float(merged, "low_freq_factor", source)
        high = _float(merged, "high_freq_factor", source)
        if high <= low:
            raise ModelLoadError(f"{source}: llama3 RoPE needs high_freq_factor > low_freq_factor", path=source)
        return float(theta), RopeScaling(
            "llama3", factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=orig
        )
    # yarn
    orig = orig if orig is not None else max_pos
    if factor is None:
        factor = max_pos / orig
    return float(theta), RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=orig,
        beta_fast=_float(merged, "beta_fast", source, default=None) or 32.0,
        beta_slow=_float(merged, "beta_slow", source, default=None) or 1.0,
        attention_factor=_float(merged, "attention_factor", source, default=None),
        mscale=_float(merged, "mscale", source, default=None),
        mscale_all_dim=_float(merged, "mscale_all_dim", source, default=None),
        truncate=bool(merged.get("truncate", True)),
    )


def _int(raw: Mapping[str, Any], key: str, source: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{source}: required field {key!r} is missing", path=source)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"{source}: {key!r} must be an integer >= {minimum}, got {value!r}", path=source)
    return value


def _float(raw: Mapping[str, Any], key: str, source: str, default: Any = _REQUIRED) -> Any:
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{source}: required field {key!r} is missing", path=source)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{source}: {key!r} must be a number, got {value!r}", path=source)
    return float(value)


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"{source}: {key!r} must be a token id or a list of them, got {value!r}", path=source)
    return tuple(dict.fromkeys(values))
