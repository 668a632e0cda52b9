"""Speculation by load (minispec/runtime/speculation_by_load.py): each step's k from measured costs.

Invariants taught here:
* the choice: with nothing measured, the full k; where a verification costs about a decode step
  (batch 1 on a memory-bound machine) the full k; where the target's time grows with every token
  fed (a compute-bound batch) and drafts are often rejected, k = 0 (plain decoding);
* exactness whatever k a step gets: a controller that changes k every step (0, 1, 2, 0, ...) keeps
  the law of the target (chi-square, alpha as in test_speculative_statistical.py), and greedy
  output is plain greedy output token for token;
* the engine feeds it real step timings, and the server shows the k in use.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from minispec import LLM, SamplingParams
from minispec.runtime.speculation_by_load import SpeculationByLoad
from test_speculative_statistical import ALPHA, exact_distribution, models, pooled_chi_square, sample_counts  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def feed(load: SpeculationByLoad, cost, batch: int, k: int, accepted_per_draft: float, steps: int = 30) -> None:
    """Steps at this batch size with k drafts, the target taking cost(tokens fed) seconds, a draft
    position 1 ms, and each draft accepted with this chance, independently of the ones before it."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        runs = [int(torch.cat([torch.rand(k, generator=g) >= accepted_per_draft, torch.ones(1, dtype=torch.bool)]).int().argmax())
                for _ in range(batch)]  # drafts accepted before the first rejection
        load.observe(batch * (k + 1), cost(batch * (k + 1)), batch, k, 0.001 * k, [(k, a) for a in runs])


def test_nothing_measured_drafts_the_full_k():
    assert SpeculationByLoad(4).choose(1) == 4 and SpeculationByLoad(4).choose(64) == 4


def test_a_memory_bound_step_drafts_the_full_k_and_a_compute_bound_batch_none():
    memory_bound = SpeculationByLoad(4)  # 20 ms a forward whatever its size (weights read once)
    for k in (4, 2, 0):
        feed(memory_bound, lambda tokens: 0.020 + 1e-5 * tokens, 1, k, 0.8)
    assert memory_bound.choose(1) == 4
    compute_bound = SpeculationByLoad(4)  # every token costs 1 ms: a verified token as much as a decoded one
    for batch, k in ((16, 0), (16, 4), (4, 4), (64, 0)):
        feed(compute_bound, lambda tokens: 0.001 * tokens, batch, k, 0.3)
    assert compute_bound.choose(16) == 0
    assert compute_bound.choose(1) > 0  # alone, the same costs still pay for drafting


def test_acceptance_is_counted_depth_by_depth_and_times_are_medians():
    """Drafts accepted in runs: one sequence in two accepts all 4, the other none, so a step gives
    3 tokens a sequence. The single rate this replaced, accepted / (accepted + rejections) = 4 / 5,
    predicted 3.36; the share of drafts accepted, 0.5, would predict 1.94; the rates counted depth
    by depth (0.5, then 1, 1, 1) predict the 3, and the full k. A step far off (a cold first step
    at 50x the time, or a stall later on) does not move the times the choice reads."""
    load = SpeculationByLoad(4)
    load.observe(10, 1.0, 2, 4, 0.004 * 4, [(4, 4), (4, 0)])  # cold
    for _ in range(2):
        load.observe(10, 0.020, 2, 4, 0.004 * 4, [(4, 4), (4, 0)])
    assert load.target.at(10) == pytest.approx(0.020)
    for _ in range(60):
        load.observe(10, 0.020, 2, 4, 0.004 * 4, [(4, 4), (4, 0)])
    assert load.expected_tokens(4) == pytest.approx(1 + 4 * 0.5, rel=0.01)
    assert [round(load.acceptance(j), 2) for j in (1, 2, 3, 4)] == [0.5, 1.0, 1.0, 1.0]
    assert load.choose(2) == 4
    load.observe(10, 1.0, 2, 4, 0.004 * 4, [(4, 4), (4, 0)])  # a stall
    assert load.target.at(10) == pytest.approx(0.020) and load.choose(2) == 4
    shorter = SpeculationByLoad(4)  # drafting 2: depths 3 and 4 keep their prior, 1 in 2
    for _ in range(60):
        shorter.observe(9, 0.020, 3, 2, 0.004 * 2, [(2, 2), (2, 2), (2, 1)])
    assert [round(shorter.acceptance(j), 2) for j in (1, 2, 3, 4)] == [1.0, 0.67, 0.5, 0.5]


def test_any_k_a_step_gets_keeps_the_targets_law(models, monkeypatch):
    """Exactness: a controller that changes k every step still samples the target's law."""
    cycle, used = itertools.cycle([0, 1, 2]), []

    def choose(self, batch):
        self.last_k = next(cycle)
        used.append(self.last_k)
        return self.last_k

    monkeypatch.setattr(SpeculationByLoad, "choose", choose)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    counts, llm = sample_counts(models["target"], (models["near"], models["tok"]), 2, params, 4, models["tok"],
                                speculation_by_load=True)
    pval, _, _ = pooled_chi_square(counts, exact_distribution(models["target"], params, 4))
    assert pval > ALPHA and set(used) == {0, 1, 2} and llm.last_metrics.num_accepted > 0


def test_greedy_output_is_plain_greedy_output_and_the_engine_measures(tiny_llama, tiny_llama_draft):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 12, 30, 7, 18, 3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_llama), kv_cache_gib=0.02).generate(prompts, params)
    llm = LLM(str(tiny_llama), draft_model=str(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.02,
              speculation_by_load=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    load = llm.engine.load
    assert load.target.points and 0 <= load.last_k <= 3  # fed by the engine's own steps
    with pytest.raises(ValueError, match="speculation_by_load must be True or False"):
        LLM(str(tiny_llama), speculation_by_load="yes")
