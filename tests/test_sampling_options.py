"""vLLM's sampling options and LLM.chat, as vLLM code uses them.

Invariants: with penalties, min_tokens and stop tokens every drafter gives the greedy tokens plain
decoding gives (the exact laws are checked in test_speculative_exact / _statistical); n
completions per prompt; stop_token_ids end a request with stop_reason the id; min_tokens holds
EOS, stop tokens and stop strings back; include_stop_str_in_output keeps the string;
max_tokens=None runs to the context; chat renders the chat template; use_tqdm is on by default
for several prompts, as in vLLM; every unsupported option is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from minispec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["the quick brown fox", "hello world", "to be or not to be, that is"]


@pytest.fixture(scope="module")
def llms(tiny_llama, tiny_llama_draft, tiny_llama_eagle):
    common = dict(kv_cache_gib=0.01)
    return {"none": LLM(model=tiny_llama, **common),
            "draft": LLM(model=tiny_llama, draft_model=tiny_llama_draft, num_speculative_tokens=3, **common),
            "ngram": LLM(model=tiny_llama, draft_model="ngram", num_speculative_tokens=3, **common),
            "eagle": LLM(model=tiny_llama, draft_model=tiny_llama_eagle, num_speculative_tokens=3,
                         prompt_lookup_min=2, **common),
            "eagle-tree": LLM(model=tiny_llama, draft_model=tiny_llama_eagle, num_speculative_tokens=3,
                              draft_tree_budget=6, draft_tree_top_k=2, **common),
            "self-tree": LLM(model=tiny_llama, draft_model=tiny_llama, num_speculative_tokens=3,  # long accepted paths
                             draft_tree_budget=8, draft_tree_top_k=3, **common)}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.9),
    SamplingParams(temperature=0, max_tokens=16, min_tokens=10, repetition_penalty=0.8, frequency_penalty=-1.0),
], ids=["repetition", "presence+frequency", "min_tokens+negative"])
def test_penalised_greedy_output_is_plain_decodings_with_every_drafter(llms, params):
    plain = [o.token_ids for o in llms["none"].generate(PROMPTS, params)]
    unpenalised = [o.token_ids for o in llms["none"].generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                                       ignore_eos=True))]
    assert plain != unpenalised  # the penalties do change the greedy path here
    for name in ("draft", "ngram", "eagle", "eagle-tree", "self-tree"):  # (trees: each node's row by its own path)
        assert [o.token_ids for o in llms[name].generate(PROMPTS, params)] == plain, name


def test_stop_token_ids_min_tokens_and_the_stop_string_kept(llms):
    llm = llms["draft"]
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    # min_tokens: the stop token may not be sampled before 12 tokens (a different path, as vLLM)
    held = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=12))[0]
    assert len(held.token_ids) >= 12 and stop_id not in held.token_ids[:11]
    text = free.text
    stop = text[5:8]
    assert stop.strip()
    cut = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    kept = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0]
    assert cut.text == text[: text.index(stop)] and kept.text == text[: text.index(stop) + len(stop)]
    streamed = "".join(e.new_text for e in llm.stream(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)))
    assert streamed == kept.text


def test_n_completions_are_seeded_and_streamed_with_their_index(llms):
    llm = llms["eagle"]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=8, seed=11, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params)
    assert [len(o.outputs) for o in outs] == [3, 3] and [c.index for c in outs[0].outputs] == [0, 1, 2]
    alone = [llm.generate(PROMPTS[:1], SamplingParams(temperature=0.9, max_tokens=8, seed=11 + j, ignore_eos=True))[0]
             for j in range(3)]
    assert [c.token_ids for c in outs[0].outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # independent samples differ
    streamed = {}
    for e in llm.stream(PROMPTS[:2], params):
        streamed.setdefault((e.index, e.completion_index), []).extend(e.new_token_ids)
    assert streamed == {(i, j): outs[i].outputs[j].token_ids for i in range(2) for j in range(3)}


def test_max_tokens_none_runs_to_the_context(tiny_llama):
    llm = LLM(model=tiny_llama, max_model_len=48, kv_cache_gib=0.01)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 48 and out.finish_reason == "length"


def test_chat_renders_the_template_and_get_tokenizer(tiny_llama, tmp_path):
    import json
    import shutil

    path = tmp_path / "chat"
    shutil.copytree(tiny_llama, path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(model=str(path), kv_cache_gib=0.01)
    assert llm.get_tokenizer() is llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conversation = [{"role": "user", "content": "hello world"}]
    out = llm.chat(conversation, params)
    assert len(out) == 1 and out[0].prompt == "<user>hello world\n<assistant>"
    assert out[0].token_ids == llm.generate(["<user>hello world\n<assistant>"], params)[0].token_ids
    both = llm.chat([conversation, conversation + [{"role": "assistant", "content": "hi"}]], params)
    assert [o.prompt for o in both] == ["<user>hello world\n<assistant>", "<user>hello world\n<assistant>hi\n<assistant>"]
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([{"content": "no role"}], params)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    assert llm.chat(parts, params)[0].prompt == "<user>hello\nworld\n<assistant>"  # text parts, joined as vLLM joins them
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)


def test_use_tqdm_is_on_by_default_for_several_prompts(llms, capsys):
    llms["none"].generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    assert "requests" not in capsys.readouterr().err
    llms["none"].generate(PROMPTS, SamplingParams(max_tokens=2))
    assert "3/3 requests" in capsys.readouterr().err
    llms["none"].generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "^n must"), (dict(min_tokens=5, max_tokens=3), "^min_tokens"), (dict(stop_token_ids=[-1]), "^stop_token_ids"),
    (dict(repetition_penalty=0), "^repetition_penalty"), (dict(presence_penalty=3), "^presence_penalty"),
    (dict(frequency_penalty=float("nan")), "^frequency_penalty"), (dict(include_stop_str_in_output="yes"), "^include_stop"),
])
def test_bad_sampling_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unsupported_vllm_options_are_refused_by_name():
    for name in ("best_of", "use_beam_search", "prompt_logprobs", "guided_decoding"):
        with pytest.raises(TypeError, match=name):
            SamplingParams(**{name: 1})


def test_min_tokens_holds_back_stop_strings_and_stop_token_text_is_left_out(llms):
    """vLLM's rules: a stop string must end past the text of the first min_tokens tokens (so
    min_tokens=1 never returns an empty answer), and a stop token's text is not in the output
    unless include_stop_str_in_output."""
    llm = llms["draft"]
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    first = llm.tokenizer.decode(free.token_ids[:1])
    assert first
    stopped = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[first]))[0]
    assert stopped.text == "" and len(stopped.token_ids) == 1  # without min_tokens: stopped at once
    held = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[first],
                                                     min_tokens=1))[0]
    assert len(held.token_ids) > 1 and held.text.startswith(first)
    stop_id = free.token_ids[3]
    end = free.token_ids.index(stop_id) + 1
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    kept = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id],
                                                     include_stop_str_in_output=True))[0]
    assert out.token_ids == kept.token_ids == free.token_ids[:end]
    assert out.text == llm.tokenizer.decode(free.token_ids[: end - 1]) and kept.text == llm.tokenizer.decode(free.token_ids[:end])
    streamed = "".join(e.new_text for e in llm.stream(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12,
                                                                                   stop_token_ids=[stop_id])))
    assert streamed == out.text


def test_min_tokens_keeps_eos_out_even_with_ignore_eos():
    """vLLM counts EOS among the tokens min_tokens holds back whatever ignore_eos says; it used
    to be sampled inside min_tokens once ignore_eos was set (5 of 192 completions in a review)."""
    from minispec.penalties import penalize

    rows = [(SamplingParams(min_tokens=3, ignore_eos=True), 1, [2], [1])]  # prompt [2], no output yet, EOS 1
    assert penalize(torch.zeros(1, 4), rows)[0].tolist() == [0.0, float("-inf"), 0.0, 0.0]


def test_a_stop_string_ending_in_a_split_character_is_never_streamed(tiny_llama):
    """The hold-back for a stop string's start counted the U+FFFD of a character still arriving as
    text, so it held back too little: 'm' of the stop string 'm9矕' was streamed, then the
    request stopped before it (found in review). Seed 398 samples 'rK呞', its last character split
    across two tokens (seed 39 sampled 'm9矕' before draws were keyed by position)."""
    llm = LLM(model=tiny_llama, kv_cache_gib=0.01)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=398, ignore_eos=True, stop=["rK呞"])
    final = llm.generate(["hello world"], params)[0]
    assert (final.finish_reason, final.outputs[0].stop_reason) == ("stop", "rK呞")
    assert "".join(e.new_text for e in llm.stream(["hello world"], params)) == final.text


def test_a_sampled_tokens_rank_counts_its_ties_as_vllm_does():
    """vLLM ranks a sampled token outside the top entries by the tokens at least as likely (bf16
    logits tie often); it was 1 + those strictly more likely."""
    from minispec.outputs import Logprob
    from minispec.verification_options import with_sampled

    row = torch.tensor([-0.5, -1.0, -2.0, -2.0, -3.0])
    top = {0: Logprob(-0.5, 1)}
    assert with_sampled(top, row, 3)[3].rank == 4 and with_sampled(top, row, 4)[4].rank == 5
    assert with_sampled(top, row, 0)[0].rank == 1


def test_a_chat_template_that_refuses_a_conversation_says_why(tiny_llama):
    from minispec import load_checkpoint

    _, tok = load_checkpoint(tiny_llama, dtype="float32", device="cpu")
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}x"
    with pytest.raises(ValueError, match="refuses this conversation: roles must start with user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "x"
    tok.chat_template = "y{{ messages[0]['content'] }}"  # compiled once per template: a new one takes effect
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "yhi"


def test_a_chat_template_gets_bos_and_eos_and_its_text_no_extra_specials(tiny_llama):
    """Llama 2 / Mistral templates write bos_token and close each assistant turn with eos_token;
    both used to render as '' (a multi-turn chat lost '</s>' between turns). The rendered text is
    tokenized as it stands, with no BOS added on top (transformers' and vLLM's chat)."""
    from tokenizers import processors

    llm = LLM(model=tiny_llama, kv_cache_gib=0.01)
    tok = llm.tokenizer
    tok.tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # adds BOS
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                         "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    text = tok.apply_chat_template(chat)
    assert text == "<s>[INST] hi [/INST]hello</s>[INST] bye [/INST]"
    ids = tok.chat_prompt(chat)["prompt_token_ids"]
    assert ids == tok.encode(text, add_special_tokens=False) and ids.count(0) == 1 and ids[0] == 0 and ids.count(1) == 1
    assert tok.encode(text).count(0) == 2  # what adding special tokens on top would have given
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=3))[0]
    assert (out.prompt_token_ids, out.prompt) == (ids, text)


def test_chat_templates_render_as_transformers_renders_them(tiny_llama):
    """Sandboxed (a template comes with a downloaded checkpoint: it used to run unsandboxed),
    with {% break %} (it used to be a syntax error) and tojson without HTML escaping."""
    import jinja2
    from minispec import load_checkpoint

    _, tok = load_checkpoint(tiny_llama, dtype="float32", device="cpu")
    tok.chat_template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
    chat = [{"role": "user", "content": "a < b & 'c'"}, {"role": "user", "content": "never"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=False) == '{"role": "user", "content": "a < b & \'c\'"}'
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.TemplateError):
        tok.apply_chat_template(chat)


def test_max_tokens_none_stops_where_the_kv_pool_ends_too(tiny_llama):
    """With a pool smaller than the context, max_tokens=None means what the pool can hold (it used
    to be refused as if the client had asked for the whole context)."""
    from minispec.runtime.kv_cache import KVCache

    model, tok = __import__("minispec").load_checkpoint(tiny_llama, dtype="float32", device="cpu")
    page = KVCache.bytes_per_page(model.cfg, 4, model.dtype)
    llm = LLM(model=(model, tok), page_size=4, kv_cache_gib=9 * page / 2**30)  # 8 pages (+ scratch): 32 positions
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 33 and out.finish_reason == "length"
