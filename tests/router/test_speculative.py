"""Speculative holds per request (router/speculative.py through BlockIndex): requests that share a
prefix on one replica hold its entries each for itself; a withdrawal or release of one leaves the
others' holds be, and the TTL counts from the last release. Other routers' entries (the load
sync's) join the lookups, and each router's publication replaces its previous one."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.events import GPU
from router.index import BlockIndex, Match

TTL = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_index() -> tuple[BlockIndex, Clock]:
    clock = Clock()
    return BlockIndex(speculative_ttl=TTL, clock=clock), clock


def matched(index: BlockIndex, chain: list[int], replica: str = "a") -> Match:
    return index.lookup(chain, [replica])[replica]


def test_one_of_two_holders_withdraws_and_the_other_still_matches_the_shared_prefix():
    index, clock = new_index()
    first = index.add_speculative("a", [1, 2, 3], hold=True)
    second = index.add_speculative("a", [1, 2, 4], hold=True)  # the burst shares blocks 1, 2
    clock.now = 100.0  # far past the TTL: only holds keep entries now
    index.remove_speculative(first)  # the replica refused the first request
    assert matched(index, [1, 2, 3]) == Match(gpu=2, speculative=2)  # its own block 3 is gone
    assert matched(index, [1, 2, 4]) == Match(gpu=3, speculative=3)
    index.release_speculative(first)  # Router.finish after withdraw: nothing comes back, nothing goes
    index.remove_speculative(first)
    assert matched(index, [1, 2, 4]) == Match(gpu=3, speculative=3)
    index.remove_speculative(second)
    assert matched(index, [1, 2, 4]) == Match()


def test_both_holders_release_and_the_ttl_counts_from_the_second_release():
    index, clock = new_index()
    first = index.add_speculative("a", [1, 2], hold=True)
    second = index.add_speculative("a", [1, 2], hold=True)
    clock.now = 5.0
    index.release_speculative(first)  # alone it would end at 15
    clock.now = 50.0
    assert matched(index, [1, 2]) == Match(gpu=2, speculative=2)  # the second still holds
    index.release_speculative(second)  # ends at 60
    index.release_speculative(second)  # twice: no later end
    clock.now = 59.9
    assert matched(index, [1, 2]) == Match(gpu=2, speculative=2)
    clock.now = 60.0
    assert matched(index, [1, 2]) == Match()


def test_one_releases_the_other_withdraws_and_the_entry_ends_at_the_first_ttl():
    index, clock = new_index()
    first = index.add_speculative("a", [1, 2], hold=True)
    second = index.add_speculative("a", [1, 2], hold=True)
    clock.now = 3.0
    index.release_speculative(first)  # ends at 13 once no hold is left
    clock.now = 8.0
    index.remove_speculative(second)
    assert matched(index, [1, 2]) == Match(gpu=2, speculative=2)  # 8 < 13
    clock.now = 12.9
    assert matched(index, [1, 2]) == Match(gpu=2, speculative=2)
    clock.now = 13.0
    assert matched(index, [1, 2]) == Match()


def test_a_withdrawal_after_the_other_holders_ttl_ran_out_drops_the_entry_at_once():
    index, clock = new_index()
    first = index.add_speculative("a", [7], hold=True)
    second = index.add_speculative("a", [7], hold=True)
    index.release_speculative(first)  # ends at 10, while the second holds it
    clock.now = 30.0
    index.remove_speculative(second)
    assert matched(index, [7]) == Match()


def test_a_ttl_credit_does_not_shorten_a_hold_and_a_withdrawal_never_drops_a_real_entry():
    index, clock = new_index()
    held = index.add_speculative("a", [1, 2], hold=True)
    index.add_speculative("a", [1, 2])  # an ordinary credit of the same blocks, ends at 10
    index.add("a", [1], GPU)  # block 1 is really stored there
    clock.now = 20.0
    assert matched(index, [1, 2]) == Match(gpu=2, speculative=1)
    index.remove_speculative(held)
    assert matched(index, [1, 2]) == Match(gpu=1)
    assert index.has("a", 1)


def test_a_credit_of_a_forgotten_replica_is_void_for_the_replica_that_reuses_its_bit():
    index, clock = new_index()
    stale = index.add_speculative("a", [1], hold=True)
    index.remove_replica("a")  # heartbeat expired with the request in flight
    fresh = index.add_speculative("b", [1], hold=True)  # "b" gets "a"'s freed bit
    clock.now = 100.0
    index.remove_speculative(stale)
    index.release_speculative(stale)
    assert matched(index, [1], "b") == Match(gpu=1, speculative=1)
    index.release_speculative(fresh)
    clock.now = 110.0
    assert matched(index, [1], "b") == Match()


def test_another_routers_entries_count_until_its_next_publication_leaves_them_out():
    index, clock = new_index()
    index.set_remote_speculative("router-b", {"a": [1, 2, 3]})
    assert matched(index, [1, 2, 3, 4]) == Match(gpu=3, speculative=3)
    assert index.own_speculative() == {}  # not this router's to publish
    index.set_remote_speculative("router-b", {"a": [1, 2]})  # its request 3 was prefilled since
    assert matched(index, [1, 2, 3]) == Match(gpu=2, speculative=2)
    clock.now = 1000.0  # no TTL: they live as long as the router publishes them
    assert matched(index, [1, 2, 3]) == Match(gpu=2, speculative=2)
    index.set_remote_speculative("router-b", None)  # its load key expired
    assert matched(index, [1, 2]) == Match()


def test_own_and_remote_entries_of_one_block_end_each_on_their_own():
    index, clock = new_index()
    held = index.add_speculative("a", [1, 2], hold=True)
    index.set_remote_speculative("router-b", {"a": [2, 3]})
    index.add("a", [1], GPU)
    assert index.own_speculative() == {"a": [2]}  # block 1 is real now: the events tell the others
    index.remove_speculative(held)
    assert matched(index, [1, 2, 3]) == Match(gpu=3, speculative=2)  # 2 and 3: router-b's
    index.set_remote_speculative("router-b", {})
    assert matched(index, [1, 2, 3]) == Match(gpu=1)


# -- the property: per request, against a plain model of credits -----------------------------------
REPLICAS = ["a", "b", "c"]
HASHES = [11, 22, 33, 44]


@st.composite
def histories(draw):
    """Operations on a few replicas and blocks, as the Router makes them: held credits (commit)
    and TTL credits, released or withdrawn while held, real BlockStored, clock steps, replica
    removals; ``k`` picks an earlier credit."""
    op = st.one_of(
        st.tuples(st.just("hold"), st.sampled_from(REPLICAS), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4)),
        st.tuples(st.just("ttl"), st.sampled_from(REPLICAS), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4)),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("withdraw"), st.integers(0, 30)),
        st.tuples(st.just("stored"), st.sampled_from(REPLICAS), st.sampled_from(HASHES)),
        st.tuples(st.just("tick"), st.sampled_from([0.0, 1.0, 4.0, TTL, 15.0])),
        st.tuples(st.just("forget"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("remote"), st.sampled_from(["x", "y"]),
                  st.dictionaries(st.sampled_from(REPLICAS), st.lists(st.sampled_from(HASHES), max_size=4), max_size=3)),
        st.tuples(st.just("remote_gone"), st.sampled_from(["x", "y"])),
    )
    return draw(st.lists(op, max_size=40))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_speculative_entries_equal_a_model_of_per_request_credits(history):
    """Model: each credit is (replica, hashes, state); an entry (hash, replica) is alive while a
    credit covering it is held, or until the latest TTL end of a released or TTL credit covering
    it, or while another router's latest publication names it. A withdrawn credit counts for
    nothing; forgetting a replica kills its credits, real entries and the other routers' entries
    of it. Lookups must see exactly the live entries, real ones as real, and ``own_speculative``
    this router's live entries that are not real."""
    index, clock = new_index()
    credits = []  # [credit, replica, hashes, "held" | end time | "dead"]
    real: set[tuple[str, int]] = set()
    remote: dict[str, set[tuple[str, int]]] = {}  # router -> (replica, hash) it publishes
    for op in history:
        kind = op[0]
        if kind in ("hold", "ttl"):
            _, replica, hashes = op
            credit = index.add_speculative(replica, hashes, hold=kind == "hold")
            credits.append([credit, replica, set(hashes), "held" if kind == "hold" else clock.now + TTL])
        elif kind in ("release", "withdraw") and credits:
            entry = credits[op[1] % len(credits)]
            if kind == "release":
                index.release_speculative(entry[0])
                if entry[3] == "held":
                    entry[3] = clock.now + TTL
            elif entry[3] == "held":  # the Router withdraws only before the first token
                index.remove_speculative(entry[0])
                entry[3] = "dead"
        elif kind == "stored":
            index.add(op[1], [op[2]], GPU)
            real.add((op[1], op[2]))
        elif kind == "tick":
            clock.now += op[1]
        elif kind == "forget":
            index.remove_replica(op[1])
            real = {(r, h) for r, h in real if r != op[1]}
            for entry in credits:
                if entry[1] == op[1]:
                    entry[3] = "dead"
            remote = {r: {(rep, h) for rep, h in e if rep != op[1]} for r, e in remote.items()}
        elif kind == "remote":
            index.set_remote_speculative(op[1], {r: list(hs) for r, hs in op[2].items()})
            remote[op[1]] = {(r, h) for r, hs in op[2].items() for h in hs}
        elif kind == "remote_gone":
            index.set_remote_speculative(op[1], None)
            remote.pop(op[1], None)
        own: dict[str, set[int]] = {}
        for replica in REPLICAS:
            for h in HASHES:
                covering = [e[3] for e in credits if e[1] == replica and h in e[2] and e[3] != "dead"]
                mine = any(s == "held" or s > clock.now for s in covering)
                alive = mine or any((replica, h) in e for e in remote.values())
                got = index.lookup([h], [replica])[replica]
                is_real = (replica, h) in real
                assert got == Match(gpu=int(alive or is_real), speculative=int(alive and not is_real)), (replica, h)
                if mine and not is_real:
                    own.setdefault(replica, set()).add(h)
        assert {r: set(hs) for r, hs in index.own_speculative().items()} == own
