"""The lookup-first drafter (minispec/drafters/lookup.py), step by step: which half drafts, and the q it
reports. (Its exactness runs with the others: greedy identity and seeded batch invariance in
test_speculative_greedy.py, the output law and a planted bug in test_speculative_statistical.py,
the EAGLE head's catch-up after looked-up steps in test_eagle.py.)"""

from __future__ import annotations

import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.drafters.ngram import NgramDrafter
from proposals import recording_proposals

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44], [9, 9, 9, 9], [100, 3, 77, 12, 9, 250, 31, 8],
           [20, 21, 22, 20, 21], [60, 61, 60, 61, 60, 61]]


def recorded(llm: LLM, params) -> list[tuple[list[int], int, list[int], torch.Tensor | None]]:
    """Every proposal of a generate call: (the sequence's tokens, num_draft asked, drafts, its q rows or None)."""
    with recording_proposals(llm.engine.drafter) as seen:
        llm.generate(PROMPTS, params)
    return [(tokens, n, drafts, q) for _, tokens, n, drafts, q in seen]


def test_lookup_drafts_where_the_context_repeats_and_the_model_elsewhere(tiny_llama, tiny_llama_draft):
    """Sampled requests: a sequence whose last >= 2 tokens occurred before gets lookup's
    continuation with one-hot q rows; any other gets the draft model's tokens, each drawn where
    its reported q is positive; rows past the drafts are zero."""
    llm = LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, kv_cache_gib=0.01,
              page_size=8, prompt_lookup_min=2)
    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    lookup = NgramDrafter(3, 2)
    by_lookup = by_model = 0
    for tokens, n, drafts, q in recorded(llm, params):
        expected = lookup.lookup(tokens, n) if n > 0 else []
        assert q is not None and q.shape[0] == len(drafts) + 1 and not q[len(drafts)].any()
        if expected:
            by_lookup += 1
            assert drafts == expected
            assert torch.equal(q[: len(drafts)], torch.nn.functional.one_hot(torch.tensor(drafts), q.shape[1]).float())
        elif drafts:
            by_model += 1
            assert all(q[i, t] > 0 for i, t in enumerate(drafts))
            torch.testing.assert_close(q[: len(drafts)].sum(-1), torch.ones(len(drafts)))
    assert by_lookup >= 3 and by_model >= 3
    assert (llm.engine.drafter.lookup_drafts, llm.engine.drafter.model_drafts) == (by_lookup, by_model)


def test_an_all_greedy_batch_gets_no_q(tiny_llama, tiny_llama_draft):
    """Greedy: every q is one-hot at its drafted token, so none is built (as for the other drafters)."""
    llm = LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, kv_cache_gib=0.01,
              page_size=8, prompt_lookup_min=2)
    seen = recorded(llm, SamplingParams(temperature=0, max_tokens=12))
    assert any(d for _, _, d, _ in seen) and all(q is None for *_, q in seen)


def test_a_mixed_greedy_and_sampled_batch(tiny_llama, tiny_llama_draft):
    """Greedy and seeded sampled requests in one batch (q then holds one-hot rows, the draft's rows
    and zeros side by side): the greedy ones emit plain greedy decoding's tokens, the sampled
    ones what they emit alone."""
    llm = LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, kv_cache_gib=0.01,
              page_size=8, prompt_lookup_min=2)
    plain = LLM(model=tiny_llama, kv_cache_gib=0.01, page_size=8)
    params = [SamplingParams(temperature=0, max_tokens=16) if i % 2 == 0 else
              SamplingParams(temperature=0.9, max_tokens=16, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    together = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = (plain if p.greedy else llm).generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids
    assert llm.engine.drafter.lookup_drafts > 0 and llm.engine.drafter.model_drafts > 0


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_a_staged_step_proposes_what_the_host_loop_proposes(tiny_llama, tiny_llama_draft, monkeypatch, threshold):
    """The step laid out ahead (`stage` / `run_staged`: lookup's tokens uploaded, the model's drawn
    on the device, q joined there) and the host loop (`propose`, what `host_step` runs) make the
    same proposals from the same seeded requests: the same drafts, q equal to float rounding
    (one-hot at looked-up tokens, the model's q elsewhere), so the same outputs. With a confidence
    threshold the model drafts on the host inside the staged step and may stop short of k: its q
    has rows past the step's longest draft (a shape the join once refused)."""
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    runs = []
    for host in (False, True):
        if host:
            monkeypatch.setattr("minispec.speculative.needs_host", lambda seq: True)
        llm = LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, kv_cache_gib=0.01,
                  page_size=8, prompt_lookup_min=2, draft_confidence_threshold=threshold)
        with recording_proposals(llm.engine.drafter) as seen:
            outs = llm.generate(PROMPTS, params)
        runs.append(([o.token_ids for o in outs], seen, llm.engine.drafter))
    (staged_out, staged, hybrid), (host_out, host, _) = runs
    assert staged_out == host_out and len(staged) == len(host)
    for (_, tokens, n, drafts, q), (_, host_tokens, host_n, host_drafts, host_q) in zip(staged, host):
        assert (tokens, n, drafts) == (host_tokens, host_n, host_drafts)
        torch.testing.assert_close(q, host_q)
    assert hybrid.lookup_drafts > 0 and hybrid.model_drafts > 0
