"""Penalties, min_tokens and logprobs on the one-upload, one-download step (speculative.py).

Requests with these options take the same step as the others: their token counts live on the
device (penalties.Penalties) and grow by the tokens each upload carries, the verification rows (and
a draft model's q) are penalised there, and the logprobs of the verified rows come back in the
step's one download. What this checks, with plain decoding, the n-gram drafter, a draft model and
the EAGLE head (and the target drafting for itself), greedy, seeded and pathwise requests, alone and beside plain ones:

  * a step after warm-up makes one upload and one download and nothing else crosses (counted
    as tests/test_transfers.py counts);
  * the step gives the host path's tokens (`host_step`, its reference twin, reached by making
    `needs_host` true) and its logprobs (same ids and ranks, values within fp tolerance);
  * the options do act: penalties change greedy tokens, min_tokens keeps stop tokens out.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minispec import LLM, SamplingParams
from test_transfers import DRAFTER_BACKEND, step_transfers

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:draft_model .* is not smaller")]  # (the target drafting for itself)

PENALISED = dict(repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.4)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, max_tokens=16, ignore_eos=True, seed=7)


def batch(base: SamplingParams, stop: list[int]) -> list[SamplingParams]:
    """A penalised request, one with min_tokens (stop ids `stop`) and logprobs, and a plain one."""
    return [dataclasses.replace(base, **PENALISED),
            dataclasses.replace(base, min_tokens=8, stop_token_ids=stop, logprobs=3, seed=(base.seed or 0) + 1),
            dataclasses.replace(base, seed=(base.seed or 0) + 2)]


def pathwise_batch(stop: list[int]) -> list[SamplingParams]:
    """Pathwise requests with the options (one with all of them), beside a standard sampled one."""
    return [dataclasses.replace(SAMPLED, pathwise=True, logprobs=2, **PENALISED),
            dataclasses.replace(SAMPLED, pathwise=True, min_tokens=5, stop_token_ids=stop, logprobs=0, seed=8),
            dataclasses.replace(SAMPLED, seed=9)]


# self: the target drafts for itself, 5 at a time: every draft it would emit is accepted, so rows
# deep in a step, penalised with the drafts before them (a repeated token among them), decide.
DRAFTERS = ["none", "ngram", "draft", "eagle", "self"]
PROMPTS = ["a b a b a b a b", "the quick brown fox", "one two three one two three"]


def make_llm(drafter: str, tiny_llama, tiny_llama_draft, tiny_llama_eagle) -> LLM:
    args = {"none": {}, "ngram": dict(draft_model="ngram", num_speculative_tokens=3),
            "draft": dict(draft_model=str(tiny_llama_draft), num_speculative_tokens=3),
            "eagle": dict(draft_model=str(tiny_llama_eagle), num_speculative_tokens=3),
            "self": dict(draft_model=str(tiny_llama), num_speculative_tokens=5)}[drafter]
    return LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend=DRAFTER_BACKEND, static_shapes=True, **args)


@pytest.fixture(scope="module", params=DRAFTERS)
def llm(request, tiny_llama, tiny_llama_draft, tiny_llama_eagle) -> LLM:
    return make_llm(request.param, tiny_llama, tiny_llama_draft, tiny_llama_eagle)


def greedy_tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, [GREEDY] * len(prompts))]


@pytest.mark.parametrize("case", ["greedy", "sampled", "pathwise"])
@pytest.mark.parametrize("llm", [d for d in DRAFTERS if d != "self"], indirect=True)  # (self: a draft model's case,
def test_a_step_with_the_options_makes_one_upload_and_one_download(llm, case, monkeypatch):  # done within warm-up)
    """Penalties, min_tokens and logprobs (greedy, seeded, pathwise; beside a plain request):
    a step after warm-up sends one upload, brings one download, and nothing else crosses."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())  # the GPU's full sort (a CPU checks on the host)
    stop = [greedy_tokens(llm, PROMPTS[1:2])[0][1]]
    params = {"greedy": batch(GREEDY, stop), "sampled": batch(SAMPLED, stop), "pathwise": pathwise_batch(stop)}[case]
    for step in step_transfers(llm, params, monkeypatch, steps=2, prompts=PROMPTS):
        assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]


def generate(llm: LLM, params: list[SamplingParams], monkeypatch, host: bool):
    with monkeypatch.context() as m:
        if host:
            m.setattr("minispec.speculative.needs_host", lambda seq: True)
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("case", ["greedy", "sampled", "pathwise"])
def test_the_device_step_gives_the_host_steps_tokens_and_logprobs(llm, case, monkeypatch):
    """The one-upload step and its host twin (`host_step`: `penalties.penalize` row by row,
    `top_logprobs`, pathwise.verify) emit the same tokens for greedy and seeded requests, and the
    same logprobs: the same top ids and ranks, values within fp tolerance."""
    stop = [greedy_tokens(llm, PROMPTS[1:2])[0][1]]
    params = {"greedy": batch(GREEDY, stop), "sampled": batch(SAMPLED, stop), "pathwise": pathwise_batch(stop)}[case]
    device = generate(llm, params, monkeypatch, host=False)
    host = generate(llm, params, monkeypatch, host=True)
    for d, h in zip(device, host):
        assert d.token_ids == h.token_ids
        assert (d.logprobs is None) == (h.logprobs is None)
        for dl, hl in zip(d.logprobs or [], h.logprobs or []):
            assert list(dl) == list(hl)
            assert [x.rank for x in dl.values()] == [x.rank for x in hl.values()]
            assert [x.logprob for x in dl.values()] == pytest.approx([x.logprob for x in hl.values()], abs=1e-5)


def test_the_options_act_on_the_device_step(tiny_llama, monkeypatch):
    """Not a no-op: on the one-upload step penalties change greedy tokens, and min_tokens keeps a
    stop token that greedy decoding emits early out of the first min_tokens tokens."""
    llm = make_llm("none", tiny_llama, None, None)
    plain = greedy_tokens(llm, PROMPTS)
    penalised = llm.generate(PROMPTS, [dataclasses.replace(GREEDY, **PENALISED)] * len(PROMPTS))
    assert any(o.token_ids != t for o, t in zip(penalised, plain))
    stop = plain[1][1]
    held = llm.generate(PROMPTS[1:2], [dataclasses.replace(GREEDY, min_tokens=6, stop_token_ids=[stop])])[0]
    assert stop not in held.token_ids[:6]


def test_preemption_leaves_the_counts_right(tiny_llama, tiny_llama_draft, monkeypatch):
    """A KV pool too small for every request preempts some (pages freed, tokens kept, recomputed
    on readmission): the counts on the device describe tokens, not pages, so the penalised
    requests still emit the host path's tokens."""
    from minispec import load_checkpoint
    from minispec.runtime.kv_cache import KVCache

    models = [load_checkpoint(p, dtype=torch.float32, device="cpu") for p in (tiny_llama, tiny_llama_draft)]
    per_page = sum(KVCache.bytes_per_page(m.cfg, 4, torch.float32) for m, _ in models)
    llm = LLM(model=models[0], draft_model=models[1], num_speculative_tokens=3, page_size=4,
              kv_cache_gib=13 * per_page / 2**30)
    params = [dataclasses.replace(SAMPLED, seed=i, **PENALISED) for i in range(6)]
    prompts = PROMPTS * 2
    with monkeypatch.context() as m:
        m.setattr("minispec.speculative.needs_host", lambda seq: True)
        host = [o.token_ids for o in llm.generate(prompts, params)]
    device = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in device] == host


def test_penalize_is_vllms_arithmetic():
    """`penalize` (and so the device's `Penalties`, which shares its formula) against vLLM's
    definitions written out token by token: repetition over prompt and output, presence and
    frequency over the output, min_tokens masking EOS and the stop ids."""
    from minispec.penalties import penalize

    logits = torch.tensor([[1.5, -0.5, 2.0, 0.25, -1.0, 0.75]])  # [1, V]
    p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, min_tokens=4,
                       stop_token_ids=[5])
    prompt, output = [0, 1], [2, 2, 1]
    want = logits[0].tolist()
    for t in set(prompt + output):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    for t in set(output):
        want[t] -= 0.3 + 0.2 * output.count(t)
    want[4] = want[5] = float("-inf")  # EOS 4 and stop id 5: 3 output tokens < min_tokens 4
    got = penalize(logits, [(p, len(prompt), prompt + output, [4])])[0].tolist()
    assert got == pytest.approx(want)
