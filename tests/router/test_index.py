"""BlockIndex (router/index.py) on each storage that is built: router/_index.c's tables and the
Python dicts. Its lookup against a plain per-replica walk of DESIGN.md §5's rule (a replica matches
the leading blocks it holds on the GPU or speculatively, the speculative ones counted from its first
block not really on the GPU, then the run after them on its CPU tier), its copy counts against a
Counter, and the two storages against each other, past 64 and 128 replicas (run sets wider than
one and two machine words)."""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.index
from kvroute.events import CPU, GPU, MEDIA
from router.index import BlockIndex, Match

# The storages: compiled (router/_index.c) when built, and the Python fallback.
STORAGES = ["python", "c"] if router.index._index is not None else ["python"]
needs_c = pytest.mark.skipif("c" not in STORAGES, reason="router._index not built")


def storage(name: str):
    """Build indexes on one storage for the duration of a ``with`` block."""
    return mock.patch.object(router.index, "_index", None) if name == "python" else contextlib.nullcontext()


def new_index(name: str, **kw) -> BlockIndex:
    with storage(name):
        return BlockIndex(**kw)


def reference_match(chain: list[int], gpu: set[int], spec: set[int], cpu: set[int]) -> Match:
    held = 0
    while held < len(chain) and (chain[held] in gpu or chain[held] in spec):
        held += 1
    real = 0
    while real < len(chain) and chain[real] in gpu:
        real += 1
    end = held
    while end < len(chain) and chain[end] in cpu:
        end += 1
    return Match(gpu=held, cpu=end - held, speculative=held - min(real, held))


@st.composite
def index_states(draw):
    pool = draw(st.integers(1, 12))  # few distinct hashes: shared prefixes, duplicates, gaps
    hashes = st.integers(0, pool - 1).map(lambda i: 10_000 + i * 7_919)
    num_replicas = draw(st.sampled_from([1, 2, 3, 8, 70, 140]))  # past 64 and 128: wider run sets
    replicas = {}
    for r in range(num_replicas):
        replicas[f"r{r}"] = tuple(set(draw(st.lists(hashes, max_size=10))) for _ in range(3))  # gpu, spec, cpu
    chain = draw(st.lists(hashes, max_size=30))
    candidates = draw(st.none() | st.lists(st.sampled_from([*replicas, "unknown"]), unique=True))
    return replicas, chain, candidates


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index_states(), st.sampled_from(STORAGES))
def test_lookup_equals_a_plain_walk_per_replica(state, storage_name):
    replicas, chain, candidates = state
    index = new_index(storage_name, speculative_ttl=60.0, clock=lambda: 0.0)
    for name, (gpu, spec, cpu) in replicas.items():
        index.add(name, sorted(gpu), GPU)
        index.add(name, sorted(gpu), GPU)  # two copies: the lookup sees a hash, not a count
        index.add(name, sorted(cpu), CPU)
        index.add_speculative(name, sorted(spec))
    got = index.lookup(chain, candidates)
    names = list(replicas) if candidates is None else candidates
    assert set(got) == set(names)
    for name in names:
        expected = reference_match(chain, *replicas[name]) if name in replicas else Match()
        assert got[name] == expected, name
    assert index.matches(chain, set(names)) == {r: m for r, m in got.items() if m != Match()}


def test_a_withdrawn_speculative_credit_is_gone_and_a_later_credit_of_the_same_block_stays():
    now = [0.0]
    index = BlockIndex(speculative_ttl=10.0, clock=lambda: now[0])
    index.add("a", [1], GPU)
    refused = index.add_speculative("a", [1, 2, 3])
    now[0] = 1.0
    index.add_speculative("a", [3, 4])  # a later request credits block 3 again
    index.remove_speculative(refused)
    assert index.lookup([1, 2, 3])["a"] == Match(gpu=1)  # the real entry of block 1 stays
    assert index.lookup([3, 4])["a"] == Match(gpu=2, speculative=2)
    now[0] = 20.0
    assert index.lookup([3, 4])["a"] == Match() and index.replicas == ["a"]


@pytest.mark.parametrize("storage_name", STORAGES)
def test_worked_example_gpu_then_speculative_then_cpu(storage_name):
    index = new_index(storage_name, speculative_ttl=60.0, clock=lambda: 0.0)
    chain = [1, 2, 3, 4, 5, 6]
    index.add("a", [1, 2], GPU)
    index.add_speculative("a", [3, 4])
    index.add("a", [5], CPU)
    index.add("b", [1, 2, 3, 4, 5, 6], CPU)
    index.add("c", [2, 3], GPU)  # no block 0: nothing matches
    got = index.lookup(chain)
    assert got["a"] == Match(gpu=4, cpu=1, speculative=2)
    assert got["b"] == Match(gpu=0, cpu=6, speculative=0)
    assert got["c"] == Match()


@needs_c
def test_the_compiled_tables_take_u64_hashes_and_treat_anything_else_as_not_indexed():
    from router import _index

    t = _index.Table()
    t.add(0, [0, 2**64 - 1])
    with pytest.raises(OverflowError):
        t.add(0, [-1])
    with pytest.raises(OverflowError):
        t.add(0, [2**64])
    with pytest.raises(TypeError):
        t.add(0, ["a"])
    with pytest.raises(OverflowError):
        t.add(1 << 20, [1])  # replica ids have 20 bits
    assert t.remove(0, [-1, 2**64, 7, 0]) == 3 and t.items(0) == {2**64 - 1: 1}
    assert _index.walk([2**64 - 1, -1], t, None, None, 1) == {0: (1, 0, 0)}
    assert _index.walk([2**64 - 1, -1, 5], t, {-1: 1}, None, 1) == {0: (2, 0, 1)}  # a speculative odd key
    with pytest.raises(TypeError):
        _index.walk((1,), t, None, None, 1)  # a tuple of hashes
    with pytest.raises(TypeError, match="spec"):
        _index.walk([1], t, [], None, 1)
    assert _index.walk([1, 2], t, None, None, 0) == {}


@pytest.mark.parametrize("storage_name", STORAGES)
def test_speculative_masks_wider_than_a_machine_word_match(storage_name):
    index = new_index(storage_name, speculative_ttl=60.0, clock=lambda: 0.0)
    for r in range(200):
        index.add(f"r{r}", [r])  # ids 0..199
    index.add("r199", [1000, 1001])
    index.add_speculative("r150", [1000, 1001, 1002])
    index.add_speculative("r3", [1000])
    index.add("r150", [1003], CPU)
    assert index.matches([1000, 1001, 1002, 1003]) == {
        "r199": Match(gpu=2), "r150": Match(gpu=3, cpu=1, speculative=3), "r3": Match(gpu=1, speculative=1)}


@st.composite
def event_sequences(draw):
    # Few replicas so that copies pile up on one; 66 so that masks pass 64 bits.
    replicas = [f"r{i}" for i in range(draw(st.sampled_from([1, 2, 3, 66, 130])))]
    hashes = st.integers(0, 15).map(lambda i: 2**63 + i * 104_729)  # 64-bit values, few distinct
    ops = st.tuples(
        st.sampled_from(["add", "add", "remove", "clear", "forget"]),
        st.sampled_from(replicas),
        st.sampled_from([GPU, CPU]),
        st.lists(hashes, max_size=8),
    )
    return draw(st.lists(ops, max_size=60))


def apply_events(index: BlockIndex, events) -> list[int]:
    """Apply ``events`` (event_sequences) to ``index``; the missing counts of the removes."""
    missing = []
    for op, replica, medium, hs in events:
        if op == "add":
            index.add(replica, hs, medium)
        elif op == "remove":
            missing.append(index.remove(replica, hs, medium))
        elif op == "clear":
            index.clear_replica(replica, medium)
        else:
            index.remove_replica(replica)
    return missing


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event_sequences(), st.sampled_from(STORAGES))
def test_add_remove_clear_keep_counts_and_holders_equal_to_a_reference(events, storage_name):
    """Copies per (replica, medium, hash) as a plain Counter; each hash's holders in a medium's
    table must be exactly the replicas with at least one copy, and remove must report the hashes
    it did not know."""
    index = new_index(storage_name)
    ref: dict[tuple[str, str], Counter] = {}
    for op, replica, medium, hs in events:
        copies = ref.setdefault((replica, medium), Counter())
        if op == "add":
            index.add(replica, hs, medium)
            copies.update(hs)
        elif op == "remove":
            expected_missing = 0
            for h in hs:
                if copies[h] > 0:
                    copies[h] -= 1
                else:
                    expected_missing += 1
            assert index.remove(replica, hs, medium) == expected_missing
        elif op == "clear":
            index.clear_replica(replica, medium)
            copies.clear()
        else:
            index.remove_replica(replica)
            for m in MEDIA:
                ref.get((replica, m), Counter()).clear()
    names = {rid: r for r, rid in index._ids.items()}
    for medium in MEDIA:
        holders: dict[int, set[str]] = {}
        for (replica, m), copies in ref.items():
            if m == medium:
                expected = {h: c for h, c in copies.items() if c > 0}
                assert index.cached_set(replica, medium) == expected
                assert index.num_entries(replica, medium) == len(expected)
                for h in expected:
                    holders.setdefault(h, set()).add(replica)
                    assert index.has(replica, h, medium)
        table = index._media[medium]
        assert len(table) == len(holders) and table.entries == sum(map(len, holders.values()))
        assert {h: {names[rid] for rid in table.holders(h)} for h in holders} == holders


@needs_c
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event_sequences(), st.lists(st.integers(0, 15).map(lambda i: 2**63 + i * 104_729), max_size=20))
def test_the_compiled_and_python_storages_answer_alike(events, chain):
    indexes = [new_index(name, speculative_ttl=60.0, clock=lambda: 0.0) for name in ("python", "c")]
    missing = [apply_events(index, events) for index in indexes]
    assert missing[0] == missing[1]
    for index in indexes:
        index.add_speculative("r1", chain[:3])
    py, c = indexes
    assert py.replicas == c.replicas and py.lookup(chain) == c.lookup(chain) and py.matches(chain) == c.matches(chain)
    for r in py.replicas:
        assert py.num_entries(r) == c.num_entries(r)
        assert all(py.cached_set(r, m) == c.cached_set(r, m) for m in MEDIA)


@needs_c
def test_the_compiled_tables_grow_shrink_and_count_their_bytes():
    """Thousands of hashes over 300 replicas (wide sets, shared prefixes, duplicates), half of them
    removed, against a Counter; the bytes grow with the entries and come back once all are gone."""
    import random

    rng = random.Random(1)
    index = new_index("c")
    ref: dict[str, Counter] = {}
    shared = [rng.getrandbits(64) for _ in range(64)]
    for r in range(300):
        hs = shared[: rng.randrange(65)] + [rng.getrandbits(64) for _ in range(200)]
        hs += hs[:5]  # duplicates
        index.add(f"r{r}", hs)
        ref[f"r{r}"] = Counter(hs)
    full = index.table_bytes()
    assert 300 * 200 * 16 < full < 300 * 264 * 64
    for r in range(0, 300, 2):
        name = f"r{r}"
        gone = list(ref[name])[::2]
        assert index.remove(name, gone + [12345]) == 1
        ref[name].subtract(gone)
    for r in range(1, 300, 2):
        index.clear_replica(f"r{r}") if r % 4 == 1 else index.remove_replica(f"r{r}")
        ref[f"r{r}"] = Counter()
    for name, copies in ref.items():
        assert index.cached_set(name) == {h: c for h, c in copies.items() if c > 0}
    for name in list(ref):
        index.remove_replica(name)
    assert index.table_bytes() < full // 50 and index.replicas == []


@needs_c
def test_churn_on_one_replica_keeps_its_vector_bounded():
    """Removals leave stale hashes in the replica's vector (router/_index.c); the vector is rebuilt
    before they outnumber the live ones, so store / evict churn does not grow memory."""
    index = new_index("c")
    index.add("a", range(1000))
    steady = index.table_bytes()
    for k in range(1, 200):
        index.remove("a", range((k - 1) * 1000, k * 1000))
        index.add("a", range(k * 1000, (k + 1) * 1000))
    assert index.num_entries("a") == 1000 and index.table_bytes() <= 3 * steady


def test_held_speculative_entries_outlive_the_ttl_until_released():
    now = [0.0]
    index = BlockIndex(speculative_ttl=2.0, clock=lambda: now[0])
    queued = index.add_speculative("a", [1, 2, 3], hold=True)  # a request queued behind a long backlog
    ordinary = index.add_speculative("b", [1, 2])  # an ordinary credit
    now[0] = 100.0
    got = index.lookup([1, 2, 3])
    assert got["a"] == Match(gpu=3, speculative=3)
    assert got.get("b", Match()) == Match()
    index.release_speculative(queued)  # its prefill is done: 2 s more
    now[0] = 101.9
    assert index.lookup([1, 2, 3])["a"] == Match(gpu=3, speculative=3)
    now[0] = 102.0
    assert index.lookup([1, 2, 3]).get("a", Match()) == Match()
    index.release_speculative(queued)  # released twice, or never held: nothing comes back
    index.release_speculative(ordinary)
    index.release_speculative(None)
    assert index.lookup([1, 2, 3]).get("a", Match()) == Match()


@pytest.mark.parametrize("storage_name", STORAGES)
def test_one_block_on_hundreds_of_replicas_added_and_removed_in_any_order(storage_name):
    """A shared prefix's replica set through every form router/_index.c keeps (inline ids, a
    sorted array, a bitset, grown past its words, sparse again): its holders and the walk's answer
    after each step equal a plain set's."""
    import random

    rng = random.Random(5)
    index = new_index(storage_name)
    names = [f"r{i}" for i in range(300)]
    for name in names:
        index.add(name, [7])  # ids 0..299 in this order
        index.remove(name, [7])
    chain = [1, 2]
    index.add("r299", [1])  # a run of one block for the last id
    holders: set[str] = set()
    order = rng.sample(names, len(names))
    for step, name in enumerate(order + rng.sample(names, len(names))):
        if step < len(names):
            index.add(name, chain)
            holders.add(name)
        else:
            assert index.remove(name, chain) == 0
            holders.discard(name)
        if step % 7 == 0 or len(holders) < 6:
            table = index._media[GPU]
            assert {index._names[r] for r in table.holders(2)} == holders
            got = index.matches(chain)
            assert {r for r, m in got.items() if m.gpu == 2} == holders
            assert got.get("r299", Match()).gpu == (2 if "r299" in holders else 1)
    assert index.lookup(chain)["r0"] == Match() and index.num_entries("r299") == 1

