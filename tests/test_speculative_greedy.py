"""Greedy speculative decoding is plain greedy decoding, token for token (fp32), and a seeded
request samples the same tokens whatever else is in the batch.

Greedy verification accepts a draft token iff it is the target's argmax, so ANY drafter (a
different small model, the target itself, n-gram lookup) and any k must give exactly what plain
greedy decoding gives, including where it stops: at EOS or a stop string inside an accepted run
(nothing past it is emitted), and at max_tokens. The metrics must agree with the tokens emitted.
Models: conftest's tiny_llama target and tiny_llama_draft (different weights, 1 layer).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minispec import LLM, SamplingParams, load_checkpoint, quantize_model
from minispec.io.eagle_checkpoint import load_eagle

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a 2nd OpenMP thread only contends

FIXED = settings(derandomize=True, deadline=None, max_examples=25, suppress_health_check=list(HealthCheck))
GREEDY = SamplingParams(temperature=0)
DRAFTERS = ["model", "self", "ngram", "adaptive", "eagle", "eagle-adaptive", "model+lookup", "eagle+lookup",
            "eagle-adaptive+lookup"]
ADAPTIVE_THRESHOLD = 0.005  # tiny_llama_draft's confidences straddle it: draft lengths vary from 1 to k
EAGLE_THRESHOLD = 0.01  # the same for conftest's tiny_llama_eagle (its draft vocabulary: 160 tokens)
LOOKUP_MIN = 2  # "<drafter>+lookup": prompt lookup of >= 2 tokens first, the model drafter where it finds none


@pytest.fixture(scope="module", params=[None, "int8"])
def pair(request, tiny_llama, tiny_llama_draft, tiny_llama_eagle):
    """(target, tokenizer), (draft, tokenizer), the EAGLE head, loaded once; LLMs are built from them.
    Twice: fp32 weights, and int8 weights with per-row activation scales (fast/int8.py) for all three,
    where exactness is with respect to the int8 target."""
    quantization = request.param
    target, tok = load_checkpoint(tiny_llama, dtype="float32", quantization=quantization)
    draft, draft_tok = load_checkpoint(tiny_llama_draft, dtype="float32", quantization=quantization)
    return (target, tok), (draft, draft_tok), quantize_model(load_eagle(tiny_llama_eagle, target), quantization)


@pytest.fixture(scope="module")
def llms(pair):
    """llms(drafter, k) -> an LLM over tiny_llama ("none": plain decoding), built once per pair."""
    target, draft, eagle = pair
    built: dict = {}

    def get(drafter: str, k: int = 1, eos: int | None = None) -> LLM:
        key = (drafter, k, eos)
        if key not in built:
            model = target
            if eos is not None:  # same weights, another EOS id (a copy: the shared target is untouched)
                model = (copy.copy(target[0]), target[1])
                model[0].cfg = dataclasses.replace(target[0].cfg, eos_token_ids=[eos])
            name = drafter.removesuffix("+lookup")
            draft_model = {"none": None, "model": draft, "self": target, "ngram": "ngram", "adaptive": draft,
                           "eagle": eagle, "eagle-adaptive": eagle}[name]
            threshold = {"adaptive": ADAPTIVE_THRESHOLD, "eagle-adaptive": EAGLE_THRESHOLD}.get(name)
            built[key] = LLM(model=model, draft_model=draft_model, num_speculative_tokens=k if draft_model is not None else None,
                             kv_cache_gib=0.01, page_size=8, max_num_seqs=16, draft_confidence_threshold=threshold,
                             prompt_lookup_min=LOOKUP_MIN if drafter.endswith("+lookup") else None)
        return built[key]

    return get


prompts = st.lists(st.integers(2, 319), min_size=1, max_size=16)  # token ids (0, 1 are <s>, </s>)


def same_outputs(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


def check_metrics(out, k: int) -> None:
    """Counters agree with the tokens: each step emits accepted + 1 tokens (unless a stop cut it),
    drafts never exceed k nor what the request may still emit, accepted runs are prefixes."""
    m = out.metrics
    generated = len(out.token_ids)
    if out.finish_reason == "length":
        assert m.num_accepted + m.num_steps == generated
    else:
        assert generated <= m.num_accepted + m.num_steps
    assert m.num_drafted <= k * m.num_steps and m.num_accepted <= m.num_drafted
    assert sum(m.drafted_per_position) == m.num_drafted and sum(m.accepted_per_position) == m.num_accepted
    assert len(m.drafted_per_position) <= k
    assert all(a <= d for a, d in zip(m.accepted_per_position, m.drafted_per_position))
    assert m.accepted_per_position == sorted(m.accepted_per_position, reverse=True)


@FIXED
@given(
    batch=st.lists(prompts, min_size=1, max_size=3),
    k=st.integers(1, 6),
    drafter=st.sampled_from(DRAFTERS),
    max_tokens=st.integers(1, 20),
)
def test_greedy_speculative_equals_plain_greedy(llms, batch, k, drafter, max_tokens):
    """Any prompts, k in 1..6, model / self / n-gram / adaptive-length / lookup-first drafter: the same tokens, texts and finish
    reasons as plain greedy decoding (max_tokens reached mid-run included)."""
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
    plain = llms("none").generate(batch, params)
    spec = llms(drafter, k).generate(batch, params)
    same_outputs(spec, plain)
    for out in spec:
        check_metrics(out, k)
        assert out.finish_reason != "length" or len(out.token_ids) == max_tokens


@pytest.mark.parametrize("drafter", ["model+lookup", "eagle+lookup", "eagle-adaptive+lookup"])
def test_lookup_first_greedy_equals_plain_greedy_where_lookup_fires(llms, drafter):
    """Prompts that repeat themselves (random prompts rarely do): both halves of the hybrid draft,
    and the output is still plain greedy decoding's."""
    batch = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 40, 41, 42, 40], [9, 100, 9, 100, 9], [200, 201, 202]]
    params = dataclasses.replace(GREEDY, max_tokens=24)
    llm = llms(drafter, 3)
    hybrid = llm.engine.drafter
    before = (hybrid.lookup_drafts, hybrid.model_drafts)
    spec = llm.generate(batch, params)
    same_outputs(spec, llms("none").generate(batch, params))
    assert hybrid.lookup_drafts > before[0] and hybrid.model_drafts > before[1]


@FIXED
@given(prompt=prompts, k=st.integers(1, 6), drafter=st.sampled_from(DRAFTERS), data=st.data())
def test_eos_inside_an_accepted_run_stops_exactly_where_plain_decoding_stops(llms, prompt, k, drafter, data):
    """Declare as EOS a token plain greedy decoding emits at step j (first occurrence): speculative
    decoding stops at that same token (finish_reason "stop", no stop_reason: EOS), and emits nothing after it."""
    free = llms("none").generate([prompt], dataclasses.replace(GREEDY, max_tokens=16, ignore_eos=True))[0].token_ids
    eos = free[data.draw(st.integers(0, len(free) - 1))]
    params = dataclasses.replace(GREEDY, max_tokens=16)
    plain = llms("none", eos=eos).generate([prompt], params)
    spec = llms(drafter, k, eos=eos).generate([prompt], params)
    same_outputs(spec, plain)
    assert (spec[0].finish_reason, spec[0].outputs[0].stop_reason) == ("stop", None) and spec[0].token_ids == free[: free.index(eos) + 1]
    check_metrics(spec[0], k)


@FIXED
@given(prompt=prompts, k=st.integers(1, 6), drafter=st.sampled_from(DRAFTERS), data=st.data())
def test_stop_string_inside_an_accepted_run_stops_exactly_where_plain_decoding_stops(llms, prompt, k, drafter, data):
    """A stop string taken from plain greedy output: both stop at the same token, same cut text."""
    plain_llm = llms("none")
    free = plain_llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=16, ignore_eos=True))[0]
    start = data.draw(st.integers(0, max(len(free.text) - 1, 0)))
    stop = free.text[start : start + data.draw(st.integers(1, 3))]
    if not stop:
        return  # nothing printable was generated: no stop string to take from it
    params = dataclasses.replace(GREEDY, max_tokens=16, ignore_eos=True, stop=[stop])
    plain = plain_llm.generate([prompt], params)
    spec = llms(drafter, k).generate([prompt], params)
    same_outputs(spec, plain)
    assert spec[0].finish_reason == "stop" and stop not in spec[0].text
    assert spec[0].token_ids == free.token_ids[: len(spec[0].token_ids)]
    check_metrics(spec[0], k)


def test_the_accepted_run_is_cut_at_eos_and_at_a_stop_string(llms):
    """Target as its own draft, k = 6: the first step accepts 6 drafts + bonus, but EOS (or the
    stop string) is its 3rd token: exactly 3 tokens come out, and the counters show the step had
    accepted more than was emitted."""
    prompt, k = [5, 6, 7], 6
    free = llms("none").generate([prompt], dataclasses.replace(GREEDY, max_tokens=8, ignore_eos=True))[0]
    eos = free.token_ids[2]
    cut = free.token_ids.index(eos) + 1
    out = llms("self", k, eos=eos).generate([prompt], dataclasses.replace(GREEDY, max_tokens=8))[0]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", None) and out.token_ids == free.token_ids[:cut]
    assert out.metrics.num_steps == 1 and out.metrics.num_accepted == k > len(out.token_ids) - 1

    tok = llms("none").tokenizer
    stop = tok.decode(free.token_ids[:3])[len(tok.decode(free.token_ids[:2])) :]  # the 3rd token's text
    assert stop, "the 3rd greedy token of tiny_llama should print something"
    params = dataclasses.replace(GREEDY, max_tokens=8, ignore_eos=True, stop=[stop])
    plain = llms("none").generate([prompt], params)
    spec = llms("self", k).generate([prompt], params)
    same_outputs(spec, plain)
    assert spec[0].finish_reason == "stop" and len(spec[0].token_ids) <= 3
    assert spec[0].metrics.num_accepted == k > len(spec[0].token_ids) - 1


@pytest.mark.parametrize("k", [1, 3, 6])
def test_target_as_its_own_draft_accepts_everything(llms, k):
    """q == p: acceptance 1.0, every position 1.0, k + 1 tokens per step until the end, and
    max_tokens = 3 (k + 1) + 1 ends with one final step that drafts nothing."""
    max_tokens = 3 * (k + 1) + 1
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens, ignore_eos=True)
    llm = llms("self", k)
    outs = llm.generate([[5, 6, 7], [42, 43]], params)
    for out in outs:
        m = out.metrics
        assert len(out.token_ids) == max_tokens
        assert (m.num_steps, m.num_drafted, m.num_accepted) == (4, 3 * k, 3 * k)
        assert m.acceptance_rate == 1.0 and m.accepted_per_position == m.drafted_per_position == [3] * k
    run = llm.last_metrics
    assert run.acceptance_rate == 1.0 and run.per_position_acceptance == [1.0] * k
    assert run.mean_accepted_per_step == 1 + 3 * k / 4  # (k+1) per full step, then 1
    full = llm.generate([[5, 6, 7]], dataclasses.replace(params, max_tokens=2 * (k + 1)))
    assert llm.last_metrics.mean_accepted_per_step == k + 1
    same_outputs(full, llms("none").generate([[5, 6, 7]], dataclasses.replace(params, max_tokens=2 * (k + 1))))


def test_a_different_draft_is_sometimes_rejected(llms):
    """tiny_llama_draft has other weights: acceptance is below 1, and the counters still add up."""
    params = dataclasses.replace(GREEDY, max_tokens=24, ignore_eos=True)
    llm = llms("model", 4)
    outs = llm.generate([[5, 6, 7], [42, 43], [100]], params)
    run = llm.last_metrics
    assert 0 <= run.acceptance_rate < 1 and run.num_drafted > 0
    assert run.num_accepted + run.num_steps == run.num_generated == 3 * 24
    assert run.mean_accepted_per_step == pytest.approx(run.num_generated / run.num_steps)
    for out in outs:
        check_metrics(out, 4)


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True)


@settings(FIXED, max_examples=15)
@given(
    mine=prompts,
    others=st.lists(prompts, min_size=1, max_size=3),
    position=st.integers(0, 3),
    seed=st.integers(0, 2**31),
    drafter=st.sampled_from(["none", "model", "ngram", "adaptive", "eagle", "eagle+lookup"]),
    k=st.integers(1, 4),
)
def test_a_seeded_request_samples_the_same_tokens_in_any_batch(llms, mine, others, position, seed, drafter, k):
    """Sampling (T=0.8, top_p=0.9) with a seed: alone, or at any position among other requests
    (with their own seeds), the request emits the same tokens."""
    llm = llms(drafter, k)
    params = dataclasses.replace(SAMPLED, seed=seed)
    alone = llm.generate([mine], params)[0].token_ids
    position = min(position, len(others))
    batch = others[:position] + [mine] + others[position:]
    batch_params = [dataclasses.replace(SAMPLED, seed=seed + 1 + i) for i in range(len(batch))]
    batch_params[position] = params
    assert llm.generate(batch, batch_params)[position].token_ids == alone
