"""Random scheduler programs against the KV cache manager (hypothesis stateful testing).

The machine plays a scheduler: new requests (sharing prefixes so that hits happen, sometimes salted
or with a LoRA), admissions with prefix hits, chunked prefill, decode steps, finishes, preemptions
(free, ``num_computed_tokens = 0``, re-admission later) and ``reset_prefix_cache``, with and without
the CPU tier. It models KV *data* independently of the manager: when a request computes a full
block, the block's content becomes the reference digest (cbor2 + hashlib, written here) of the
prefix it holds; the fake copy function moves contents between GPU blocks and CPU slots. Checked
after every step:

- ref counts are never negative; free + in use == num_blocks - 1; no referenced block is queued;
  ref_cnt == the number of block tables holding the block;
- every cached digest (GPU and CPU) is the content of its block/slot, i.e. the tokens that block
  holds produce that hash; every prefix hit (GPU or copied back from CPU) holds the request's data;
- the events emitted so far, replayed into a per-medium multiset, equal cached_event_hashes();
  every GPU BlockStored is a correct chain segment (parent + tokens + extra keys -> hashes);
- stats count queries and hits in tokens, once per admission; usage = 1 - free / (num_blocks - 1).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.hashing import BlockHashKeys
from replica.kv import KVCacheManager, SimpleKVRequest
from tests.replica.kv._reference import NONE_HASH, event_int, ref_digest

MAX_TOKENS = 40
# Three base prompts over a tiny vocabulary: requests take a prefix of one and add a tail.
BASES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7] * 2,
    [5, 5, 5, 5, 6, 6, 6, 6] * 4,
    list(range(9, 41)),
]


class Req:
    """The test's view of a request: its KV request, the reference chain of its blocks."""

    def __init__(self, rid, tokens, salt, lora):
        keys = BlockHashKeys(lora=(lora, f"/loras/{lora}") if lora else None, cache_salt=salt)
        self.kv = SimpleKVRequest(rid, list(tokens), hash_keys=keys, lora_name=lora)
        self.salt, self.lora = salt, lora
        self.chain: list[bytes] = []

    def extra(self, i):
        keys = []
        if self.lora:
            keys.append(("lora", self.lora, f"/loras/{self.lora}"))
        if i == 0 and self.salt:
            keys.append(("cache_salt", self.salt))
        return tuple(keys) if keys else None

    def ref_chain(self, B):
        tokens = self.kv.all_token_ids
        while len(self.chain) < len(tokens) // B:
            i = len(self.chain)
            parent = self.chain[-1] if self.chain else NONE_HASH
            self.chain.append(ref_digest(parent, tokens[i * B : (i + 1) * B], self.extra(i)))
        return self.chain


class KVMachine(RuleBasedStateMachine):
    cpu_tier: bool | None = None  # None: drawn

    def __init__(self):
        super().__init__()
        self.mgr = None

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 24),
        cpu_blocks=st.integers(1, 6),
        free_order=st.sampled_from(["lru", "fifo"]),
    )
    def setup(self, block_size, num_blocks, cpu_blocks, free_order):
        self.B = block_size
        self.cpu_blocks = cpu_blocks if self.cpu_tier else 0
        self.gpu_data: dict[int, object] = {}  # block id -> reference digest of the prefix it holds
        self.cpu_data: dict[int, object] = {}  # CPU slot -> same
        self.copies: list[tuple[str, int, int]] = []
        self.mgr = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            free_order=free_order,
            vocab_size=64,
            cpu_num_blocks=self.cpu_blocks,
            copy_fn=self.copy if self.cpu_blocks else None,
        )
        self.waiting: list[Req] = []
        self.running: dict[str, Req] = {}
        self.next_id = 0
        self.replayed = {GPU: Counter(), CPU: Counter()}
        self.digest_of: dict[int, bytes] = {event_int(NONE_HASH): NONE_HASH}
        self.queries = self.hits = self.cpu_hits = 0

    def copy(self, direction, src, dst):
        self.copies.append((direction, src, dst))
        if direction == "to_cpu":
            self.cpu_data[dst] = self.gpu_data.get(src)
        else:
            self.gpu_data[dst] = self.cpu_data.get(src)

    # -- helpers -------------------------------------------------------------------------------
    def snapshot(self):
        pool = self.mgr.block_pool
        cpu = dict(pool.cpu_pool._entries) if pool.cpu_pool else {}  # read-only: digest -> (slot, event)
        return (
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {r: [b.block_id for b in t] for r, t in self.mgr.req_to_blocks.items()},
            (self.mgr.stats.queries, self.mgr.stats.hits, self.mgr.stats.cpu_hits),
            list(cpu.items()),
        )

    def compute(self, req: Req, start: int, end: int):
        """The engine computes tokens [start, end) of ``req`` into its blocks."""
        B = self.B
        table = self.mgr.get_block_ids(req.kv.request_id)
        chain = req.ref_chain(B)
        for i in range(start // B, -(-end // B)):
            full = (i + 1) * B <= end
            self.gpu_data[table[i]] = chain[i] if full else ("partial", req.kv.request_id, i)
        for d in chain:
            self.digest_of[event_int(d)] = d

    def replay(self):
        events = self.mgr.take_events()
        for e in events:
            if isinstance(e, BlockStored):
                self.replayed[e.medium].update(e.block_hashes)
                if e.medium == GPU:
                    self.check_stored_segment(e)
            elif isinstance(e, BlockRemoved):
                self.replayed[e.medium].subtract(e.block_hashes)
                assert all(self.replayed[e.medium][h] >= 0 for h in e.block_hashes), (
                    "removed a hash never stored"
                )
            else:
                assert isinstance(e, AllBlocksCleared)
                for medium in [e.medium] if e.medium else [GPU, CPU]:
                    self.replayed[medium].clear()
        return events

    def check_stored_segment(self, e: BlockStored):
        """A GPU BlockStored is a correct chain segment: parent + tokens + extra keys -> hashes."""
        assert e.block_size == self.B
        assert len(e.token_ids) == len(e.block_hashes) * self.B
        parent = NONE_HASH if e.parent_block_hash is None else self.digest_of[e.parent_block_hash]
        extras = e.extra_keys or (None,) * len(e.block_hashes)
        for i, h in enumerate(e.block_hashes):
            parent = ref_digest(parent, e.token_ids[i * self.B : (i + 1) * self.B], extras[i])
            assert event_int(parent) == h, "BlockStored hashes do not follow from parent + tokens"
            self.digest_of[h] = parent

    def try_allocate(self, req: Req, num_new, computed=None, lookahead=0):
        before = self.snapshot()
        n_hit = computed.num_computed_tokens if computed else 0
        out = self.mgr.allocate_slots(req.kv, num_new, n_hit, computed, lookahead)
        if out is None:
            assert self.snapshot() == before, "allocate_slots returned None but changed state"
            assert self.mgr.take_events() == [], "allocate_slots returned None but emitted events"
            return False
        events = self.replay()
        gpu = [(type(e), i) for i, e in enumerate(events) if e.medium == GPU]
        stored_at = [i for t, i in gpu if t is BlockStored]
        removed_at = [i for t, i in gpu if t is BlockRemoved]
        assert not stored_at or not removed_at or max(removed_at) < min(stored_at), (
            "BlockRemoved after BlockStored"
        )
        assert len(stored_at) <= 1
        return True

    # -- rules ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.waiting) + len(self.running) < 8)
    @rule(
        base=st.integers(0, len(BASES) - 1),
        prefix=st.integers(0, 32),
        tail=st.lists(st.integers(0, 63), max_size=8),
        salt=st.sampled_from([None, None, None, "s1", "s2"]),
        lora=st.sampled_from([None, None, None, None, "L"]),
    )
    def new_request(self, base, prefix, tail, salt, lora):
        tokens = (BASES[base][:prefix] + tail)[:MAX_TOKENS]
        if not tokens:
            tokens = [0]
        self.waiting.append(Req(f"r{self.next_id}", tokens, salt, lora))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def admit(self, data, chunk):
        req = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        computed = self.mgr.get_computed_blocks(req.kv)
        n_hit = computed.num_computed_tokens
        assert n_hit % self.B == 0 and n_hit <= req.kv.num_tokens - 1
        chain = req.ref_chain(self.B)
        for i, blk in enumerate(computed.blocks):  # GPU hits hold this request's data
            assert blk.block_hash == chain[i]
            assert self.gpu_data.get(blk.block_id) == chain[i], "a GPU prefix hit holds other data"
        for j, h in enumerate(computed.cpu_block_hashes):
            assert h == chain[len(computed.blocks) + j]
        assert req.kv.num_computed_tokens == 0
        num_new = min(chunk, req.kv.num_tokens - n_hit)
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 3]))
        if not self.try_allocate(req, num_new, computed, lookahead):
            return
        self.queries += req.kv.num_tokens
        self.hits += n_hit
        self.cpu_hits += computed.num_cpu_hit_tokens
        table = self.mgr.get_block_ids(req.kv.request_id)
        for i in range(n_hit // self.B):  # CPU hits were copied back before compute
            assert self.gpu_data.get(table[i]) == chain[i], "data copied back to the GPU is not that hash's"
        self.waiting.remove(req)
        self.running[req.kv.request_id] = req
        self.compute(req, n_hit, n_hit + num_new)
        req.kv.num_computed_tokens = n_hit + num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 24), token=st.integers(0, 63))
    def step(self, data, chunk, token):
        """One scheduler step of a running request: a prefill chunk, or a decode token."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        kv = req.kv
        if kv.num_computed_tokens == kv.num_tokens:
            if kv.num_tokens >= MAX_TOKENS:
                return
            kv.append_output_token_ids(token)
            num_new = 1
        else:
            num_new = min(chunk, kv.num_tokens - kv.num_computed_tokens)
        lookahead = data.draw(st.sampled_from([0, 0, 0, 2]))
        if self.try_allocate(req, num_new, None, lookahead):
            self.compute(req, kv.num_computed_tokens, kv.num_computed_tokens + num_new)
            kv.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.mgr.free(self.running.pop(rid).kv)
        assert self.replay() == []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.mgr.free(req.kv)
        req.kv.num_computed_tokens = 0
        self.waiting.insert(0, req)
        assert self.replay() == []

    @rule(go=st.sampled_from([False] * 7 + [True]))
    def reset_prefix_cache(self, go):
        if not go:  # 1 in 8: a reset wipes everything the other rules built up
            return
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        events = self.replay()
        assert events == ([AllBlocksCleared(None)] if ok else [])

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def block_accounting(self):
        if self.mgr is None:
            return
        pool = self.mgr.block_pool
        queued = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(queued) == len(set(queued)) == pool.get_num_free_blocks()
        assert 0 not in queued
        tables = {rid: self.mgr.get_block_ids(rid) for rid in self.running}
        assert set(self.mgr.req_to_blocks) == set(self.running)
        holders = Counter(b for t in tables.values() for b in t)
        in_use = 0
        for b in pool.blocks[1:]:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in set(queued))
            in_use += b.ref_cnt > 0
        assert len(queued) + in_use == pool.num_blocks - 1
        assert self.mgr.usage == 1 - len(queued) / (pool.num_blocks - 1)
        for rid, table in tables.items():  # block tables cover exactly what was scheduled
            kv = self.running[rid].kv
            assert len(table) >= -(-kv.num_computed_tokens // self.B)

    @invariant()
    def cached_hashes_hold_their_data(self):
        if self.mgr is None:
            return
        pool = self.mgr.block_pool
        for digest, copies in pool.cached_block_hash_to_block.items():
            assert copies
            for bid, b in copies.items():
                assert b.block_id == bid and b.block_hash == digest and b.event_hash == event_int(digest)
                assert self.gpu_data.get(bid) == digest, f"block {bid} is cached under a hash of other data"
        cached = {b.block_id for b in pool.blocks if b.block_hash is not None}
        assert cached == {bid for copies in pool.cached_block_hash_to_block.values() for bid in copies}
        if pool.cpu_pool is not None:
            entries = pool.cpu_pool._entries  # read-only: digest -> (slot, event int)
            assert len(entries) <= self.cpu_blocks
            assert len({slot for slot, _ in entries.values()}) == len(entries)
            for digest, (slot, ev) in entries.items():
                assert ev == event_int(digest)
                assert self.cpu_data.get(slot) == digest, f"CPU slot {slot} holds other data than its hash"
            assert not pool.cpu_pool._pinned

    @invariant()
    def events_replay_to_the_cached_set(self):
        if self.mgr is None:
            return
        self.replay()
        actual = self.mgr.cached_event_hashes()
        for medium in (GPU, CPU):
            assert +self.replayed[medium] == Counter(actual[medium]), (
                f"{medium} events disagree with the cache"
            )

    @invariant()
    def stats_count_admissions_in_tokens(self):
        if self.mgr is None:
            return
        s = self.mgr.stats
        assert (s.queries, s.hits, s.cpu_hits) == (self.queries, self.hits, self.cpu_hits)
        assert s.cpu_hits <= s.hits <= s.queries


_settings = settings(
    max_examples=300,  # ~6 s per machine on one core
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class GpuOnlyMachine(KVMachine):
    cpu_tier = False


class CpuTierMachine(KVMachine):
    cpu_tier = True


TestKVCacheGpuOnly = GpuOnlyMachine.TestCase
TestKVCacheGpuOnly.settings = _settings
TestKVCacheWithCpuTier = CpuTierMachine.TestCase
TestKVCacheWithCpuTier.settings = _settings
