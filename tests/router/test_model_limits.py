"""ReportedLimits: what the router validates a request against before routing (router/model_limits.py):
per limit, the largest a routable replica can take, a replica that does not say counting as the
model folder's."""

from router.model_limits import UNBOUNDED, ReportedLimits

FOLDER = (529, 8192)  # the model folder's (vocab_size, max_position_embeddings)


def test_no_routable_replica_leaves_the_model_folders_limits():
    assert ReportedLimits() == ReportedLimits.of([])
    assert ReportedLimits.of([]).resolve(FOLDER) == (529, 8192)
    assert ReportedLimits.of([]).resolve((100, UNBOUNDED)) == (100, UNBOUNDED)


def test_replicas_that_all_say_give_their_largest_even_below_the_folders():
    reported = ReportedLimits.of([(529, 256), (500, 1024)])
    assert reported == ReportedLimits(529, 1024, vocab_size_unsaid=False, max_model_len_unsaid=False)
    assert reported.resolve(FOLDER) == (529, 1024)  # 8192 is nobody's: a 2000-token prompt is refused
    assert ReportedLimits.of([(600, 16384)]).resolve(FOLDER) == (600, 16384)  # above the folder's too


def test_a_replica_that_does_not_say_counts_as_the_model_folders():
    # An older replica (0, 0) next to one holding 256 tokens: the older one may hold the folder's 8192.
    reported = ReportedLimits.of([(500, 256), (0, 0)])
    assert reported == ReportedLimits(500, 256, vocab_size_unsaid=True, max_model_len_unsaid=True)
    assert reported.resolve(FOLDER) == (529, 8192)
    # ... but a replica that says more than the folder still wins.
    assert ReportedLimits.of([(0, 0), (700, 16384)]).resolve(FOLDER) == (700, 16384)


def test_each_limit_is_resolved_on_its_own():
    # Every replica gives a vocab_size, one gives no max_model_len (a negative one is no answer either).
    reported = ReportedLimits.of([(500, 256), (500, 0), (400, -3)])
    assert reported == ReportedLimits(500, 256, vocab_size_unsaid=False, max_model_len_unsaid=True)
    assert reported.resolve(FOLDER) == (500, 8192)
    assert reported.resolve((529, UNBOUNDED)) == (500, UNBOUNDED)
