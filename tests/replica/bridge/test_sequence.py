"""The order of vLLM's batches (replica.bridge.sequence): hand-worked streams, and the captured
replay answer filling a gap in the captured live stream."""

from __future__ import annotations

from replica.bridge.sequence import SeqDecision, SeqOutcome, VllmSequencer
from replica.bridge.vllm_events import decode_message, decode_replay_reply
from tests.replica.bridge.captures import load

IN_ORDER, DUPLICATE, GAP, RESTART, FILLED, OVERRUN = (
    SeqOutcome.IN_ORDER, SeqOutcome.DUPLICATE, SeqOutcome.GAP, SeqOutcome.RESTART, SeqOutcome.FILLED, SeqOutcome.OVERRUN)


def feed(s: VllmSequencer, seqs) -> list[SeqDecision]:
    return [s.live(q, f"b{q}") for q in seqs]


def test_a_stream_from_zero_applies_in_order_and_opens_one_epoch():
    s = VllmSequencer()
    got = feed(s, [0, 1, 2])
    assert got == [SeqDecision(IN_ORDER, True, ("b0",)), SeqDecision(IN_ORDER, False, ("b1",)),
                   SeqDecision(IN_ORDER, False, ("b2",))]
    assert (s.next, s.epochs) == (3, 1)


def test_a_gap_holds_batches_until_the_replay_fills_it():
    s = VllmSequencer()
    feed(s, [0, 1])
    assert s.live(4, "b4") == SeqDecision(GAP, replay_from=2)
    assert s.live(5, "b5") == SeqDecision(GAP)  # one replay at a time
    assert s.replay_pending == 2 and s.num_held == 2
    # the replay answers 2..5 (4 and 5 again: already held)
    assert s.replayed([(2, "r2"), (3, "r3"), (4, "r4"), (5, "r5")]) == SeqDecision(FILLED, False, ("r2", "r3", "b4", "b5"))
    assert (s.next, s.replay_pending, s.num_held, s.epochs) == (6, None, 0, 1)


def test_live_batches_a_replay_already_gave_are_duplicates():
    s = VllmSequencer()
    feed(s, [0, 1])
    s.live(3, "b3")
    s.replayed([(2, "r2"), (3, "r3"), (4, "r4"), (5, "r5")])  # the replay ran ahead of the live stream
    assert feed(s, [4, 5]) == [SeqDecision(DUPLICATE)] * 2
    assert s.live(6, "b6") == SeqDecision(IN_ORDER, False, ("b6",))


def test_seq_back_to_zero_is_a_restart_and_a_new_epoch_applying_it():
    s = VllmSequencer()
    feed(s, [0, 1, 2])
    assert s.live(0, "n0") == SeqDecision(RESTART, True, ("n0",))
    assert s.live(1, "n1") == SeqDecision(IN_ORDER, False, ("n1",))
    assert s.epochs == 2


def test_a_restart_first_seen_past_zero_holds_it_and_replays_from_zero():
    s = VllmSequencer()
    feed(s, [0, 1, 2, 3, 4])
    assert s.live(2, "n2") == SeqDecision(RESTART, True, replay_from=0)
    assert s.replayed([(0, "n0"), (1, "n1"), (2, "n2")]) == SeqDecision(FILLED, False, ("n0", "n1", "n2"))
    assert (s.next, s.epochs) == (3, 2)


def test_a_replay_that_does_not_reach_back_is_an_overrun_and_a_new_epoch_from_what_it_has():
    s = VllmSequencer()
    feed(s, [0, 1])
    s.live(9, "b9")
    assert s.replayed([(5, "r5"), (6, "r6"), (7, "r7"), (8, "r8"), (9, "r9")]) == SeqDecision(
        OVERRUN, True, ("r5", "r6", "r7", "r8", "b9"))
    assert (s.next, s.epochs) == (10, 2)
    assert s.live(10, "b10") == SeqDecision(IN_ORDER, False, ("b10",))


def test_a_bridge_started_mid_stream_replays_from_zero():
    whole = VllmSequencer()
    assert whole.live(3, "b3") == SeqDecision(GAP, replay_from=0)
    assert whole.replayed([(0, "r0"), (1, "r1"), (2, "r2"), (3, "r3")]) == SeqDecision(
        FILLED, True, ("r0", "r1", "r2", "b3"))
    late = VllmSequencer()  # vLLM ran longer than its buffer
    late.live(3, "b3")
    assert late.replayed([(2, "r2"), (3, "r3")]) == SeqDecision(OVERRUN, True, ("r2", "b3"))
    assert late.epochs == 1


def test_begin_replay_reads_the_history_before_the_first_live_batch():
    s = VllmSequencer()
    assert s.begin_replay() == 0 and s.begin_replay() is None
    assert s.replayed([(0, "r0"), (1, "r1")]) == SeqDecision(FILLED, True, ("r0", "r1"))
    assert s.live(1, "b1") == SeqDecision(DUPLICATE)
    assert s.begin_replay() == 2 and s.replayed([]) == SeqDecision(FILLED)


def test_a_failed_replay_is_an_overrun_from_the_first_held_batch():
    s = VllmSequencer()
    feed(s, [0])
    s.live(3, "b3")
    s.live(4, "b4")
    assert s.replay_failed() == SeqDecision(OVERRUN, True, ("b3", "b4"))
    assert s.next == 5


def test_held_batches_past_the_bound_are_dropped_and_replayed_again():
    s = VllmSequencer(max_held=2)
    feed(s, [0])
    feed(s, [2, 3, 4])  # 4 is dropped
    assert s.held_dropped == 1
    assert s.replayed([(1, "r1"), (2, "r2"), (3, "r3")]) == SeqDecision(FILLED, False, ("r1", "b2", "b3"))
    assert s.live(5, "b5") == SeqDecision(GAP, replay_from=4)
    assert s.replayed([(4, "r4"), (5, "r5")]) == SeqDecision(FILLED, False, ("r4", "b5"))


def test_restarted_opens_an_epoch_and_waits_for_seq_zero():
    s = VllmSequencer()
    feed(s, [0, 1, 2, 3])
    assert s.restarted() == SeqDecision(RESTART, True)
    assert s.live(0, "n0") == SeqDecision(IN_ORDER, False, ("n0",))
    assert s.epochs == 2


def test_the_captured_replay_fills_a_gap_in_the_captured_live_stream():
    """Live seq 0, then seq 1 .. 2 lost: the captured replay from seq 1 fills them; the live batches
    it repeats are duplicates."""
    cap = load("int")
    live = [decode_message(f) for f in cap.live]
    replay = [b for b in (decode_replay_reply(r) for r in cap.replays[0]["replies"]) if b is not None]
    s: VllmSequencer = VllmSequencer()
    applied = list(s.live(0, live[0]).apply)
    assert s.live(3, live[3]) == SeqDecision(GAP, replay_from=1)
    assert cap.replays[0]["start_seq"] == 1
    decision = s.replayed([(b.seq, b) for b in replay])
    assert decision.outcome == FILLED and not decision.new_epoch
    applied += decision.apply
    for b in live[4:]:
        assert s.live(b.seq, b).outcome == DUPLICATE
    assert applied == live
