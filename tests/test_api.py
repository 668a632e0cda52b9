"""The public API: `SamplingParams` validation, `LLM` input checks, and what `generate` and
`stream` return.

Invariants:
  * every out-of-range sampling option raises ValueError naming the option;
  * requests that can never run (too long for the context, token ids outside the vocabulary) and
    a draft model whose tokenizer is not the target's are refused up front, not mid-generation;
  * `text` is the decoding of `token_ids` (cut before a matched stop string); `finish_reason` says
    which of max_tokens ("length"), EOS ("stop", stop_reason None) or a stop string ("stop", stop_reason
    the string) ended the request, and
    generation ends at the token that triggered it;
  * a seed makes sampling reproducible, independently of the other requests in the batch;
  * `stream` yields exactly the tokens `generate` returns; top_k=1 (and a tiny top_p) is greedy.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

import minispec
from minispec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["the quick brown fox", "hello world", "to be or not to be, that is"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=tiny_llama, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def greedy_outputs(llm):
    """Greedy references for PROMPTS (16 tokens each, EOS ignored)."""
    return llm.generate(PROMPTS, GREEDY)


# --- SamplingParams -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 1.5),
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("seed", "42"),
        ("seed", True),
        ("top_p", "0.9"),
        ("max_tokens", True),
        ("logprobs", -1),
        ("logprobs", 2.0),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_documented_ranges():
    """Boundaries that are valid: greedy, top_p 1, top_k 0 / -1 (off), a single stop string."""
    assert SamplingParams(temperature=0).greedy
    for kwargs in [dict(top_p=1.0), dict(top_k=0), dict(top_k=-1), dict(top_k=1), dict(max_tokens=1), dict(seed=0),
                   dict(logprobs=0), dict(logprobs=20)]:
        SamplingParams(**kwargs)
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_sampling_params_defaults_are_vllms():
    """Code written for vLLM that leaves an option out gets what vLLM would give it (max_tokens
    used to default to 64, four times vLLM's 16)."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (1, 1.0, 1.0, 0, 16, 0, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.ignore_eos) == (1.0, 0.0, 0.0, False)


# --- LLM input errors ---------------------------------------------------------------------------


def test_prompt_longer_than_the_context_is_refused(llm, tiny_llama):
    """tiny_llama has max_position_embeddings 512; max_model_len lowers the limit further."""
    with pytest.raises(ValueError, match="context length 512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="context length 512"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=20))  # prompt + max_tokens counts
    short = LLM(model=tiny_llama, kv_cache_gib=0.01, max_model_len=32)
    with pytest.raises(ValueError, match="context length 32"):
        short.generate([[5] * 30], SamplingParams(max_tokens=8))


def test_a_bad_request_queues_nothing(llm):
    """Validation happens for the whole batch before any request is queued."""
    with pytest.raises(ValueError):
        llm.generate(["hello", [5] * 600], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()
    assert llm.generate(["hello"], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [[0, 1, 320], [-1], [3, 99999]])
def test_token_ids_outside_the_vocabulary_are_refused(llm, bad):
    assert llm.engine.target.model.cfg.vocab_size == 320
    with pytest.raises(ValueError, match=r"token ids.*\[0, 320\)"):
        llm.generate([bad], GREEDY)


def train_other_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE of the same size as the fixtures' but trained on other text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["the quick brown fox jumps over the lazy dog."[::-1], "hello world, this is a test."[::-1]] * 4
    text += ["speculative decoding drafts tokens and the target verifies them."[::-1]] * 4
    text += ["def add(a, b): return a + b"[::-1], "to be or not to be, that is the question."[::-1]] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))


def test_draft_with_a_different_tokenizer_is_refused(tiny_llama, tiny_llama_draft, tmp_path):
    """Same vocab size, different trained vocabulary: p and q would index different tokens."""
    draft = Path(shutil.copytree(tiny_llama_draft, tmp_path / "draft"))
    train_other_tokenizer(draft, 320)
    assert minispec.load_checkpoint(draft, backend="torch")[1].vocab_size == 320  # same size, other tokens
    with pytest.raises(ValueError, match="draft tokenizer differs"):
        LLM(model=tiny_llama, draft_model=draft, kv_cache_gib=0.01)


def test_draft_with_a_different_vocab_size_is_refused(tiny_llama, checkpoint_factory):
    draft = checkpoint_factory("llama", seed=1, num_hidden_layers=1, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300.*tokenizer"):
        LLM(model=tiny_llama, draft_model=draft, kv_cache_gib=0.01)


@pytest.mark.parametrize("k", [0, -1, 33, 2.5])
def test_num_speculative_tokens_out_of_range(tiny_llama, k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=tiny_llama, draft_model="ngram", num_speculative_tokens=k, kv_cache_gib=0.01)


@pytest.mark.parametrize("draft,threshold,message", [
    ("ngram", 0.5, "needs a draft model"),
    (None, 0.5, "needs a draft model"),
    ("model", 0.0, r"in \(0, 1\)"),
    ("model", 1.0, r"in \(0, 1\)"),
])
def test_draft_confidence_threshold_is_checked(tiny_llama, tiny_llama_draft, draft, threshold, message):
    draft = tiny_llama_draft if draft == "model" else draft
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, draft_model=draft, draft_confidence_threshold=threshold, kv_cache_gib=0.01)


@pytest.mark.parametrize("draft,value,message", [
    ("ngram", 2, "prompt_lookup_min puts prompt lookup in front of a draft model"),
    (None, 2, "prompt_lookup_min puts prompt lookup in front of a draft model"),
    ("model", 0, "prompt_lookup_min"),
    ("model", 1.5, "prompt_lookup_min"),
    ("model", True, "prompt_lookup_min"),
])
def test_prompt_lookup_min_is_checked(tiny_llama, tiny_llama_draft, draft, value, message):
    draft = tiny_llama_draft if draft == "model" else draft
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama, draft_model=draft, prompt_lookup_min=value, kv_cache_gib=0.01)


# --- outputs ------------------------------------------------------------------------------------


def test_outputs_in_prompt_order_with_text_decoding_token_ids(llm, greedy_outputs):
    for i, (prompt, out) in enumerate(zip(PROMPTS, greedy_outputs)):
        assert out.prompt == prompt and out.finished and out.outputs[0].index == 0  # the first (only) completion
        assert int(out.request_id) == int(greedy_outputs[0].request_id) + i  # submitted in prompt order
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 16 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_token_id_prompts_equal_text_prompts(llm, greedy_outputs):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(ids, GREEDY)] == [o.token_ids for o in greedy_outputs]
    assert llm.generate(ids[0], GREEDY)[0].token_ids == greedy_outputs[0].token_ids  # one prompt, not a list


def test_eos_ends_generation_with_finish_reason_stop(tiny_llama, greedy_outputs):
    """Declare the 4th greedy token EOS: generation stops at its first occurrence, EOS included."""
    model, tok = minispec.load_checkpoint(tiny_llama, dtype="float32", backend="torch")
    reference = greedy_outputs[0].token_ids
    eos = reference[3]
    model.cfg.eos_token_ids = [eos]
    llm = LLM(model=(model, tok), kv_cache_gib=0.01)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason is None  # vLLM's spelling of "EOS"
    assert out.token_ids == reference[: reference.index(eos) + 1]
    # ignore_eos keeps going past it
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == reference


def first_completion(llm, tokens: list[int], stop: str) -> int:
    """Number of tokens after which the decoded text first contains `stop`."""
    return next(n for n in range(1, len(tokens) + 1) if stop in llm.tokenizer.decode(tokens[:n]))


def test_stop_string_ends_generation_and_is_cut_from_the_text(llm, greedy_outputs):
    """A stop string straddling two tokens: generation stops at the token completing it, the
    text ends just before it, and finish_reason is "stop"."""
    reference = greedy_outputs[2].token_ids
    pieces = [llm.tokenizer.decode(reference[:n]) for n in range(len(reference) + 1)]
    # a 3-character stop string that begins in token 6's text and ends in a later token's
    n = next(n for n in range(6, len(reference)) if len(pieces[n]) - len(pieces[n - 1]) >= 1 and pieces[n][-1].isascii())
    start = len(pieces[n]) - 1
    stop = pieces[-1][start : start + 3]
    assert len(stop) == 3 and stop not in pieces[n], "the chosen stop string must straddle a token boundary"
    end = first_completion(llm, reference, stop)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[:end]
    assert stop not in out.text
    full = llm.tokenizer.decode(reference[:end])
    assert out.text == full[: full.find(stop)]


def test_the_earliest_of_several_stop_strings_wins(llm, greedy_outputs):
    reference = greedy_outputs[1].token_ids
    text = llm.tokenizer.decode(reference)
    start = next(i for i in range(2, len(text)) if text[i : i + 2].isascii() and text[i : i + 2].isprintable())
    early, late = text[start : start + 2], text[-3:]
    assert first_completion(llm, reference, early) < first_completion(llm, reference, late)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[late, early]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[: first_completion(llm, reference, early)]
    assert early not in out.text and late not in out.text


SAMPLED = dict(temperature=1.0, max_tokens=16, ignore_eos=True)


def test_seed_makes_sampling_reproducible_and_batch_independent(llm):
    """Same seed -> same tokens, alone or batched with other requests; different seeds differ.

    Random-init logits are nearly uniform over 320 tokens, so two seeds agreeing on all 16
    sampled tokens has probability about 320**-16: "different" cannot fail by chance."""
    alone = llm.generate([PROMPTS[0]], SamplingParams(**SAMPLED, seed=7))[0].token_ids
    again = llm.generate([PROMPTS[0]], SamplingParams(**SAMPLED, seed=7))[0].token_ids
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [SamplingParams(**SAMPLED, seed=1), SamplingParams(**SAMPLED, seed=7), SamplingParams(**SAMPLED)],
    )
    other = llm.generate([PROMPTS[0]], SamplingParams(**SAMPLED, seed=8))[0].token_ids
    assert alone == again == batch[1].token_ids
    assert other != alone
    assert len(set(alone)) > 4  # really sampled, not stuck on one token


def test_top_k_1_and_tiny_top_p_are_greedy(llm, greedy_outputs):
    greedy = [o.token_ids for o in greedy_outputs]
    top_k = llm.generate(PROMPTS, SamplingParams(**SAMPLED, top_k=1, seed=3))
    top_p = llm.generate(PROMPTS, SamplingParams(**SAMPLED, top_p=1e-6, seed=3))
    assert [o.token_ids for o in top_k] == greedy
    assert [o.token_ids for o in top_p] == greedy


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_stream_yields_the_tokens_generate_returns(tiny_llama, draft):
    """Concatenating each request's stream events gives its generate() tokens; each request
    gets exactly one finished event, its last. Holds with and without speculation."""
    llm = LLM(model=tiny_llama, draft_model=draft, num_speculative_tokens=3 if draft else None, kv_cache_gib=0.01)
    params = [SamplingParams(**SAMPLED, seed=i) for i in range(len(PROMPTS))] + [GREEDY]
    prompts = PROMPTS + [PROMPTS[0]]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    streamed = [[] for _ in prompts]
    finished = [[] for _ in prompts]
    for event in llm.stream(prompts, params):
        assert not any(finished[event.index]), "event after the finished one"
        streamed[event.index] += event.new_token_ids
        finished[event.index].append(event.finished)
    assert streamed == expected
    assert all(f[-1] and sum(f) == 1 for f in finished)


@pytest.mark.parametrize("draft", [None, "ngram", "target"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_raw_log_softmax_at_each_generated_position(tiny_llama, draft, temperature):
    """logprobs=N returns, per generated token, the N most likely tokens and the sampled one with
    their log-probabilities, equal to a teacher-forced forward's log_softmax (before temperature)
    at the position that predicted the token. Drafting with the target itself accepts most
    drafts, so tokens emitted at every offset of a verified run are checked."""
    import torch

    from minispec import BatchMetadata, load_checkpoint

    draft_model = tiny_llama if draft == "target" else draft
    llm = LLM(model=tiny_llama, draft_model=draft_model, num_speculative_tokens=3 if draft_model else None, kv_cache_gib=0.01)
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=5, logprobs=4)
    outs = llm.generate(PROMPTS, params)
    streamed = [[] for _ in PROMPTS]
    for event in llm.stream(PROMPTS, params):
        streamed[event.index] += event.new_logprobs
    assert streamed == [o.logprobs for o in outs]
    assert llm.generate(PROMPTS[:1], GREEDY)[0].logprobs is None
    if draft == "target":
        assert llm.last_metrics.summary()["mean_accepted_per_step"] > 2
    model, _ = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu", backend="torch")
    for o in outs:
        ids = o.prompt_token_ids + o.token_ids
        with torch.no_grad():
            ref = model(torch.tensor(ids), BatchMetadata.for_prompts([len(ids)])).log_softmax(-1)  # [L, V]
        assert len(o.logprobs) == len(o.token_ids)
        for j, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            row = ref[len(o.prompt_token_ids) + j - 1]  # the position that predicted token j
            top_values, top_ids = row.topk(4)
            assert set(entry) == set(top_ids.tolist()) | {token}
            for t, lp in entry.items():
                assert math.isclose(lp.logprob, row[t].item(), abs_tol=1e-4), (j, t, lp, row[t].item())
                if t not in top_ids.tolist():  # vLLM's rank: 1 + the tokens more likely (to the tolerance)
                    assert 1 + int((row > row[t] + 1e-4).sum()) <= lp.rank <= 1 + int((row > row[t] - 1e-4).sum())
                assert lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
            assert [entry[t].rank for t in top_ids.tolist()] == [1, 2, 3, 4]
            if temperature == 0:
                assert token == top_ids[0].item()
        assert math.isclose(o.outputs[0].cumulative_logprob, sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))


def test_vllm_style_code_runs_as_written(tiny_llama, tiny_llama_draft, capsys):
    """The snippet users copy from vLLM articles, unmodified apart from the paths: the older
    `speculative_model=` spelling, `tensor_parallel_size=1`, `output.prompt` and
    `output.outputs[0].text`."""
    prompt = "the quick brown fox"
    llm = LLM(model=str(tiny_llama), speculative_model=str(tiny_llama_draft), tensor_parallel_size=1)
    sampling_params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=100)
    for output in llm.generate([prompt], sampling_params):
        print(output.prompt, output.outputs[0].text)
    assert llm.engine.drafter is not None and llm.engine.k == 4
    out = llm.generate([prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.prompt == prompt and out.outputs[0].index == 0 and out.outputs[0].token_ids == out.token_ids
    assert capsys.readouterr().out.startswith(prompt + " ")


def test_vllm_speculative_config_is_accepted(tiny_llama, tiny_llama_draft):
    """Current vLLM's speculative_config dict: a draft model (k from the dict) or n-gram drafting;
    greedy output equals plain decoding either way."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=str(tiny_llama)).generate(["hello world"], params)[0].token_ids
    draft = LLM(model=str(tiny_llama), speculative_config={"model": str(tiny_llama_draft), "num_speculative_tokens": 3})
    ngram = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert draft.engine.k == 3 and ngram.engine.k == 2
    assert draft.generate(["hello world"], params)[0].token_ids == plain
    assert ngram.generate(["hello world"], params)[0].token_ids == plain

    # vLLM's n-gram window keys; with a draft model, prompt lookup in front of it
    window = LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 2})
    assert (window.engine.drafter.max_n, window.engine.drafter.min_n) == (5, 2)
    hybrid = LLM(model=str(tiny_llama), speculative_config={"model": str(tiny_llama_draft), "prompt_lookup_min": 2})
    assert (hybrid.engine.drafter.lookup.min_n, hybrid.engine.drafter.lookup.max_n) == (2, 3)
    assert hybrid.generate(["hello world"], params)[0].token_ids == plain


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size must be 1"),
    (dict(draft_model="ngram", speculative_model="ngram"), "name the drafter once: got draft_model and speculative_model"),
    (dict(speculative_config={"method": "medusa", "model": "x"}), "method 'medusa' is not supported"),
    (dict(speculative_config={"method": "eagle", "model": "x"}), "method 'eagle' needs an EAGLE-3 checkpoint"),
    (dict(speculative_config={"model": "x", "draft_tensor_parallel_size": 2}), "draft_tensor_parallel_size must be 1"),
    (dict(speculative_config={"model": "x", "acceptance_method": "typical"}), "keys not supported"),
    (dict(speculative_config={"num_speculative_tokens": 2}), "needs 'model'"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, num_speculative_tokens=3), "disagrees"),
    (dict(speculative_config=["ngram"]), "must be a dict"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}), "prompt_lookup_max 2 is below"),
    (dict(speculative_config={"model": "x", "prompt_lookup_max": 4}), "needs prompt_lookup_min"),
    (dict(speculative_config={"model": "x", "prompt_lookup_min": 2}, prompt_lookup_min=3), "disagrees"),
])
def test_vllm_spellings_are_checked(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_llama), **kwargs)


def test_a_mistyped_draft_model_is_named_before_the_target_loads(monkeypatch):
    """LLM(draft_model="ngarm") loaded the target first, then said 'checkpoint ngarm is neither a
    directory nor a .gguf file', naming neither draft_model nor 'ngram'."""
    from minispec.options import EngineOptions

    with pytest.raises(ValueError, match="draft_model 'ngarm': no such file or directory .* or 'ngram'"):
        EngineOptions(model="anything", draft_model="ngarm", num_speculative_tokens=2)


def test_a_dict_of_sampling_options_is_named(tiny_llama):
    """A dict passed as sampling_params was read as its keys ('got str', or '1 prompts but 2 SamplingParams')."""
    llm = LLM(model=tiny_llama, kv_cache_gib=0.01)
    with pytest.raises(TypeError, match="got a dict; for a dict of options: SamplingParams"):
        llm.generate("hi", {"max_tokens": 4, "temperature": 0})
