"""Chunked prefill (minispec/runtime/chunked_prefill.py): a long prompt is fed a chunk a step while
the sequences in flight keep decoding.

Invariants taught here:
* a decoding request gets tokens every step while a prompt 10x the step's budget is prefilled, and
  no target forward feeds more than the budget (plus the step's own drafts);
* outputs with chunked prefill equal those without, token for token and logprob for logprob (the
  target row-invariant), for every drafter, greedy and seeded, with prefix caching too;
* the plan: sequences that fit run the step, the others get what is left (never their newest token).
"""

from __future__ import annotations

import pytest
import torch

from minispec import LLM, SamplingParams, load_checkpoint
from minispec.runtime.chunked_prefill import plan_chunks
from minispec.runtime.kv_cache import BlockTable
from test_prefix_cache import DRAFTERS, draft_for
from test_row_invariance import assert_same_outputs

pytestmark = pytest.mark.usefixtures("one_thread")


class Planned:
    def __init__(self, length: int, cached: int):
        self.length, self.target_table = length, BlockTable(8, num_cached=cached)

    def __len__(self) -> int:
        return self.length


def test_the_plan_runs_what_fits_and_chunks_the_rest():
    seqs = [Planned(40, 39), Planned(30, 0), Planned(100, 0), Planned(9, 0), Planned(7, 6)]
    # budget 50, k = 2: the decode takes 3, the 30-token prompt 32; the 100-token one gets the 15 left,
    # the 9-token one the minimum chunk of 8 (never its newest token); a decode always runs
    assert plan_chunks(seqs, 50, 2, 8) == {2: 15, 3: 8}
    assert plan_chunks([Planned(100, 96)], 2, 0, 8) == {0: 3}  # what is left but the newest token


def test_a_decode_goes_on_while_a_long_prompt_is_prefilled(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_gib=0.02, enable_chunked_prefill=True, max_num_batched_tokens=24)
    engine, runner = llm.engine, llm.engine.target
    fed = []
    forward = runner.forward

    def counting(feeds, **kwargs):
        fed.append(sum(len(f.tokens) for f in feeds))
        return forward(feeds, **kwargs)

    runner.forward = counting
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = engine.add_request([5, 6, 7], params)
    engine.step()
    long = engine.add_request(torch.randint(2, 300, (240,), generator=torch.Generator().manual_seed(0)).tolist(),
                              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = 0
    while not long.output_ids:
        before = len(short.output_ids)
        engine.step()
        steps += 1
        assert len(short.output_ids) == before + 1, "the decode waited for the prefill"
    assert steps >= 10 and max(fed) <= 24


@pytest.mark.parametrize("drafter", [d for d in DRAFTERS if d != "ngram"])
@pytest.mark.parametrize("mode", ["greedy", "seeded", "prefix-cached"])
def test_outputs_with_chunked_prefill_equal_those_without(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter, mode):
    target = load_checkpoint(tiny_llama, dtype="float32")
    draft = draft_for(drafter, tiny_llama_draft, tiny_llama_eagle)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, 300, (20,), generator=g).tolist()
    prompts = [system + torch.randint(2, 300, (n,), generator=g).tolist() + [5, 6, 5, 6] for n in (50, 3, 31, 12)]
    params = SamplingParams(temperature=0 if mode != "seeded" else 0.8, max_tokens=20, ignore_eos=True, logprobs=0,
                            seed=None if mode != "seeded" else 2)

    def run(chunked: bool):
        llm = LLM(target, draft_model=draft, row_invariant=True, kv_cache_gib=0.02, page_size=8,
                  enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked else 8192,
                  enable_prefix_caching=mode == "prefix-cached", **DRAFTERS[drafter])
        return llm, llm.generate(prompts[:1], params) + llm.generate(prompts, params)

    _, plain = run(False)
    llm, chunked = run(True)
    assert_same_outputs(plain, chunked)
    if draft is not None:
        assert llm.last_metrics.num_drafted > 0
