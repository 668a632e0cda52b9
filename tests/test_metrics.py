"""The metrics people monitor, on hand-made counts (vLLM's definitions)."""

import pytest

from minispec.runtime.metrics import RequestMetrics, RunMetrics


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
    """Every request of a generate call gets the three stamps in order; with the target as its own
    draft every greedy draft is accepted, so the first step (prompt and k drafts verified) emits
    k + 1 tokens, which the TPOT leaves to the TTFT; a queued request's TTFT includes its wait."""
    from minispec import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama), num_speculative_tokens=3, max_num_seqs=1, kv_cache_gib=0.01)
    outs = llm.generate([[1, 2, 3, 4], [5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=n) for n in (9, 1, 6)])
    for o in outs:
        m = o.metrics
        assert m.arrival_s <= m.first_token_s <= m.finish_s
    assert [o.metrics.first_step_tokens for o in outs] == [4, 1, 4]
    m = outs[0].metrics
    assert m.tpot_s(9) == (m.finish_s - m.first_token_s) / (9 - 4)
    assert outs[1].metrics.tpot_s(1) is None
    assert outs[2].metrics.ttft_s() > outs[0].metrics.ttft_s()  # one request at a time: the third waited
    run = llm.last_metrics
    assert run.num_tpot == 2 and run.mean_tpot_s == pytest.approx((outs[0].metrics.tpot_s(9) + outs[2].metrics.tpot_s(6)) / 2)


def test_runs_merge_as_their_requests_would_add():
    """RunMetrics.merge (bench.py's sum over rounds) gives the counts and time sums of one run
    holding both runs' requests."""
    reqs = [RequestMetrics(arrival_s=0.0, first_token_s=0.2, finish_s=1.0), RequestMetrics(arrival_s=0.0, first_token_s=0.4, finish_s=0.6)]
    reqs[0].record(3, 2)
    reqs[1].record(3, 1)
    one, first, second = RunMetrics(draft_s=0.5), RunMetrics(draft_s=0.25), RunMetrics(draft_s=0.25)
    for r, n in zip(reqs, (5, 3)):
        one.add(r, n)
    first.add(reqs[0], 5)
    second.add(reqs[1], 3)
    first.merge(second)
    assert first == one


@pytest.mark.parametrize("tree", [False, True])
def test_streams_servers_and_traces_count_drafts_as_the_run_does(tiny_llama, tiny_llama_draft, tree):
    """A tree step's event shows its taken branch and first rejected child, but counts the tree's
    depth as drafted, as RequestMetrics does; the server and the trace used to count the shown
    tokens, so a tree's acceptance rate differed by where it was read (0.364 against 0.267)."""
    from minispec import LLM, SamplingParams
    from minispec.server.protocol import accumulate
    from minispec.trace import RequestTrace

    options = dict(draft_tree_budget=6, draft_tree_top_k=2) if tree else {}
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.01, **options)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    events = list(llm.stream([[1, 2, 3, 4], [5, 6, 7]], params))
    run = llm.last_metrics
    choices, traces = {}, [RequestTrace(""), RequestTrace("")]
    for e in events:
        accumulate(choices, e)
        traces[e.index].add(e, llm.tokenizer)
    assert run.num_drafted > 0 and run.num_accepted < run.num_drafted
    assert sum(c["drafted"] for c in choices.values()) == run.num_drafted
    assert sum(c["accepted"] for c in choices.values()) == run.num_accepted
    by_position = [tuple(map(sum, zip(*counts))) for counts in zip(*(t.acceptance_by_position() for t in traces))]
    assert by_position == list(zip(run.accepted_per_position + [0] * 8, run.drafted_per_position))
    if tree:
        assert any(len(e.drafted) != e.num_drafted for e in events)  # what is shown is not what is counted


def test_prefill_steps_count_every_request_and_its_drafts_in_a_step_that_fed_a_prompt(tiny_llama, tiny_llama_draft):
    """bench's verify leaves out the time of steps that fed a prompt, so it must leave out all their
    request-steps: with 2 slots and 3 prompts the third joins a step where another decodes (it
    subtracted one request-step per request, which miscounts such steps)."""
    from minispec import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=2, max_num_seqs=2,
              kv_cache_gib=0.01)
    expected, drafted, step = [0], [0], llm.engine.step

    def counted():
        outputs = step()
        if any(len(o.seq.output_ids) == len(o.new_token_ids) for o in outputs):  # some request's first step
            expected[0] += len(outputs)
            drafted[0] += sum(o.num_drafted for o in outputs)
        return outputs

    llm.engine.step = counted
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params)
    m = llm.last_metrics
    assert expected[0] > m.num_requests and m.prefill_steps == expected[0] and 0 < m.prefill_s < m.target_s
    # the same steps' drafting (the draft model prefills the prompt there): bench's draft cost leaves it out
    assert drafted[0] > 0 and m.prefill_drafted == drafted[0] < m.num_drafted and 0 < m.draft_prefill_s < m.draft_s
