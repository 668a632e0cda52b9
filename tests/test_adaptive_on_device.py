"""Adaptive drafting (a confidence threshold) decided on the device (drafters/base.py
`stops_on_device`): the same drafts as the host loop, in one upload and one download a step.

With a threshold c a sequence stops drafting after a token its drafter gave probability < c (and
before a row whose logits are not finite). On the host the loop reads each depth's tokens back and
launches no forward past the last sequence's stop; on the device (CUDA's default) every one of the
k forwards runs, and a sequence's draws past its stop fall past its num_draft. Either way the
stop depends only on what was drafted, so the drafts, and with them every emitted token, are the
same. What this checks, with a draft model and the EAGLE head, greedy, seeded sampled and pathwise
requests in one batch:
  * forced onto the device, a step after warm-up makes one upload and one download, nothing else;
  * the device's stops give the host loop's tokens and the same drafted and accepted counts;
  * the threshold does act here: without it the same runs draft more (so the comparison above
    would see a device stop that ignored it).
"""

from __future__ import annotations

import dataclasses

import pytest

from minispec import LLM, SamplingParams
from minispec.drafters.base import AutoregressiveDrafter
from test_transfers import DRAFTER_BACKEND, step_transfers

pytestmark = pytest.mark.usefixtures("one_thread")

THRESHOLD = 0.02  # the tiny models' own probabilities straddle it: some steps stop early, some run to k
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, max_tokens=14, ignore_eos=True, seed=5)
BATCH = [GREEDY, SAMPLED, dataclasses.replace(SAMPLED, pathwise=True, seed=6)]
PROMPTS = ["a b a b a b", "the quick brown fox", "one two three one two"]


def model_drafter(llm: LLM) -> AutoregressiveDrafter:
    """The engine's draft model or EAGLE head."""
    assert isinstance(llm.engine.drafter, AutoregressiveDrafter)
    return llm.engine.drafter


def make_llm(drafter: str, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device: bool,
             threshold: float | None = THRESHOLD) -> LLM:
    draft = str(tiny_llama_draft if drafter == "draft" else tiny_llama_eagle)
    llm = LLM(model=str(tiny_llama), draft_model=draft, num_speculative_tokens=4, draft_confidence_threshold=threshold,
              kv_cache_gib=0.01, backend=DRAFTER_BACKEND, static_shapes=True)
    model_drafter(llm).confidence_on_device = on_device
    return llm


def run(llm: LLM) -> tuple[list[list[int]], int, int]:
    outputs = llm.generate(PROMPTS, BATCH, use_tqdm=False)
    m = llm.last_metrics
    return [o.outputs[0].token_ids for o in outputs], m.num_drafted, m.num_accepted


@pytest.mark.parametrize("drafter", ["draft", "eagle"])
def test_the_device_stops_where_the_host_loop_stops(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle):
    host = run(make_llm(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device=False))
    device = run(make_llm(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device=True))
    assert device == host
    unbounded = run(make_llm(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device=True, threshold=None))
    assert unbounded[1] > host[1] > 0  # the threshold stopped some drafting


@pytest.mark.parametrize("drafter", ["draft", "eagle"])
def test_a_step_stopping_on_the_device_makes_one_upload_and_one_download(drafter, tiny_llama, tiny_llama_draft,
                                                                         tiny_llama_eagle, monkeypatch):
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())  # the GPU's full sort (a CPU checks on the host)
    llm = make_llm(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device=True)
    for step in step_transfers(llm, BATCH, monkeypatch, prompts=PROMPTS):
        assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    host = make_llm(drafter, tiny_llama, tiny_llama_draft, tiny_llama_eagle, on_device=False)
    steps = step_transfers(host, BATCH, monkeypatch, prompts=PROMPTS)
    assert any(step["down"] > 0 for step in steps)  # the counter sees the host loop's copies
