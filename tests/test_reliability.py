"""One LLM object that bad input, abandoned streams, threads and broken numbers cannot corrupt.

Invariants:
  * a call (generate / stream) owns its requests: other calls never see them; a stream that is
    paused keeps its requests running and gets every one of its tokens when resumed; one that is
    closed, abandoned or garbage-collected (started or not) takes its requests and pages with it;
  * a call queues all its requests or none;
  * concurrent calls from threads give each caller its own exact outputs and leak no page;
  * after every call: all KV pages free when nothing runs, a call stopped by a KeyboardInterrupt
    at any point (prefix caching on: admissions sharing cached pages) included;
  * a request whose target logits are not finite finishes with finish_reason "error" and a
    message, the rest of the batch is untouched; NaN in the draft only lowers acceptance;
  * values that underflow (temperature, top_p) never produce an id outside the vocabulary;
  * EOS is every end the checkpoint declares; drafts padded to another vocab_size work;
  * bad arguments and bad checkpoints raise errors naming the field and the value.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import threading

import pytest
import torch

from minispec import LLM, SamplingParams, load_checkpoint
from minispec.drafters import Drafter, Proposal

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the quick brown fox", "hello world", "to be or not to be, that is"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def sampled(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def interrupt_at(obj, name: str, call: int):
    """Make obj.name (an instance's or a class's) raise KeyboardInterrupt on its `call`-th call,
    counting from 1. Returns the undo, which puts back exactly what was there."""
    had, original, calls = name in vars(obj), getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return (lambda: setattr(obj, name, original)) if had else (lambda: delattr(obj, name))


def generate_interrupted(llm: LLM, prompts, params, obj, name: str, call: int) -> None:
    """llm.generate(prompts, params) with obj.name raising KeyboardInterrupt on its `call`-th call
    (interrupt_at, undone after): the interrupt must reach the caller."""
    undo = interrupt_at(obj, name, call)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params)
    finally:
        undo()


def idle_and_whole(llm: LLM) -> bool:
    """Nothing queued or running, and every page of every pool free."""
    return not llm.engine.has_unfinished() and all(
        r.cache.allocator.num_free == r.cache.num_pages for r, _ in llm.engine.runners)


@pytest.fixture(scope="module")
def spec(tiny_llama, tiny_llama_draft) -> LLM:
    return LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def solo(spec):
    """Each request alone: greedy PROMPTS, then PROMPTS sampled with seeds 0, 1, 2."""
    greedy = [spec.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    seeded = [spec.generate([p], sampled(i))[0].token_ids for i, p in enumerate(PROMPTS)]
    return greedy, seeded


def collect(events, n: int):
    tokens, finished = [[] for _ in range(n)], [0] * n
    for e in events:
        tokens[e.index] += e.new_token_ids
        finished[e.index] += e.finished
    return tokens, finished


# --- calls own their requests -----------------------------------------------------------------


def test_a_stream_never_started_holds_nothing(spec, solo):
    """Used to queue at call time: the next generate ran the orphan too and failed (KeyError)."""
    stream = spec.stream(PROMPTS, GREEDY)
    assert idle_and_whole(spec)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == solo[0]
    del stream
    gc.collect()
    assert idle_and_whole(spec)


def test_a_paused_stream_loses_nothing_to_a_generate_in_between(spec, solo):
    """Paused after two events, then a generate: both get exactly their solo outputs, the stream
    still reports each request finished once, and no page is left behind."""
    stream = spec.stream(PROMPTS, [sampled(i) for i in range(3)])
    first = [next(stream), next(stream)]
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == solo[0]
    tokens, finished = collect(first + list(stream), 3)
    assert tokens == solo[1] and finished == [1, 1, 1]
    assert idle_and_whole(spec)


def test_interleaved_streams_and_a_generate_inside_a_stream_loop(spec, solo):
    a = spec.stream(PROMPTS, GREEDY)
    b = spec.stream(PROMPTS, [sampled(i) for i in range(3)])
    events_a, events_b, inner = [next(a)], [next(b)], None
    for ea in a:  # alternate: one event of a, one of b, a generate inside the loop once
        events_a.append(ea)
        events_b.append(next(b, None))
        if inner is None:
            inner = spec.generate(PROMPTS[:1], sampled(0))[0].token_ids
    events_b = [e for e in events_b if e is not None] + list(b)
    assert collect(events_a, 3) == (solo[0], [1, 1, 1])
    assert collect(events_b, 3) == (solo[1], [1, 1, 1])
    assert inner == solo[1][0]
    assert idle_and_whole(spec)


@pytest.mark.parametrize("how", ["close", "del", "break"])
def test_an_abandoned_stream_frees_its_requests_and_pages(spec, solo, how):
    stream = spec.stream(PROMPTS, GREEDY)
    if how == "break":
        for _ in stream:
            break
    else:
        next(stream)
    if how == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert idle_and_whole(spec)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == solo[0]


def test_stream_text_is_the_generated_text_cut_at_the_stop_string(spec):
    """StreamEvent.new_text, concatenated, is generate's text: a stop string never leaks out."""
    full = spec.generate(PROMPTS, GREEDY)
    stops = [o.text[3:6] for o in full if len(o.text.strip()) > 6]
    assert stops, "the tiny model produced no text to stop in"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stops)
    expected = [o.text for o in spec.generate(PROMPTS, params)]
    texts = ["", "", ""]
    for e in spec.stream(PROMPTS, params):
        texts[e.index] += e.new_text
        assert not any(s in texts[e.index] for s in stops)
    assert texts == expected
    assert any(o.finish_reason == "stop" for o in spec.generate(PROMPTS, params))


# --- all or nothing ---------------------------------------------------------------------------


def test_a_seed_torch_cannot_take_is_refused_before_anything_is_queued(spec, solo):
    """seed=2**70 used to pass validation and overflow in Sequence() after earlier prompts of
    the same call were queued."""
    with pytest.raises(ValueError, match=r"^seed"):
        SamplingParams(seed=2**70)
    bad = SamplingParams(max_tokens=4)
    bad.seed = 2**70  # changed after construction: checked again when queued
    with pytest.raises(ValueError, match=r"^seed"):
        spec.generate(PROMPTS, [GREEDY, GREEDY, bad])
    assert idle_and_whole(spec)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == solo[0]


def test_fields_changed_after_construction_are_validated(spec):
    """temperature=-1 set after construction used to sample the inverted distribution."""
    params = SamplingParams(temperature=0.5, max_tokens=4)
    params.temperature = -1.0
    with pytest.raises(ValueError, match=r"^temperature"):
        spec.generate(PROMPTS[:1], params)
    assert idle_and_whole(spec)


# --- threads ------------------------------------------------------------------------------------


def test_threads_sharing_one_llm_get_their_own_exact_outputs(spec, solo):
    """Used to raise random internal errors, return wrong outputs and leak pages."""
    results, errors = {}, []

    def worker(t: int) -> None:
        try:
            for rep in range(2):
                if t % 2:
                    results[(t, rep)] = [o.token_ids for o in spec.generate(PROMPTS, [sampled(i) for i in range(3)])]
                else:
                    results[(t, rep)] = collect(spec.stream(PROMPTS, GREEDY), 3)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert len(results) == 8
    for (t, _), tokens in results.items():
        assert tokens == (solo[1] if t % 2 else solo[0])
    assert idle_and_whole(spec)


def fail_once(owner, name: str) -> None:
    """owner.name raises RuntimeError("device lost") at its next call, then is itself again."""
    original = getattr(owner, name)

    def broken(*args, **kwargs):
        setattr(owner, name, original)
        raise RuntimeError("device lost")

    setattr(owner, name, broken)


def test_a_failing_engine_step_ends_every_request_and_leaves_the_llm_usable(spec, solo):
    """An exception inside a step (a bug, a device error) re-raises in the caller; every request
    in the engine, the caller's and a paused stream's, ends with finish_reason "error" (the
    engine's state is not trusted after it); pages are free and the next call is exact."""
    paused = spec.stream(PROMPTS[:1], GREEDY)
    next(paused)
    fail_once(spec.engine, "step")
    with pytest.raises(RuntimeError, match="device lost"):
        spec.generate(PROMPTS[1:], GREEDY)
    assert idle_and_whole(spec)
    rest = list(paused)
    assert rest[-1].finished and rest[-1].finish_reason == "error" and "device lost" in rest[-1].error
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == solo[0]


@pytest.fixture(scope="module")
def cached(tiny_llama, tiny_llama_draft) -> LLM:
    """A speculative LLM with prefix caching, pages of 4 tokens, and the (greedy) requests of
    CACHED_PROMPTS run once, so that their pages are cached and the next call shares them."""
    llm = LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, page_size=4,
              enable_prefix_caching=True, kv_cache_gib=0.01)
    llm.generate(CACHED_PROMPTS, GREEDY)
    return llm


CACHED_PROMPTS = ["the quick brown fox jumps over the lazy dog, " * 2 + end for end in ("hello", "to be or not", "x")]


def no_page_held(llm: LLM) -> bool:
    """idle_and_whole, and no reference left on any (prefix-cached) page."""
    return idle_and_whole(llm) and not any(any(r.cache.allocator.refs) for r, _ in llm.engine.runners)


def test_an_interrupted_admission_leaks_no_cached_page(cached):
    """A KeyboardInterrupt while a request is given its cached pages (between two of them): once
    idle, every page is free or evictable again and the next call is exact. Used to leak: the
    pages' reference counts were raised before the block table held them, so aborting the request
    did not release them (a probe found 8 pages held by an idle engine after 79 interrupts)."""
    expected = [o.token_ids for o in cached.generate(CACHED_PROMPTS, GREEDY)]
    generate_interrupted(cached, CACHED_PROMPTS, GREEDY, cached.engine.runners[0][0].cache.allocator, "share", 2)
    assert no_page_held(cached)
    assert [o.token_ids for o in cached.generate(CACHED_PROMPTS, GREEDY)] == expected


def test_an_interrupt_at_points_all_through_a_call_leaks_no_page(cached):
    """KeyboardInterrupts before every 509th instruction the scheduler, the block tables and the
    prefix cache execute in a call (one interrupt a call, the same LLM throughout: admissions
    sharing cached pages, reservations, rollbacks, commits, finishes): after each, once idle, no
    page is held. The unit tests (test_kv_cache.py, test_prefix_cache.py) try every instruction
    of each operation."""
    import minispec.core.kv_cache as kv_cache
    import minispec.core.scheduler as scheduler
    import minispec.runtime.prefix_cache as prefix_cache
    from interrupts import interrupted

    n = 1
    while interrupted(lambda: cached.generate(CACHED_PROMPTS, GREEDY), n, scheduler, kv_cache, prefix_cache):
        assert no_page_held(cached), f"pages held after an interrupt before instruction {n}"
        n += 509
    assert no_page_held(cached) and n > 5000


def test_a_stream_that_ends_in_an_engine_failure_sends_the_text_it_held_back(spec):
    """A stream holds back what may be a stop string's start; a request that ended with "error"
    used to end its stream without it, so the deltas did not add up to the request's text."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["#" * 40])  # holds back 39 chars
    paused = spec.stream(PROMPTS[:1], params)
    events = [next(paused) for _ in range(3)]
    fail_once(spec.engine, "step")
    with pytest.raises(RuntimeError, match="device lost"):
        spec.generate(PROMPTS[1:], GREEDY)
    events += list(paused)
    tokens = [t for e in events for t in e.new_token_ids]
    assert events[-1].finish_reason == "error" and tokens
    assert "".join(e.new_text for e in events) == spec.tokenizer.decode_after(spec.tokenizer.encode(PROMPTS[0]), tokens)
    assert idle_and_whole(spec)


def test_the_error_events_text_covers_the_tokens_it_reported(tiny_llama):
    """A step that fails after emitting (here in the drafter's rollback) leaves tokens the stream
    never reported; the error event's text covered them too ('\ufffd,\ufffd' for ids whose text is
    '\ufffd,'): it is the held-back text of the reported tokens only."""
    llm = LLM(model=tiny_llama, draft_model="ngram", num_speculative_tokens=3, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["#" * 40])
    paused = llm.stream(["hello world"], params)
    events = [next(paused) for _ in range(2)]
    fail_once(llm.engine.drafter, "rollback")
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["x y"], params)
    events += list(paused)
    ids = [t for e in events for t in e.new_token_ids]
    assert events[-1].finish_reason == "error"
    assert "".join(e.new_text for e in events) == llm.tokenizer.decode_after(llm.tokenizer.encode("hello world"), ids)
    assert idle_and_whole(llm)


# --- numbers that break -------------------------------------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=1e-50), dict(temperature=1e-6), dict(temperature=0.8, top_p=1e-50)])
def test_underflowing_temperature_and_top_p_are_greedy(spec, solo, params):
    """temperature=1e-50 is 0 in fp32 (max_tokens=1 returned id == vocab_size, longer runs an
    IndexError); top_p=1e-50 raised 'index -1 is out of bounds'. Both limits are the argmax."""
    outs = spec.generate(PROMPTS, SamplingParams(**params, max_tokens=12, ignore_eos=True, seed=0))
    assert [o.token_ids for o in outs] == solo[0]


def nan_embedding_target(path, token: int):
    """The tiny target with one embedding row set to NaN: prompts containing `token` get NaN logits."""
    model, tok = load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")
    with torch.no_grad():
        model.embed_tokens.weight[token] = float("nan")
    return model, tok


@pytest.mark.parametrize("draft", [None, "ngram", "model", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_request_with_non_finite_target_logits_fails_alone(tiny_llama, tiny_llama_draft, tiny_llama_eagle, draft,
                                                             temperature):
    """The poisoned request finishes with finish_reason "error" and a message; the others (and a
    request run later on the freed pages) equal their outputs on a healthy target. "tree": the
    EAGLE head drafting trees (speculative_tree.py)."""
    drafter = dict(draft_model={"model": str(tiny_llama_draft), "ngram": "ngram", "tree": str(tiny_llama_eagle), None: None}[draft],
                   num_speculative_tokens=3 if draft else None, kv_cache_gib=0.01,
                   **({"draft_tree_budget": 6, "draft_tree_top_k": 3} if draft == "tree" else {}))
    healthy = LLM(model=tiny_llama, **drafter)
    ids = [healthy.tokenizer.encode(p) for p in PROMPTS]
    poison = 7
    assert all(poison not in i for i in ids)
    params = SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, seed=1)
    expected = [o.token_ids for o in healthy.generate(ids, params)]
    llm = LLM(model=nan_embedding_target(tiny_llama, poison), **drafter)
    outs = llm.generate([ids[0], ids[1] + [poison], ids[2]], params)
    assert outs[1].finish_reason == "error" and "not finite" in outs[1].error and outs[1].token_ids == []
    assert outs[1].metrics.finish_s is None and outs[0].metrics.finish_s is not None  # a failed request has no TPOT
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(ids, params)] == expected  # pages that held NaN, reused


class ProposeAlways(Drafter):
    """A drafter that always proposes the same tokens (one-hot q, like the n-gram drafter)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, seqs, num_draft):
        return Proposal([self.tokens[:n] for n in num_draft])


class ScriptedTarget:
    """A stand-in target runner: row 0 of every verification prefers token `best`; every later
    row (a context containing the first draft) is NaN when `nan_after_draft`."""

    def __init__(self, vocab: int, best: int, nan_after_draft: bool):
        from minispec.runtime.kv_cache import PageAllocator
        from minispec.runtime.transfers import Staging

        self.vocab, self.best, self.nan_after_draft = vocab, best, nan_after_draft
        self.vocab_size = vocab
        self.device = torch.device("cpu")
        self.cache = type("Cache", (), {"allocator": PageAllocator(64)})()
        self.staging = Staging(self.device)

    def prepare(self, feeds, upload):
        return feeds  # (nothing to lay out: the rows below depend on the feeds alone)

    def run(self, feeds, drawn=None, **kwargs):
        return self.forward(feeds)

    def forward(self, feeds, upload=None, **kwargs):
        if upload is not None:  # what the step sends with the forward's metadata
            self.staging.send(upload)
        rows = []
        for f in feeds:
            f.table.num_cached += len(f.tokens)
            for j in range(f.num_logits):
                row = torch.full((self.vocab,), -5.0)
                row[self.best] = 5.0
                rows.append(row if j == 0 or not self.nan_after_draft else torch.full((self.vocab,), float("nan")))
        return torch.stack(rows)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_rows_past_the_first_rejection_change_nothing(temperature):
    """Row r of a verification is used only if the first r drafts are accepted. Here row 0 gives
    the draft (token 9) probability ~e^-10 and every later row is NaN: the draft is rejected at
    row 0 and the NaN rows are never used, so the request goes on exactly like plain decoding (it
    used to end with "error": any non-finite verified row failed it). When the draft IS accepted
    (the target prefers 9 too), the next token would come from a NaN row: the request emits the
    accepted draft and ends there with "error", as plain decoding would after sampling 9."""
    from minispec.runtime.sequence import Sequence
    from minispec.runtime.metrics import StepTimes
    from minispec.speculative import StepResult, speculative_step

    def run(best: int):
        seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=temperature, max_tokens=5, seed=0, ignore_eos=True), 16)
        target = ScriptedTarget(vocab=32, best=best, nan_after_draft=True)
        verdicts = speculative_step([seq], target, ProposeAlways([9, 9, 9]), 3,
                                    lambda s, t: s.append(t, [], None), StepTimes())
        return seq, verdicts

    seq, verdicts = run(best=4)
    assert seq.finish_reason is None and seq.output_ids == [4]  # (at 0.8, p(4) = 0.9986 and the seed is fixed)
    assert verdicts == [StepResult([9], 0, 1)]  # the drafts past the first non-finite row were dropped
    seq, verdicts = run(best=9)
    assert seq.output_ids == [9] and seq.finish_reason == "error" and "position 4" in seq.error
    assert verdicts == [StepResult([9], 1, 1)]


def nan_draft(path):
    model, tok = load_checkpoint(path, dtype=torch.float32, device="cpu", backend="torch")
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return model, tok


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_nan_draft_only_lowers_acceptance(tiny_llama, tiny_llama_draft, temperature):
    """Sampled requests used to crash (the draft sampled id == vocab_size). Now the broken draft
    proposes nothing (its draws, keyed by position, take nothing from later ones): the output is
    plain decoding's, token for token (seeded)."""
    plain = LLM(model=tiny_llama, kv_cache_gib=0.01)
    llm = LLM(model=tiny_llama, draft_model=nan_draft(tiny_llama_draft), num_speculative_tokens=3, kv_cache_gib=0.01)
    params = [SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, seed=i) for i in range(3)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert llm.last_metrics.num_drafted == 0
    assert idle_and_whole(llm)


# --- checkpoints: EOS, padded vocabularies, the draft's context -----------------------------------


def test_eos_is_every_end_the_checkpoint_declares(tiny_llama, tmp_path):
    """config.json says 1, generation_config.json [1, 146]: used to stop at 1 only."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 146]}))
    llm = LLM(model=str(path), kv_cache_gib=0.01)
    assert sorted(llm.engine.eos_ids) == [1, 146]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = out.token_ids[2]  # make the third greedy token an end token
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at]}))
    out2 = LLM(model=str(path), kv_cache_gib=0.01).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))[0]
    first = out.token_ids.index(stop_at)
    assert (out2.finish_reason, out2.outputs[0].stop_reason) == ("stop", None) and out2.token_ids == out.token_ids[: first + 1]


def test_an_end_token_beside_the_tokenizers_eos_is_reported_as_a_stop_token(tiny_llama, tmp_path):
    """vLLM moves generation_config.json's end ids other than the tokenizer's EOS into
    stop_token_ids: a request they end has stop_reason the id (it used to say None, as for EOS)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    out = LLM(model=str(path), kv_cache_gib=0.01).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = out.token_ids[2]
    first = out.token_ids.index(stop_at)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))  # id 1
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_at, 1]}))
    llm = LLM(model=str(path), kv_cache_gib=0.01)
    assert llm.engine.eos_ids == [1, stop_at]  # the tokenizer's EOS first
    ended = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))[0]
    assert (ended.finish_reason, ended.outputs[0].stop_reason) == ("stop", stop_at)
    assert ended.token_ids == out.token_ids[: first + 1] and ended.text == llm.tokenizer.decode(out.token_ids[:first])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": llm.tokenizer.tok.id_to_token(stop_at)}))
    ended = LLM(model=str(path), kv_cache_gib=0.01).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))[0]
    assert (ended.finish_reason, ended.outputs[0].stop_reason) == ("stop", None)  # the tokenizer's own EOS


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draft_padded_to_another_vocab_size_drafts(tiny_llama, checkpoint_factory, temperature):
    """Same tokenizer, embedding padded past it (Qwen2.5-0.5B vs -7B): used to be refused."""
    padded = checkpoint_factory("llama", seed=1, num_hidden_layers=1, vocab_size=384)
    plain = LLM(model=tiny_llama, kv_cache_gib=0.01)
    llm = LLM(model=tiny_llama, draft_model=padded, num_speculative_tokens=3, kv_cache_gib=0.01)
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=0)
    outs = llm.generate(PROMPTS, params)
    assert llm.last_metrics.num_drafted > 0
    assert all(max(o.token_ids) < 320 for o in outs)
    if temperature == 0:
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_the_draft_models_context_limit_is_respected(tiny_llama, checkpoint_factory):
    """A draft with max_position_embeddings 24 under a 512-token target: drafting stops where the
    draft's RoPE range ends (it used to read past it), generation goes on, output unchanged."""
    short = checkpoint_factory("llama", seed=1, num_hidden_layers=1, max_position_embeddings=24)
    plain = LLM(model=tiny_llama, kv_cache_gib=0.01)
    llm = LLM(model=tiny_llama, draft_model=short, num_speculative_tokens=4, kv_cache_gib=0.01)
    runner, fed = llm.engine.drafter.runner, []
    prepare = runner.prepare  # (every forward's host half: a step's and a prompt's)

    def recording_prepare(feeds, upload):
        fed.extend(f.table.num_cached + len(f.tokens) for f in feeds)  # positions used: < this
        return prepare(feeds, upload)

    runner.prepare = recording_prepare
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == plain.generate([prompt], params)[0].token_ids
    assert llm.last_metrics.num_drafted > 0 and len(out.token_ids) == 30
    assert max(fed) == 24  # drafted up to the draft's last position, never past it


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_cache_gib=math.nan), "kv_cache_gib"),
        (dict(kv_cache_gib=math.inf), "kv_cache_gib"),
        (dict(page_size=16.0), "page_size"),
        (dict(page_size=True), "page_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(dtype="float64"), "dtype"),
        (dict(draft_model="ngram", num_speculative_tokens=True), "num_speculative_tokens"),
    ],
)
def test_bad_constructor_arguments_are_named(tiny_llama, kwargs, message):
    """float64 used to pass construction and fail at the first generate; NaN / inf budgets,
    float page sizes, a zero max_model_len and bool k slipped through or failed deep."""
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, **{"kv_cache_gib": 0.01, **kwargs})


@pytest.mark.parametrize("field, value", [("ignore_eos", "no"), ("seed", 2**64), ("seed", -(2**63) - 1),
                                          ("temperature", True), ("stop", 5)])
def test_more_sampling_params_are_checked(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize("prompts, error", [
    (5, TypeError), (None, TypeError), (b"hello", TypeError), ([b"hello"], TypeError),
    ([[True, False]], ValueError), ([[1.0, 2.0]], ValueError), ([{"text": "hi"}], ValueError),
    (torch.tensor([5, 6]), TypeError), ([torch.tensor([5, 6])], TypeError),
])
def test_bad_prompt_types_are_named(spec, prompts, error):
    """bytes and bools used to be taken as token ids; ints, None and tensors failed obscurely."""
    with pytest.raises(error, match="prompt"):
        spec.generate(prompts, GREEDY)
    assert idle_and_whole(spec)


def test_prompt_forms_vllm_users_pass(spec, solo):
    """vLLM prompt dicts, a generator of prompts and numpy integer ids all work."""
    import numpy as np

    ids = [spec.tokenizer.encode(p) for p in PROMPTS]
    forms = [
        [{"prompt": p} for p in PROMPTS],
        [{"prompt_token_ids": i} for i in ids],
        (p for p in PROMPTS),
        [list(np.array(i)) for i in ids],
    ]
    for prompts in forms:
        assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == solo[0]
    assert [o.prompt for o in spec.generate(forms[0], GREEDY)] == PROMPTS


def test_truncated_gguf_is_named(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import random_hf_state, train_tokenizer, write_gguf

    tok = train_tokenizer()
    path = write_gguf(tmp_path / "a.gguf", "llama", random_hf_state("llama", tok.get_vocab_size(), tied=True), tok)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 20, 0):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            load_checkpoint(bad)


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size="320"), "vocab_size"),
    (dict(max_position_embeddings=None), "max_position_embeddings"),
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear"}), "factor"),
    (dict(eos_token_id="</s>"), "eos_token_id"),
    (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
])
def test_bad_config_values_are_named(tiny_llama, tmp_path, change, message):
    """A string vocab_size, a null max_position_embeddings, llama3 RoPE without its factors used
    to fail with TypeError / KeyError deep inside."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


# --- everything at once: a stateful test --------------------------------------------------------


def test_random_interleavings_of_calls_keep_the_llm_whole(tiny_llama, tiny_llama_draft):
    """Hypothesis drives one speculative LLM, whose KV pools hold only a few requests at once
    (so steps preempt), through random interleavings of generate, streams consumed in part,
    resumed, finished or abandoned, invalid requests, SamplingParams changed after their call
    was made, and KeyboardInterrupts injected at random points of a step. After every step: when
    no stream is open, nothing is queued and every page is free; every request that finished
    (greedy or seeded) got exactly the tokens it gets alone on a roomy LLM, and one ended by an
    interrupt ("error") got a prefix of them; only documented errors are raised."""
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        invariant,
        precondition,
        rule,
        run_state_machine_as_test,
    )

    from minispec.runtime.kv_cache import KVCache

    page_size = 4
    models = [load_checkpoint(p, dtype=torch.float32, device="cpu", backend="torch") for p in (tiny_llama, tiny_llama_draft)]
    per_page = sum(KVCache.bytes_per_page(m.cfg, page_size, torch.float32) for m, _ in models)
    llm = LLM(model=models[0], draft_model=models[1], num_speculative_tokens=3, page_size=page_size,
              kv_cache_gib=13 * per_page / 2**30)  # 12 pages a pool (+ scratch): a 24-token request takes 6
    ref = LLM(model=models[0], draft_model=models[1], num_speculative_tokens=3, kv_cache_gib=0.01)
    solo: dict = {}

    def alone(prompt: int, seed: int | None, max_tokens: int) -> list[int]:
        key = (prompt, seed, max_tokens)
        if key not in solo:
            solo[key] = ref.generate([PROMPTS[prompt]], params_for(seed, max_tokens))[0].token_ids
        return solo[key]

    def params_for(seed: int | None, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0 if seed is None else 0.9, max_tokens=max_tokens, ignore_eos=True, seed=seed)

    requests = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, 0, 1]), st.sampled_from([5, 16])),
                        min_size=1, max_size=3)

    class Interleavings(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.streams: list[list] = []  # [generator, requests, events so far]

        def check(self, reqs, events):
            tokens, finished = collect(events, len(reqs))
            errors = {e.index for e in events if e.finished and e.finish_reason == "error"}
            assert finished == [1] * len(reqs)
            for i, r in enumerate(reqs):
                if i in errors:  # ended by an interrupt: what it got is exact as far as it goes
                    assert tokens[i] == alone(*r)[: len(tokens[i])]
                else:
                    assert tokens[i] == alone(*r)

        @rule(reqs=requests)
        def generate(self, reqs):
            outs = llm.generate([PROMPTS[p] for p, _, _ in reqs], [params_for(s, m) for _, s, m in reqs])
            assert [o.token_ids for o in outs] == [alone(*r) for r in reqs]

        @rule(reqs=requests, take=st.integers(0, 3))
        def open_stream(self, reqs, take):
            g = llm.stream([PROMPTS[p] for p, _, _ in reqs], [params_for(s, m) for _, s, m in reqs])
            events = [e for e in (next(g, None) for _ in range(take)) if e is not None]
            self.streams.append([g, reqs, events])

        @precondition(lambda self: self.streams)
        @rule(i=st.integers(0, 9), take=st.integers(1, 4))
        def advance_stream(self, i, take):
            g, _, events = self.streams[i % len(self.streams)]
            events += [e for e in (next(g, None) for _ in range(take)) if e is not None]

        @precondition(lambda self: self.streams)
        @rule(i=st.integers(0, 9))
        def finish_stream(self, i):
            g, reqs, events = self.streams.pop(i % len(self.streams))
            self.check(reqs, events + list(g))

        @rule(reqs=requests, take=st.integers(0, 2))
        def change_params_after_the_call(self, reqs, take):
            """The caller's SamplingParams objects, changed after stream(): the call keeps its own."""
            params = [params_for(s, m) for _, s, m in reqs]
            g = llm.stream([PROMPTS[p] for p, _, _ in reqs], params)
            for p in params:
                p.max_tokens, p.temperature, p.seed, p.stop = 3, 1.5, 99, ["a"]
            events = [e for e in (next(g, None) for _ in range(take)) if e is not None]
            self.streams.append([g, reqs, events])

        @rule(reqs=requests, point=st.sampled_from(["stage", "prepare", "run_staged", "run", "emit", "rollback"]),
              call=st.integers(1, 3))
        def interrupt_a_step(self, reqs, point, call):
            """A KeyboardInterrupt at the call-th call of one point of the engine's step (laying out the
            drafts or a target forward, drafting, in the target's forward, between emitted tokens,
            before the drafter's roll-back)."""
            owner = {"stage": llm.engine.drafter, "run_staged": llm.engine.drafter, "rollback": llm.engine.drafter,
                     "prepare": llm.engine.target, "run": llm.engine.target, "emit": llm.engine}[point]
            undo = interrupt_at(owner, "_emit" if point == "emit" else point, call)
            try:
                outs = llm.generate([PROMPTS[p] for p, _, _ in reqs], [params_for(s, m) for _, s, m in reqs])
                assert [o.token_ids for o in outs] == [alone(*r) for r in reqs]  # the point came too late
            except KeyboardInterrupt:
                pass
            finally:
                undo()

        @precondition(lambda self: self.streams)
        @rule(i=st.integers(0, 9), close=st.booleans())
        def abandon_stream(self, i, close):
            g = self.streams.pop(i % len(self.streams))[0]
            if close:
                g.close()
            del g
            gc.collect()

        @rule(bad=st.sampled_from(["seed", "prompt", "length", "type"]))
        def invalid_request(self, bad):
            params = SamplingParams(max_tokens=4)
            prompts = list(PROMPTS)
            if bad == "seed":
                params.seed = 2**70
            elif bad == "prompt":
                prompts[1] = [5, 10_000]
            elif bad == "length":
                params.max_tokens = 600
            else:
                prompts[2] = b"bytes"
            with pytest.raises((ValueError, TypeError)):
                llm.generate(prompts, params)

        @invariant()
        def whole_when_idle(self):
            if not self.streams:
                assert idle_and_whole(llm)

        def teardown(self):
            for g, _, _ in self.streams:
                g.close()
            self.streams.clear()
            assert idle_and_whole(llm)

    run_state_machine_as_test(Interleavings, settings=settings(max_examples=25, stateful_step_count=8, deadline=None,
                                                               derandomize=True))
    assert llm.engine.scheduler.num_preemptions > 0  # the small pools did force preemptions
