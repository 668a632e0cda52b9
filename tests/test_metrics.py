"""The metrics people monitor, on hand-made counts (vLLM's definitions)."""

import pytest

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


def test_ttft_and_tpot_follow_their_definitions():
    """TTFT = first token - arrival; TPOT = (finish - first token) / (tokens emitted after the first
    step), averaged over requests (vLLM's mean TPOT where the first step emits one token); a
    request whose first step emitted all its tokens, or unfinished, has no TPOT."""
    a = RequestMetrics(arrival_s=10.0, first_token_s=10.5, finish_s=12.5)  # 5 tokens: TPOT 2.0 / 4
    b = RequestMetrics(arrival_s=10.0, first_token_s=11.0, finish_s=11.3, first_step_tokens=3)  # 6 tokens: 0.3 / 3
    one = RequestMetrics(arrival_s=10.0, first_token_s=10.2, finish_s=10.2, first_step_tokens=3)  # all 3 in one step
    waiting = RequestMetrics(arrival_s=10.0)
    assert a.ttft_s() == 0.5 and a.tpot_s(5) == 0.5 and b.tpot_s(6) == pytest.approx(0.1)
    assert one.tpot_s(3) is None and waiting.ttft_s() is None and waiting.tpot_s(0) is None
    run = RunMetrics()
    for r, n in ((a, 5), (b, 6), (one, 3), (waiting, 0)):
        run.add(r, n)
    assert run.mean_ttft_s == pytest.approx((0.5 + 1.0 + 0.2) / 3)
    assert run.mean_tpot_s == pytest.approx((0.5 + 0.1) / 2)
    assert run.summary()["mean_tpot_ms"] == 300.0 and RunMetrics().summary()["mean_tpot_ms"] is None


def test_engine_stamps_arrival_first_token_and_finish(tiny_llama):
    """Every request of a generate call gets the three stamps in order; the run's TPOT is the mean
    over its requests of more than one token, and a request's TTFT includes its wait in the queue."""
    from minispec import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), draft_model="ngram", num_speculative_tokens=3, max_num_seqs=1, kv_cache_gib=0.01)
    outs = llm.generate([[1, 2, 3, 4], [5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=n) for n in (6, 1, 5)])
    for o in outs:
        m = o.metrics
        assert m.arrival_s <= m.first_token_s <= m.finish_s and 1 <= m.first_step_tokens <= len(o.token_ids)
        if len(o.token_ids) > m.first_step_tokens:  # the first step's tokens are in the TTFT, not the TPOT
            assert m.tpot_s(len(o.token_ids)) == (m.finish_s - m.first_token_s) / (len(o.token_ids) - m.first_step_tokens)
    assert outs[1].metrics.tpot_s(1) is None
    assert outs[2].metrics.ttft_s() > outs[0].metrics.ttft_s()  # one request at a time: the third waited
    run = llm.last_metrics
    tpots = [t for t in (outs[0].metrics.tpot_s(6), outs[2].metrics.tpot_s(5)) if t is not None]
    assert run.num_tpot == len(tpots) >= 1 and run.mean_tpot_s == pytest.approx(sum(tpots) / len(tpots))
