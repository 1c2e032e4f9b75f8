"""Next-token sampling for a batch of requests (vLLM v1 ``Sampler`` semantics, our implementation).

Input: the last-position logits of every request that samples this step, ``[num_reqs, vocab]``,
and each request's ``SamplingState``. Output: one token id per request, ``[num_reqs]`` int64.

Per row, in vLLM v1's order (``vllm/v1/sample/sampler.py`` + ``ops/topk_topp_sampler.py``)::

    logits ─▶ min_tokens mask (EOS + stop_token_ids = -inf while too few tokens) ─▶ penalties
           ├─ temperature == 0 ─▶ argmax (ties: lowest token id)                     [greedy rows]
           └─ / temperature ─▶ min_p ─▶ top_k ─▶ top_p ─▶ softmax ─▶ exponential race [random rows]

min_p before top-k/top-p is vLLM v1's order (min-p is an "argmax-invariant logits processor"
applied before ``TopKTopPSampler``). min-p compares ``p_i / p_max``, which truncation does not
change, so min-p commutes with top-k; only its position relative to top-p matters.

Penalties, vLLM's (``vllm/model_executor/layers/utils.py`` ``apply_penalties``), on every row
with one set, before greedy or random sampling: with ``seen`` the tokens of prompt or output and
``count`` each token's occurrences in the output::

    logit = logit / repetition_penalty  if seen and logit > 0
            logit * repetition_penalty  if seen and logit <= 0
    logit -= frequency_penalty * count + presence_penalty * (count > 0)

Random draw: the *exponential race* (Gumbel-max in another form) vLLM uses: draw ``q_i ~ Exp(1)``
for every token and take ``argmax(p_i / q_i)``; token i wins with probability ``p_i`` exactly.
Each seeded request draws its ``vocab`` exponentials from its own ``torch.Generator``, seeded once
at its first sample and advanced by exactly ``vocab`` draws per step, so its tokens depend only on
its seed, its logits and its step count, never on the other rows of the batch. Unseeded rows draw
from the sampler's shared generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from replica.engine.params import EosTokenIds, SamplingParams, eos_token_set

# vLLM raises temperatures in (0, 0.01) to 0.01: smaller ones overflow float32 logits / T.
_MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingState:
    """What the sampler keeps for one request across steps: its params and its own generator.

    The engine creates one per request at admission and passes it to ``Sampler.sample`` on every
    step the request samples. ``generator`` is ``None`` until the request's first sample; for a
    request with a seed it is then a ``torch.Generator`` on the logits' device seeded with
    ``params.seed``, advanced by every later sample (never re-seeded, so a step samples with fresh
    randomness). Unseeded requests never get one.
    """

    params: SamplingParams
    generator: torch.Generator | None = field(default=None, repr=False)

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The request's generator on ``device`` (created and seeded on first use), or ``None``
        when the request has no seed."""
        if self.params.seed is None:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.params.seed)
        return self.generator


class Sampler:
    """Turns a batch of logits into next-token ids, one request per row (see module docstring).

    Args:
        eos_token_id: the model's EOS id or ids, masked by ``min_tokens`` (unless
            ``ignore_eos``); ``None`` when the model has none.
        seed: seed of the shared generator used by requests without a seed; ``None`` seeds it
            from the OS (non-deterministic). Set it in tests.

    Holds one shared ``torch.Generator`` per device, created lazily.
    """

    def __init__(self, eos_token_id: EosTokenIds = None, seed: int | None = None) -> None:
        self.eos_token_ids = eos_token_set(eos_token_id)
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        num_output_tokens: Sequence[int],
        token_ids: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[num_reqs, vocab]`` float (any float dtype; computed in float32), the
                logits of each request's last position. Not modified.
            states: ``num_reqs`` per-request states, in row order.
            num_output_tokens: per row, tokens the request has generated so far (for
                ``min_tokens``; the token sampled now is not counted).
            token_ids: per row, ``(prompt token ids, output token ids so far)``, read for the
                penalties; needed only when a row has one.

        Returns:
            ``[num_reqs]`` int64 token ids on ``logits.device``.

        Raises:
            ValueError: when ``logits`` is not 2-D, the sequence lengths don't match its rows, or a
                row has a penalty and ``token_ids`` is missing.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}")
        num_reqs, vocab = logits.shape
        if len(states) != num_reqs or len(num_output_tokens) != num_reqs:
            raise ValueError(
                f"{num_reqs} logits rows but {len(states)} states and {len(num_output_tokens)} counts"
            )
        device = logits.device
        if num_reqs == 0:
            return torch.empty(0, dtype=torch.int64, device=device)
        counts = zip(states, num_output_tokens, strict=True)
        penalised = [i for i, st in enumerate(states) if st.params.has_penalties]
        if penalised and (token_ids is None or len(token_ids) != num_reqs):
            raise ValueError("token_ids: needed for every row when a row has a penalty")
        if not penalised and all(s.params.is_greedy and n >= s.params.min_tokens for s, n in counts):
            # The common all-greedy step with no min_tokens mask: one argmax over the batch, no copy
            # (the float32 cast does not change which index is maximal, and logits stay unmodified).
            return logits.argmax(dim=-1)
        out = torch.empty(num_reqs, dtype=torch.int64, device=device)
        logits = logits.to(torch.float32, copy=True)
        self._apply_min_tokens(logits, states, num_output_tokens)
        if penalised:
            assert token_ids is not None
            p = [states[i].params for i in penalised]
            rows = torch.tensor(penalised, device=device)
            logits[rows] = apply_penalties(
                logits[rows], [token_ids[i][0] for i in penalised], [token_ids[i][1] for i in penalised],
                [x.repetition_penalty for x in p], [x.presence_penalty for x in p], [x.frequency_penalty for x in p],
            )

        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=device)
            # torch.argmax returns the first maximal index: ties go to the lowest token id.
            out[idx] = logits[idx].argmax(dim=-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=device)
            out[idx] = self._sample_random(logits[idx], [states[i] for i in random_rows])
        return out

    def _apply_min_tokens(
        self, logits: torch.Tensor, states: Sequence[SamplingState], num_output_tokens: Sequence[int]
    ) -> None:
        """In place: -inf on EOS (unless ``ignore_eos``) and ``stop_token_ids`` for rows that have
        generated fewer than ``min_tokens`` tokens (vLLM's ``MinTokensLogitsProcessor``)."""
        rows: list[int] = []
        cols: list[int] = []
        for i, (state, n) in enumerate(zip(states, num_output_tokens, strict=True)):
            p = state.params
            if n >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids |= self.eos_token_ids
            for tok in stop_ids:
                rows.append(i)
                cols.append(tok)
        if rows:
            logits[rows, cols] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and the exponential race on ``[n, vocab]`` float32
        logits (modified in place); returns ``[n]`` int64."""
        n, vocab = logits.shape
        device = logits.device
        temperature = torch.tensor(
            [max(s.params.temperature, _MIN_TEMPERATURE) for s in states], dtype=torch.float32, device=device
        )
        logits.div_(temperature.unsqueeze(1))

        min_p = [s.params.min_p for s in states]
        if any(m > 0.0 for m in min_p):
            probs = logits.softmax(dim=-1)
            max_prob = probs.amax(dim=-1, keepdim=True)
            threshold = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(1) * max_prob
            logits.masked_fill_(probs < threshold, float("-inf"))

        # top_k <= 0 or >= vocab is "off": keep all vocab tokens.
        top_k = [s.params.top_k if 1 <= s.params.top_k < vocab else vocab for s in states]
        top_p = [s.params.top_p for s in states]
        use_top_k = any(k < vocab for k in top_k)
        use_top_p = any(p < 1.0 for p in top_p)
        if use_top_k or use_top_p:
            logits = _top_k_top_p(logits, top_k if use_top_k else None, top_p if use_top_p else None)

        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        shared_rows = []
        for i, state in enumerate(states):
            gen = state.generator_for(device)
            if gen is None:
                shared_rows.append(i)
            else:
                q[i].exponential_(generator=gen)
        if shared_rows:
            shared = torch.empty((len(shared_rows), vocab), dtype=torch.float32, device=device)
            shared.exponential_(generator=self._shared_generator(device))
            q[shared_rows] = shared
        # An Exp(1) draw can be exactly 0; clamping keeps p/q finite (and 0 for masked tokens, so a
        # filtered token can never win).
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return probs.div_(q).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def _token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[n, vocab]`` int64: how often each token id occurs in each row's ``ids``."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.int64)  # column vocab: padding
    for i, x in enumerate(ids):
        padded[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
    counts = torch.zeros((len(ids), vocab + 1), dtype=torch.int64)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab].to(device)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
) -> torch.Tensor:
    """vLLM's repetition, presence and frequency penalties on ``[n, vocab]`` float logits (the
    formula in the module docstring; the repetition penalty over prompt and output tokens, the
    other two over the output, as OpenAI defines them).

    Args:
        logits: ``[n, vocab]`` float32; modified in place and returned.
        prompt_token_ids, output_token_ids: ``n`` rows of token ids in ``[0, vocab)``.
        repetition_penalty: ``n`` values > 0 (1 = off); presence_penalty, frequency_penalty: ``n``
            values (0 = off).

    Returns:
        ``logits``, penalised.
    """
    n, vocab = logits.shape
    device = logits.device
    out_counts = _token_counts(output_token_ids, vocab, device)
    seen = (_token_counts(prompt_token_ids, vocab, device) > 0) | (out_counts > 0)
    rep = torch.tensor(repetition_penalty, dtype=logits.dtype, device=device).unsqueeze(1)
    rep = torch.where(seen, rep, torch.ones_like(logits))
    logits.mul_(torch.where(logits > 0, 1.0 / rep, rep))
    freq = torch.tensor(frequency_penalty, dtype=logits.dtype, device=device).unsqueeze(1)
    pres = torch.tensor(presence_penalty, dtype=logits.dtype, device=device).unsqueeze(1)
    logits.sub_(freq * out_counts.to(logits.dtype) + pres * (out_counts > 0).to(logits.dtype))
    return logits


def _top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int] | None, top_p: Sequence[float] | None
) -> torch.Tensor:
    """Top-k then top-p on ``[n, vocab]`` logits; returns filtered logits (-inf where dropped).

    One stable descending sort serves both filters (stable: equal logits keep token-id order).
    top-k keeps every token whose logit is >= the k-th largest, so ties at the boundary survive, as
    in vLLM. top-p keeps the smallest head of the sorted distribution whose mass reaches ``top_p``:
    token i stays iff the mass strictly before it is < ``top_p``, which always keeps the top token.
    """
    n, vocab = logits.shape
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.tensor(top_k, dtype=torch.int64, device=device).unsqueeze(1)
        kth = sorted_logits.gather(1, k - 1)
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 get an infinite threshold: float rounding of the cumulative sum
        # must not drop the tail when the filter is off.
        p = torch.tensor([x if x < 1.0 else float("inf") for x in top_p], dtype=torch.float32, device=device)
        drop = mass_before >= p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
