"""The metrics people monitor, on hand-made counts (vLLM's definitions)."""

from minispec.metrics import RequestMetrics, RunMetrics


def test_rates_follow_their_definitions():
    """acceptance = accepted / drafted; tokens per step = 1 + accepted / steps; per position i =
    steps that accepted draft i / steps that drafted it, 0.0 where nothing was ever accepted."""
    r = RequestMetrics()
    for drafted, accepted in [(4, 2), (4, 0), (3, 3), (4, 1)]:
        r.record(drafted, accepted)
    assert r.drafted_per_position == [4, 4, 4, 3] and r.accepted_per_position == [3, 2, 1]
    assert r.acceptance_rate == 6 / 15
    assert r.mean_accepted_per_step == 1 + 6 / 4
    run = RunMetrics()
    run.add(r, num_generated=10)
    run.add(RequestMetrics(), num_generated=0)  # a request that never stepped
    assert run.per_position_acceptance == [3 / 4, 2 / 4, 1 / 4, 0.0]
    assert run.num_requests == 2 and run.num_generated == 10 and run.num_steps == 4


def test_plain_decoding_has_no_drafts():
    r = RequestMetrics()
    r.record(0, 0)
    r.record(0, 0)
    assert r.acceptance_rate == 0.0 and r.mean_accepted_per_step == 1.0
