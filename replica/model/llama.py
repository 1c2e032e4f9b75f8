"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flattened batch of tokens and a paged KV
cache.

Architecture (Touvron et al. 2023, "LLaMA"; Qwen2 adds q/k/v bias): token embedding, then per
layer ``h = x + o_proj(attn(rope(q), rope(k), v))`` over ``input_layernorm(x)`` and
``out = h + down(silu(gate(y)) * up(y))`` over ``y = post_attention_layernorm(h)``; a final RMSNorm
and the LM head; RoPE lives in ``replica.model.rope``. Parameter names are Hugging Face's, so a
``model.safetensors`` state dict loads as is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvroute.model_folder import ModelLoadError
from replica.attention.backend import AttentionBackend
from replica.attention.metadata import AttentionMetadata
from replica.attention.torch_backend import TorchAttentionBackend
from replica.model.config import ModelConfig
from replica.model.rope import RotaryEmbedding, apply_rotary

__all__ = [
    "LayerInputs",
    "LlamaAttention",
    "LlamaDecoder",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
    "linear_t",
    "rms_norm",
]

_MAX_NAMES_IN_ERROR = 12


class LayerInputs(NamedTuple):
    """What every decoder layer of one step reads besides its hidden states and its own KV cache:
    the rotary (cos, signed sin) of the step's positions, each [T, 1, head_dim] (``RotaryEmbedding``),
    and the step's ``AttentionMetadata``. Built once per step by ``LlamaModel.forward``."""

    cos: torch.Tensor
    sin: torch.Tensor
    metadata: AttentionMetadata


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``,
    computed in float32 and cast back before the weight, as Hugging Face's Llama does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` as a function. In float32 ``torch.rms_norm`` computes Hugging Face's expression
    (the same ops in the same order, bitwise equal) in one call instead of six; other dtypes keep
    HF's rounding: normalise in float32, cast, then scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention (Ainslie et al. 2023) over the paged cache of one layer.

    ``q_proj`` / ``k_proj`` / ``v_proj`` keep Hugging Face's names and shapes, but after
    ``fuse_projections`` (run by ``__init__`` and ``LlamaModel.load_weights``) their weights and
    biases are views into one ``qkv_weight_t`` / ``qkv_bias`` buffer, so that a step runs one matmul
    for all three and RoPE once over q and k together; ``o_proj.weight`` is a view of
    ``o_weight_t``. Weight buffers are stored transposed (see ``_fuse_linears``). Moving the model
    with ``.to()`` afterwards copies the views apart (same values, twice the memory); load on the
    target device instead, as ``load_model_folder`` does.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.backend = backend
        hidden, q_out, kv_out = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_proj_bias)
        self.register_buffer("qkv_weight_t", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("o_weight_t", None, persistent=False)
        self.fuse_projections()

    def fuse_projections(self) -> None:
        """(Re)build ``qkv_weight_t`` / ``qkv_bias`` from q/k/v_proj and ``o_weight_t`` from o_proj,
        and make their parameters views into them."""
        self.qkv_weight_t, self.qkv_bias = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.o_weight_t, _ = _fuse_linears(self.o_proj)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: LayerInputs) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into ``kv_cache``."""
        cos, sin, metadata = step
        num_tokens = x.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear_t(x, self.qkv_weight_t, self.qkv_bias)
        qk_width = (num_heads + num_kv_heads) * head_dim
        qk = apply_rotary(qkv[:, :qk_width].view(num_tokens, num_heads + num_kv_heads, head_dim), cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, qk_width:].view(num_tokens, num_kv_heads, head_dim)
        o = self.backend.forward(q, k, v, kv_cache, metadata, self.scaling)
        return linear_t(o.reshape(num_tokens, num_heads * head_dim), self.o_weight_t, self.o_proj.bias)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; each weight is a view of a
    transposed buffer (``gate_weight_t``, ``up_weight_t``, ``down_weight_t``, see ``_fuse_linears``).

    Gate and up run as two matmuls, not one over a fused ``[gate; up]`` weight as they once did:
    ``silu`` on the strided half of a fused output is slower than on a contiguous gate and rounds
    differently, and a contiguous gate is what Hugging Face's ``act_fn(gate_proj(x))`` runs on.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.register_buffer("gate_weight_t", None, persistent=False)
        self.register_buffer("up_weight_t", None, persistent=False)
        self.register_buffer("down_weight_t", None, persistent=False)
        self.fuse_projections()

    def fuse_projections(self) -> None:
        """(Re)build the transposed weight buffers and make gate/up/down_proj's weights views into them."""
        self.gate_weight_t, _ = _fuse_linears(self.gate_proj)
        self.up_weight_t, _ = _fuse_linears(self.up_proj)
        self.down_weight_t, _ = _fuse_linears(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        h = F.silu(linear_t(x, self.gate_weight_t, self.gate_proj.bias))
        h.mul_(linear_t(x, self.up_weight_t, self.up_proj.bias))
        return linear_t(h, self.down_weight_t, self.down_proj.bias)


def linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [T, in] and ``weight_t = weight.t()`` stored [in, out]
    row-major (``_fuse_linears``): ``x @ weight_t (+ bias)``. Bitwise equal to ``F.linear`` from 8
    rows up (MKL); at 1 row a different gemv path rounds differently (in the last digits)."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears over the same input along the output dim,
    into one buffer stored transposed (``[in, sum of out]``, row-major), and re-point each linear's
    parameters at its slice of the result (a ``[out, in]`` view, column-major), so that the Hugging
    Face names still load, count and read the same values with no second copy. Returns
    (transposed weight, bias).

    Why transposed: MKL's ``x @ W.t()`` with ``W`` stored [out, in] (what ``F.linear`` runs) is
    slower than ``x @ Wt`` with ``Wt`` stored [in, out] when the weights are not in cache, which in
    a decode step they never are (the step streams the KV cache past them)."""
    weight_t = torch.cat([lin.weight.detach().t() for lin in linears], dim=1)  # one copy, contiguous
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight_t[:, start : start + n].t(), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight_t, bias


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: LayerInputs) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Adds into ``x`` in place: the decoder owns its hidden
        states (the embedding lookup makes a fresh tensor), and this saves two allocations."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x = x.add_(self.self_attn.forward(rms_norm(x, ln1.weight, ln1.eps), kv_cache, step))
        return x.add_(self.mlp.forward(rms_norm(x, ln2.weight, ln2.eps)))


class LlamaDecoder(nn.Module):
    """The ``model.`` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """Llama / Mistral / Qwen2 causal LM with Hugging Face parameter names
    (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ...,
    ``model.norm.weight``, ``lm_head.weight``; the LM head shares the embedding when
    ``tie_word_embeddings``).

    Works on a flattened batch: ``forward`` takes every scheduled token of every request of a
    step, their positions, one KV cache per layer, and the step's ``AttentionMetadata``.
    Inference only (call under ``torch.inference_mode()``).
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend if attn_backend is not None else TorchAttentionBackend()
        self.model = LlamaDecoder(config, self.attn_backend)
        self.rotary_emb = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("lm_head_weight_t", None, persistent=False)
        self._tie_or_fuse_lm_head()

    def _tie_or_fuse_lm_head(self) -> None:
        """Tied: the LM head is the embedding (stored [vocab, hidden] for the lookup; the head runs
        ``F.linear`` on it). Untied: its weight becomes a view of the transposed ``lm_head_weight_t``."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head_weight_t = None
        else:
            self.lm_head_weight_t, _ = _fuse_linears(self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder on one step's tokens.

        Args:
            input_ids: int64 [T] token ids (padded rows may hold any valid id).
            positions: int64 [T] position of each token in its sequence.
            kv_caches: ``num_hidden_layers`` tensors ``(2, num_blocks, block_size, num_kv_heads,
                head_dim)``, written in place at ``attn_metadata.slot_mapping``.
            attn_metadata: the step's metadata (``replica.attention.build_attention_metadata``).

        Returns:
            Final-norm hidden states [T, hidden_size] in the model dtype.

        Raises:
            ValueError: ``kv_caches`` has the wrong number of layers.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV caches (one per layer), got {len(kv_caches)}")
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        cos, sin = self.rotary_emb(positions, h.dtype, max_position=attn_metadata.max_seq_len - 1)
        step = LayerInputs(cos, sin, attn_metadata)
        # Layers are called through .forward: nn.Module.__call__'s hook checks cost something on
        # every call, and a decode step of a small model makes many of them.
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer.forward(h, kv_cache, step)
        norm = self.model.norm
        return rms_norm(h, norm.weight, norm.eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (the rows to sample from) -> float32 logits [N, vocab_size]."""
        if self.lm_head_weight_t is None:
            return F.linear(hidden_states, self.lm_head.weight).float()
        return linear_t(hidden_states, self.lm_head_weight_t, None).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint") -> None:
        """Take every parameter from ``(name, tensor)`` pairs, strictly, by Hugging Face name.

        Tensors are used as given (convert dtype/device first); they replace the parameters
        (``assign``), so a model built on the ``meta`` device loads without a first allocation.
        Ignored: ``*.rotary_emb.inv_freq`` (old checkpoints store it) and ``lm_head.weight`` when
        the embeddings are tied. Raises ``ModelLoadError`` listing missing and unexpected names and
        mismatched shapes, naming ``source``.
        """
        tied = self.config.tie_word_embeddings
        params = dict(self.named_parameters())  # a tied lm_head appears once, as model.embed_tokens
        state: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        bad_shapes: dict[str, str] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
            elif tuple(tensor.shape) != tuple(param.shape):
                bad_shapes[name] = f"{name} {tuple(tensor.shape)} (expected {tuple(param.shape)})"
            else:
                state[name] = tensor
        missing = sorted(n for n in params if n not in state and n not in bad_shapes)
        problems = []
        if missing:
            problems.append("missing " + _names(missing))
        if unexpected:
            problems.append("unexpected " + _names(sorted(unexpected)))
        if bad_shapes:
            problems.append("wrong shape " + _names(list(bad_shapes.values())))
        if problems:
            raise ModelLoadError(
                f"weights in {source} don't fit {self.config.architecture}: " + "; ".join(problems), path=source
            )
        self.load_state_dict(state, strict=False, assign=True)
        self._tie_or_fuse_lm_head()
        for p in self.parameters():
            p.requires_grad_(False)
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}] ({len(names)})"
