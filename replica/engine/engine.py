"""LLMEngine: validation, scheduling, the forward pass, sampling and stopping, step by step."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvroute.engine_info import EngineInfo
from kvroute.events import KVCacheEvent
from kvroute.hashing import BlockHasher, BlockHashKeys
from kvroute.prompt import InvalidRequestError as PromptError
from kvroute.prompt import text_ids
from replica.attention import kv_cache_block_bytes
from replica.attention.metadata import cuda_graph_sizes
from replica.attention.selector import resolve_backend
from replica.engine.config import EngineConfig, compute_num_blocks
from replica.engine.detokenizer import IncrementalDetokenizer
from replica.engine.errors import InvalidRequestError
from replica.engine.params import FinishReason, SamplingParams, eos_token_set, validate_request
from replica.engine.profiling import profile_activation_bytes
from replica.engine.request import Request, RequestStatus
from replica.engine.runner import ModelRunner
from replica.engine.sampling import Sampler, SamplingState
from replica.engine.scheduler import Scheduler, SchedulerOutput
from replica.engine.step_rates import StepTimer
from replica.engine.stop import check_stop
from replica.kv import KVCacheManager
from replica.model.loader import load_model_folder


@dataclass
class RequestOutput:
    """One request's progress from one step (a stream delta).

    ``new_token_ids`` / ``text`` are what this step added; on the last output ``finished`` is True
    with ``finish_reason`` and ``matched_stop`` (a stop string, a stop/EOS token id, or None).
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class StepStats:
    """What the last step scheduled, in tokens: the engine's own per-step stats (``last_step``).

    Not the load sample (``replica.telemetry.EngineSample``: queues, KV usage, cumulative cache
    counters after a step) nor the frontend's ``StepReport`` (``replica.engine.step_hook``).
    """

    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0  # scheduled tokens of requests still in their prompt
    num_decode_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # taken from the prefix cache by requests admitted this step
    num_preempted: int = 0
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class _Live:
    request: Request
    sampling: SamplingState
    detok: IncrementalDetokenizer
    pending_ids: list[int] = field(default_factory=list)


class LLMEngine:
    """A replica's engine: ``add_request`` / ``abort_request`` / ``step``.

    Not thread-safe: one thread drives it (``AsyncLLMEngine`` runs it off the event loop).
    ``make_request`` only validates and is safe to call from any thread.

    Raises (constructor):
        ModelLoadError: the model folder cannot be loaded (message names the file).
        ValueError: a setting is inconsistent (message names it).
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        self.model_dir = Path(model_dir)
        self.attn_backend, backend = resolve_backend(
            device, config.attn_backend, block_size=config.block_size, dtype=dtype
        )
        loaded = load_model_folder(model_dir, device, dtype, attn_backend=backend)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        eos = self.tokenizer.eos_token_ids or tuple(mcfg.eos_token_ids or ())
        self.eos_token_id: int | None = eos[0] if eos else None
        self.extra_eos_token_ids: tuple[int, ...] = tuple(eos[1:])
        self._eos_token_set = eos_token_set(self.eos_token_id)
        # One-token decodes, shared by every request's detokenizer (decode of one id never changes).
        self._single_token_text: dict[int, str] = {}
        B = config.block_size
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        block_bytes = kv_cache_block_bytes(B, mcfg.num_key_value_heads, mcfg.head_dim, dtype, mcfg.num_hidden_layers)
        activation_bytes = 0
        if device.type == "cuda" and config.num_blocks is None:
            activation_bytes = profile_activation_bytes(
                self.model, block_size=B, max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs, dtype=dtype,
            )  # fmt: skip
        self.activation_bytes = activation_bytes
        self.num_blocks = compute_num_blocks(config, device, block_bytes, weight_bytes, activation_bytes)
        kv_capacity_tokens = (self.num_blocks - 1) * B
        max_model_len = config.max_model_len or mcfg.max_model_len
        if config.max_model_len is None:
            # Like vLLM, a sequence of max_model_len tokens must fit in the KV cache on its own;
            # unlike vLLM we shrink the default instead of failing, and say so in model info.
            max_model_len = min(max_model_len, kv_capacity_tokens)
        elif not 2 <= max_model_len <= mcfg.max_model_len:
            # Past the model's own limit (max_position_embeddings, or the sliding window we compute
            # as full attention) outputs are silently wrong; vLLM refuses this too.
            raise ValueError(
                f"max_model_len: must be in [2, {mcfg.max_model_len}] (one prompt and one output token; the"
                f" longest sequence this model computes exactly), got {max_model_len}"
            )
        elif max_model_len > kv_capacity_tokens:
            raise ValueError(
                f"max_model_len: {max_model_len} tokens do not fit in the KV cache ({self.num_blocks - 1} blocks of"
                f" {B} = {kv_capacity_tokens} tokens); raise the KV budget or lower max_model_len"
            )
        self.max_model_len = max_model_len
        self.hasher = BlockHasher(config.hash_algorithm, config.hash_seed, B)
        use_graphs = device.type == "cuda" and not config.enforce_eager and backend.cuda_graph_safe
        self.runner = ModelRunner(
            self.model, self.num_blocks, B, device, dtype, config.cpu_offload_blocks,
            cuda_graph_sizes=cuda_graph_sizes(config.max_num_seqs) if use_graphs else (), max_model_len=max_model_len,
        )  # fmt: skip
        self.kv = KVCacheManager(
            self.num_blocks,
            B,
            self.hasher,
            enable_caching=config.enable_prefix_caching,
            max_model_len=max_model_len,
            # No vocab_size: make_request already validated every prompt id (InvalidRequestError
            # naming the field) and the sampler only produces ids < vocab, so checking again on
            # every admission and decode step would be the same O(n) work twice.
            vocab_size=None,
            free_order=config.free_order,
            cpu_num_blocks=config.cpu_offload_blocks,
            copy_fn=self.runner.copy_block if config.cpu_offload_blocks else None,
        )
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler(self.eos_token_id, config.seed)
        self.device = device
        self.dtype = dtype
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.last_step = StepStats()
        self.num_steps = 0
        self.step_timer = StepTimer()  # measured prefill rate and decode step time (the heartbeat's)

    # -- requests ---------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of a text prompt: :func:`kvroute.prompt.text_ids`, the router's and the
        frontend's function (the tokenizer's BOS rule applies).

        Raises:
            InvalidRequestError: ``prompt`` when ``text`` is empty.
        """
        try:
            return text_ids(self.tokenizer, text)
        except PromptError as e:  # raised again as the engine's own type (an EngineError): same field, same words
            raise InvalidRequestError(e.field, e.reason) from None

    def info(self, model: str) -> EngineInfo:
        """This engine's identity and limits, served under the name ``model``."""
        algorithm, seed_digest, block_size = self.hasher.identity
        return EngineInfo(
            model=model, vocab_size=self.vocab_size, max_model_len=self.max_model_len, block_size=block_size,
            num_blocks=self.num_blocks, hash_algorithm=algorithm, hash_seed_digest=seed_digest,
            eos_token_id=self.eos_token_id, extra_eos_token_ids=tuple(self.extra_eos_token_ids),
            attn_backend=self.attn_backend.name, attn_backend_reason=self.attn_backend.reason,
        )

    def make_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and build a request without touching the engine state (thread-safe).

        Raises:
            InvalidRequestError: naming the field (prompt, prompt.token_ids, max_tokens, ...).
        """
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            max_tokens = validate_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        except PromptError as e:  # kvroute.sampling's check, raised again as the engine's own type
            raise InvalidRequestError(e.field, e.reason) from None
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + self.extra_eos_token_ids))
            )
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt", "must be a string")
        return Request(
            request_id=request_id or f"req-{time.monotonic_ns()}-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            hash_keys=BlockHashKeys(cache_salt=cache_salt or None),
        )

    def add_request(
        self,
        prompt: str | Sequence[int] | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request (validated first; nothing is allocated on error).

        Raises:
            InvalidRequestError: a bad field, or ``request_id`` already in use.
        """
        req = prompt if isinstance(prompt, Request) else self.make_request(prompt, params, request_id, cache_salt)
        if req.request_id in self._live:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already in use")
        detok = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=self.eos_token_id,
            single_token_text=self._single_token_text,
        )
        self._live[req.request_id] = _Live(req, SamplingState(req.sampling_params), detok)
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its final output, or None if it is unknown
        or already finished (idempotent)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        req = live.request
        self.scheduler.finish_request(req)
        req.finish_reason = FinishReason.ABORT
        return self._output(live, [], "", finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, detokenize, check stops; free finished requests.

        Returns one output per request that produced a token or finished this step.
        """
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self._record(sched)
        if sched.is_empty:
            return []
        try:
            return self._run(sched)
        finally:
            st = self.last_step
            self.step_timer.observe(st.num_prefill_tokens, st.num_decode_tokens, time.perf_counter() - t0)

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        logits = self.runner.execute(sched)
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return []
        lives = [self._live[r.request_id] for r in sampling]
        tokens = self.sampler.sample(logits, [lv.sampling for lv in lives], [len(r.output_token_ids) for r in sampling],
                                     [(r.prompt_token_ids, r.output_token_ids) for r in sampling])
        outputs = []
        for live, tok in zip(lives, tokens.tolist(), strict=True):
            req = live.request
            req.append_output_token(tok)
            text = live.detok.update([tok])
            finished, reason, matched = check_stop(
                req.output_token_ids,
                req.sampling_params,
                eos_token_id=self._eos_token_set,
                max_tokens=req.max_tokens,
                matched_stop_str=live.detok.matched_stop,
            )
            if finished:
                text += live.detok.finish()
                req.finish_reason, req.matched_stop = reason, matched
                self.scheduler.finish_request(req)
                del self._live[req.request_id]
            outputs.append(self._output(live, [tok], text, finished))
        return outputs

    def _record(self, sched: SchedulerOutput) -> None:
        st = StepStats(num_prefix_hit_tokens=sched.num_prefix_hit_tokens, num_preempted=len(sched.preempted))
        for s in sched.scheduled:
            st.num_scheduled_tokens += s.num_scheduled_tokens
            if s.start < s.request.num_prompt_tokens:
                st.num_prefill_tokens += s.num_scheduled_tokens
            else:
                st.num_decode_tokens += s.num_scheduled_tokens
        st.num_running, st.num_waiting = self.num_running, self.num_waiting
        self.last_step = st
        self.num_steps += 1

    def _output(self, live: _Live, new_ids: list[int], text: str, finished: bool) -> RequestOutput:
        req = live.request
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text=text,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            matched_stop=req.matched_stop if finished else None,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
            cached_tokens=max(req.num_cached_tokens, 0),
        )

    # -- conveniences -------------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV events since the last call (a step's removals before its stores)."""
        return self.kv.take_events()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Request]:
        """Run prompts to completion (tests, benchmarks). Returns the finished requests in order."""
        plist = params if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished_requests():
            self.step()
        return reqs

    @property
    def usage(self) -> float:
        return self.kv.usage

    def is_idle(self) -> bool:
        return not self._live and self.scheduler.num_unfinished == 0


__all__ = ["LLMEngine", "RequestOutput", "RequestStatus", "StepStats"]
