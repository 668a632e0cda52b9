"""Chunked prefill (minispec/runtime/chunked_prefill.py): a long prompt is fed a chunk a step while
the sequences in flight keep decoding.

Invariants taught here:
* a decoding request gets tokens every step while a prompt 10x the step's budget is prefilled, and
  no step feeds the target more than the budget: prompt tokens, continuing chunks, verification
  rows and their drafts all count, however many long prompts arrive at once;
* outputs with chunked prefill equal those without, token for token and logprob for logprob (the
  target row-invariant), for every drafter, greedy and seeded, with prefix caching too;
* a draft model's prompt follows the target's chunks, so a chain step feeds it no more than the budget;
* the plan: in admission order, what fits runs the step; a prompt that does not fit gets what is
  left (never its newest token), and the rest sit the step out; a budget that cannot hold one
  verification row is refused (the oldest sequence always steps).
"""

from __future__ import annotations

import pytest
import torch

from minispec import LLM, SamplingParams, load_checkpoint
from minispec.engine import LLMEngine
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


def fed_per_step(engine: LLMEngine, runner) -> list[int]:
    """Count the tokens fed to runner in each engine step from now on (every forward of the step:
    chunks, verifications, a drafter's forwards): returns the list the steps append to."""
    fed: list[int] = []
    step, forward = engine.step, runner.forward

    def counting_step():
        fed.append(0)
        return step()

    def counting_forward(feeds, **kwargs):
        fed[-1] += sum(len(f.tokens) for f in feeds)
        return forward(feeds, **kwargs)

    engine.step, runner.forward = counting_step, counting_forward
    return fed


def long_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 300, (length + i,), generator=g).tolist() for i in range(n)]


def test_the_plan_runs_what_fits_chunks_a_prompt_and_holds_the_rest_back():
    seqs = [Planned(40, 39), Planned(30, 0), Planned(100, 0), Planned(9, 0), Planned(7, 6)]
    # budget 50, k = 2: the decode takes 3, the 30-token prompt 32; the 100-token one gets the 15
    # left; then nothing is left: the 9-token prompt and the decode behind it sit the step out
    assert plan_chunks(seqs, 50, 2) == {2: 15, 3: 0, 4: 0}
    assert plan_chunks(seqs, 200, 2) == {}  # all fit: 3 + 32 + 102 + 11 + 3
    assert plan_chunks([Planned(100, 96)], 2, 0) == {0: 2}  # a chunk below a page when that is what is left
    assert plan_chunks([Planned(100, 97)], 8, 6) == {0: 2}  # never the newest token (the 3 with 6 drafts: 9)
    assert plan_chunks([Planned(10, 9), Planned(100, 0)], 3, 2) == {1: 0}  # a verification row fills the budget


def test_a_budget_below_one_verification_row_is_refused(tiny_llama, tiny_llama_draft):
    """The oldest sequence must always be able to step, or the engine would wait forever: with
    chunked prefill the budget holds at least one sequence's newest token and its k drafts."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 cannot hold one sequence's verification step of 4"):
        LLM(str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.02,
            enable_chunked_prefill=True, max_num_batched_tokens=3)
    LLM(str(tiny_llama), kv_cache_gib=0.02, enable_chunked_prefill=True, max_num_batched_tokens=1)  # plain decoding: 1


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


@pytest.mark.parametrize("budget", [32, 100])
def test_a_burst_of_long_prompts_never_feeds_a_step_past_the_budget(tiny_llama, budget):
    """Many prompts longer than the budget at once (serve's burst): every step feeds the target
    at most max_num_batched_tokens, though several prompts are mid-chunk, and every request
    completes."""
    llm = LLM(str(tiny_llama), kv_cache_gib=0.05, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    engine = llm.engine
    fed = fed_per_step(engine, engine.target)
    length = 90  # past either budget: several prompts are admitted while others are mid-chunk
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in long_prompts(16, length)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(s.output_ids) == 3 for s in seqs)
    assert max(fed) <= budget, f"steps fed {sorted(fed)[-5:]} tokens, budget {budget}"


def test_a_draft_model_is_fed_its_prompt_in_the_targets_chunks(tiny_llama, tiny_llama_draft):
    """A chain's draft model keeps the budget too: its prompt comes in the same chunks as the
    target's (its later forwards catch up one or two tokens and feed one per draft), so no step
    feeds it more than max_num_batched_tokens."""
    llm = LLM(str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.05,
              enable_chunked_prefill=True, max_num_batched_tokens=16)
    engine = llm.engine
    draft_runner = engine.runners[1][0]
    target_fed, draft_fed = fed_per_step(engine, engine.target), fed_per_step(engine, draft_runner)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in long_prompts(2, 240)]
    while engine.has_unfinished():
        engine.step()
    assert all(len(s.output_ids) == 8 for s in seqs) and llm.engine.drafter.runner is draft_runner
    assert max(target_fed) <= 16 and max(draft_fed) <= 16, (max(target_fed), max(draft_fed))


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
        fed = [fed_per_step(llm.engine, runner) for runner, _ in llm.engine.runners]  # target's, draft's
        return llm, llm.generate(prompts[:1], params) + llm.generate(prompts, params), fed

    _, plain, _ = run(False)
    llm, chunked, fed = run(True)
    assert_same_outputs(plain, chunked)
    assert max(fed[0]) <= 16  # (a tree's rows of 6 let two sequences step at a time: the others wait their turn)
    if drafter == "draft":  # a chain's draft model too (module docstring of runtime/chunked_prefill.py)
        assert max(fed[1]) <= 16
    if draft is not None:
        assert llm.last_metrics.num_drafted > 0
