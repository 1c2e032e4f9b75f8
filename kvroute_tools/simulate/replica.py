"""One simulated replica: the real KV cache manager driven by the real scheduler, in virtual time.

    add(request) ──▶ replica.engine.scheduler.Scheduler ──▶ replica.kv.KVCacheManager (the real ones)
    start(now) ──▶ a Step (one engine step, or a decode window) with its end time from the TimingModel
    finish(step) ──▶ first tokens, finished requests, the step's KV events

Every step that admits, prefills or preempts is one real ``Scheduler.schedule()``. A run of pure
decode steps (nothing waiting, every running request one token from its next sample) is simulated
as one *decode window* of k steps: k is the fewest tokens any running request has left, cut so
that the blocks it needs are free (else one real step). The window makes the same allocations the
k single steps would make, in a different interleaving across requests (so the same blocks are
evicted and cached), and its duration is the sum of the k steps' durations (closed form). A
request routed here during a window cuts it at the end of the step in progress, as the scheduler
would admit it there. What the window changes: the KV events of its k steps come out together at
its end, and a heartbeat during it shows the state at its start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.events import KVCacheEvent
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad
from kvroute_tools.simulate.timing import TimingModel
from replica.engine.params import SamplingParams
from replica.engine.request import Request
from replica.engine.scheduler import Scheduler
from replica.engine.step_rates import StepTimer
from replica.kv import KVCacheManager

DECODE_TOKEN = 1 << 40  # every generated token: no trace block uses this id, so no prompt hits it
_PARAMS = SamplingParams()


@dataclass(eq=False, slots=True)
class SimRequest:
    """One trace request on its way through the cluster (times in virtual seconds)."""

    index: int
    arrival_s: float
    prompt: list[int]
    output_tokens: int
    replica: str = ""
    request: Request | None = None
    ticket: object = None
    router: int = 0  # which of the cluster's routers routed it (and releases its ticket)
    first_token_s: float = -1.0
    finish_s: float = -1.0
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class Step:
    """A planned step (``window`` > 0: a decode window of that many steps) ending at ``end_s``;
    ``seqs`` sequences decoded (per step of a window), ``prefill_tokens`` prompt tokens computed."""

    start_s: float
    end_s: float
    window: int = 0
    scheduled: list = field(default_factory=list)
    seqs: int = 0
    kv_tokens: int = 0
    prefill_tokens: int = 0


class SimReplica:
    """A replica of ``num_blocks`` KV blocks (block 0 included) with the scheduler's limits.

    Raises:
        ValueError: inconsistent sizes (from the KV manager or the scheduler).
    """

    def __init__(self, replica_id: str, num_blocks: int, hasher: BlockHasher, timing: TimingModel, *,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, cpu_num_blocks: int = 0):
        self.replica_id = replica_id
        self.block_size = hasher.block_size
        self.kv = KVCacheManager(num_blocks, hasher.block_size, hasher, enable_kv_cache_events=True,
                                 cpu_num_blocks=cpu_num_blocks, copy_fn=_no_copy if cpu_num_blocks else None)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs)
        self.timing = timing
        self.step_timer = StepTimer()  # the measured rates its heartbeats carry, as a real replica's
        self.step: Step | None = None
        self.sim: dict[str, SimRequest] = {}  # request_id -> its SimRequest, while here
        self.routed = 0
        self.busy_s = 0.0
        self.steps = 0

    # -- requests ------------------------------------------------------------------------------------
    def add(self, sr: SimRequest, now: float) -> None:
        """Queue a routed request (it is admitted at the next step boundary)."""
        req = Request(f"q{sr.index}", sr.prompt, _PARAMS, sr.output_tokens, arrival_time=now)
        sr.request, sr.replica, sr.prompt_tokens = req, self.replica_id, len(sr.prompt)
        self.sim[req.request_id] = sr
        self.scheduler.add_request(req)
        self.routed += 1

    @property
    def idle(self) -> bool:
        return self.step is None

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def load(self) -> EngineLoad:
        """The heartbeat's load part, as of the last applied step."""
        kv, s = self.kv, self.scheduler
        rates = self.step_timer.rates
        return EngineLoad(free_blocks=kv.num_free_blocks, running=len(s.running), waiting=len(s.waiting),
                          usage=kv.usage, queued_prefill_tokens=s.queued_prefill_tokens,
                          prefill_tokens_per_s=rates.prefill_tokens_per_s,
                          decode_seconds_per_running=rates.decode_seconds_per_running)

    # -- steps -----------------------------------------------------------------------------------------
    def start(self, now: float) -> Step | None:
        """Plan the next step from ``now``; None when there is nothing to run."""
        if not self.has_work():
            self.step = None
            return None
        k = self._window_length()
        if k >= 2:
            seqs = len(self.scheduler.running)
            kv_tokens = sum(r.num_computed_tokens for r in self.scheduler.running)
            end = now + self.timing.decode_window(seqs, kv_tokens, k)
            self.step = Step(now, end, window=k, seqs=seqs, kv_tokens=kv_tokens)
            return self.step
        out = self.scheduler.schedule()
        if out.is_empty and not out.preempted:  # pragma: no cover - the cluster checks request sizes first
            raise RuntimeError(f"{self.replica_id}: nothing schedulable with {len(self.scheduler.waiting)} waiting")
        prefill = decode = kv_read = 0
        for s in out.scheduled:
            if s.num_scheduled_tokens == 1 and s.request.output_token_ids and s.samples:
                decode += 1
            else:
                prefill += s.num_scheduled_tokens
            kv_read += s.start + s.num_scheduled_tokens
        self.step = Step(now, now + self.timing.step_seconds(prefill, decode, kv_read), scheduled=out.scheduled,
                         seqs=decode, prefill_tokens=prefill)
        return self.step

    def _window_length(self) -> int:
        """How many pure-decode steps can run as one window now (0 or 1: take a real step)."""
        s = self.scheduler
        if s.waiting or not s.running or len(s.running) > s.max_num_batched_tokens:
            return 0
        k = None
        for r in s.running:
            if not r.output_token_ids or r.num_computed_tokens != r.num_tokens - 1:
                return 0
            left = r.max_tokens - len(r.output_token_ids)
            k = left if k is None or left < k else k
        if k is None or k < 2:
            return 0
        free = self.kv.num_free_blocks
        while k >= 2 and self._blocks_needed(k) > free:
            k //= 2
        return k

    def _blocks_needed(self, k: int) -> int:
        B, tables = self.block_size, self.kv.req_to_blocks
        return sum(max(0, -(-(r.num_computed_tokens + k) // B) - len(tables[r.request_id]))
                   for r in self.scheduler.running)

    def cut(self, now: float) -> Step | None:
        """A request arrived at ``now`` during a decode window: end the window after the step in
        progress. Returns the shortened step, or None when the current step is not a window."""
        st = self.step
        if st is None or st.window < 2 or now >= st.end_s:
            return None
        lo, hi = 1, st.window  # the smallest j whose end is >= now
        while lo < hi:
            mid = (lo + hi) // 2
            if st.start_s + self.timing.decode_window(st.seqs, st.kv_tokens, mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo == st.window:
            return None
        st.window = lo
        st.end_s = st.start_s + self.timing.decode_window(st.seqs, st.kv_tokens, lo)
        return st

    def finish(self) -> tuple[list[SimRequest], list[SimRequest], list[KVCacheEvent]]:
        """Apply the planned step's outputs at its end: (requests that got their first token,
        requests that finished, the KV events of the step)."""
        st = self.step
        assert st is not None
        self.steps += st.window or 1
        self.busy_s += st.end_s - st.start_s
        self.step_timer.observe(st.prefill_tokens, st.seqs * (st.window or 1), st.end_s - st.start_s)
        first: list[SimRequest] = []
        done: list[Request] = []
        if st.window:
            # k steps compute the k tokens from the last sampled one on and sample k new ones:
            # the k - 1 in between must be there for allocate_slots (and are hashed by it).
            tokens = [DECODE_TOKEN] * (st.window - 1)
            for r in self.scheduler.running:
                r.output_token_ids.extend(tokens)
                r.all_token_ids.extend(tokens)
                if self.kv.allocate_slots(r, st.window) is None:  # pragma: no cover - checked by _window_length
                    raise AssertionError(f"decode window: blocks for {r.request_id} ran out")
                r.num_computed_tokens += st.window
                r.append_output_token(DECODE_TOKEN)
                if len(r.output_token_ids) >= r.max_tokens:
                    done.append(r)
        else:
            for s in st.scheduled:
                r = s.request
                if not s.samples or r.is_finished:
                    continue
                r.append_output_token(DECODE_TOKEN)
                if len(r.output_token_ids) == 1:
                    sr = self.sim[r.request_id]
                    sr.first_token_s = st.end_s
                    sr.cached_tokens = r.num_cached_tokens
                    first.append(sr)
                if len(r.output_token_ids) >= r.max_tokens:
                    done.append(r)
        finished = []
        for r in done:
            self.scheduler.finish_request(r)
            sr = self.sim.pop(r.request_id)
            sr.finish_s = st.end_s
            sr.request = None
            finished.append(sr)
        self.step = None
        return first, finished, self.kv.take_events()


def _no_copy(direction: str, src: int, dst: int) -> None:
    """The CPU tier's block copy: nothing to copy in a simulation. Its time is not modelled: a CPU
    hit costs a step no more than a GPU hit."""


__all__ = ["DECODE_TOKEN", "SimReplica", "SimRequest", "Step"]
