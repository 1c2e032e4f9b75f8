"""BlockIndex.lookup (router/index.py) against a plain per-replica walk of DESIGN.md §5's rule:
a replica matches the leading blocks it holds on the GPU or speculatively, the speculative ones
counted from its first block not really on the GPU, then the run after them on its CPU tier."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.index
from kvroute.events import CPU, GPU
from router.index import BlockIndex, Match, leading_runs

# The run-length walk: compiled (router/_index.c) when built, and the Python fallback.
WALKS = ["python", "c"] if router.index._index is not None else ["python"]


def walk(name: str):
    """Force the lookup onto one walk for the duration of a ``with`` block."""
    return mock.patch.object(router.index, "_index", None) if name == "python" else contextlib.nullcontext()


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
    num_replicas = draw(st.integers(1, 70))  # past 64: masks wider than one machine word
    replicas = {}
    for r in range(num_replicas):
        replicas[f"r{r}"] = tuple(set(draw(st.lists(hashes, max_size=10))) for _ in range(3))  # gpu, spec, cpu
    chain = draw(st.lists(hashes, max_size=30))
    candidates = draw(st.none() | st.lists(st.sampled_from([*replicas, "unknown"]), unique=True))
    return replicas, chain, candidates


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(index_states(), st.sampled_from(WALKS))
def test_lookup_equals_a_plain_walk_per_replica(state, walk_name):
    replicas, chain, candidates = state
    index = BlockIndex(speculative_ttl=60.0, clock=lambda: 0.0)
    for name, (gpu, spec, cpu) in replicas.items():
        index.add(name, sorted(gpu), GPU)
        index.add(name, sorted(gpu), GPU)  # two copies: the lookup sees a hash, not a count
        index.add(name, sorted(cpu), CPU)
        index.add_speculative(name, sorted(spec))
    with walk(walk_name):
        got = index.lookup(chain, candidates)
    names = list(replicas) if candidates is None else candidates
    assert set(got) == set(names)
    for name in names:
        expected = reference_match(chain, *replicas[name]) if name in replicas else Match()
        assert got[name] == expected, name


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


@pytest.mark.parametrize("walk_name", WALKS)
def test_worked_example_gpu_then_speculative_then_cpu(walk_name):
    index = BlockIndex(speculative_ttl=60.0, clock=lambda: 0.0)
    chain = [1, 2, 3, 4, 5, 6]
    index.add("a", [1, 2], GPU)
    index.add_speculative("a", [3, 4])
    index.add("a", [5], CPU)
    index.add("b", [1, 2, 3, 4, 5, 6], CPU)
    index.add("c", [2, 3], GPU)  # no block 0: nothing matches
    with walk(walk_name):
        got = index.lookup(chain)
    assert got["a"] == Match(gpu=4, cpu=1, speculative=2)
    assert got["b"] == Match(gpu=0, cpu=6, speculative=0)
    assert got["c"] == Match()


@pytest.mark.skipif("c" not in WALKS, reason="router._index not built")
def test_compiled_walk_refuses_wide_masks_and_bad_arguments_so_the_caller_falls_back():
    from router import _index

    with pytest.raises(OverflowError):
        _index.run_ends([1], ({1: 1 << 64},), 0, 1)
    with pytest.raises(TypeError):
        _index.run_ends((1,), ({},), 0, 1)  # a tuple of hashes
    with pytest.raises(TypeError, match="dicts"):
        _index.run_ends([1], ([],), 0, 1)
    # Past 64 bits the index still answers, through the Python walk.
    wide = {1: 1 | 1 << 70, 2: 1 << 70}
    assert leading_runs([1, 2, 3], (wide,), 0, 1 | 1 << 70) == {1: 1, 1 << 70: 2}
    assert _index.run_ends([1, 2, 3], ({1: 3, 2: 2},), 0, 3) == {1: 1, 2: 2}
    assert _index.run_ends([1, 2], ({1: 1},), 5, 1) == {1: 5}  # start past the chain


@st.composite
def event_sequences(draw):
    # Few replicas so that copies pile up on one; 66 so that masks pass 64 bits.
    replicas = [f"r{i}" for i in range(draw(st.sampled_from([1, 2, 3, 66])))]
    hashes = st.integers(0, 15).map(lambda i: 2**63 + i * 104_729)  # 64-bit values, few distinct
    ops = st.tuples(
        st.sampled_from(["add", "remove", "clear"]),
        st.sampled_from(replicas),
        st.sampled_from([GPU, CPU]),
        st.lists(hashes, max_size=8),
    )
    return draw(st.lists(ops, max_size=60))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(event_sequences(), st.sampled_from(WALKS))
def test_add_remove_clear_keep_counts_and_masks_equal_to_a_reference(events, walk_name):
    """Copies per (replica, medium, hash) as a plain Counter; the masks must name exactly the
    replicas with at least one copy, and remove must report the hashes it did not know."""
    from collections import Counter

    index = BlockIndex()
    ref: dict[tuple[str, str], Counter] = {}
    with walk(walk_name):
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
            else:
                index.clear_replica(replica, medium)
                copies.clear()
    for medium in (GPU, CPU):
        holders: dict[int, set[str]] = {}
        for (replica, m), copies in ref.items():
            if m == medium:
                for h, c in copies.items():
                    if c > 0:
                        holders.setdefault(h, set()).add(replica)
                        assert index.has(replica, h, medium)
        got = {h: {r for r in index.replicas if index.has(r, h, medium)} for h in index._masks[medium]}
        assert {h: {r for r in index.replicas if mask & index._bits[r]} for h, mask in index._masks[medium].items()} == got
        assert got == holders


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
