"""A reduced draft vocabulary (FR-Spec; minispec/drafters/reduced_vocab.py): the draft model's LM head
over N frequent tokens, q = 0 elsewhere. Exactness under sampling: test_speculative_statistical.py
(a reduced-vocabulary draft, the target putting mass outside it); here the list, the head, greedy
identity and the options.
"""

from __future__ import annotations

import pytest
import torch

import minispec.drafters.reduced_vocab as reduced_vocab
from minispec import LLM, BatchMetadata, SamplingParams, load_checkpoint
from minispec.drafters.reduced_vocab import frequent_tokens, reduce_vocab
from minispec.options import EngineOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_list_keeps_special_tokens_then_the_most_frequent(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    _, tok = load_checkpoint(tiny_llama, dtype="float32")
    corpus = ["def add(a, b): return a + b"] * 3 + ["the end"]
    from collections import Counter

    counts = Counter(i for text in corpus for i in tok.encode(text, add_special_tokens=False))
    n = 2 + len(counts) // 2
    ids = frequent_tokens(tok, n, tok.vocab_size, corpus)
    assert ids.tolist() == sorted(ids.tolist()) and len(ids) == n
    ranked = sorted((i for i in range(tok.vocab_size) if i not in (0, 1)), key=lambda i: (-counts.get(i, 0), i))
    assert set(ids.tolist()) == {0, 1} | set(ranked[: n - 2])  # <s> and </s> (special: kept whatever their count), then by count
    assert set(ranked[: n - 2]) < set(counts)  # some tokens of the corpus were left out: the ranking decided
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        frequent_tokens(tok, tok.vocab_size + 1, tok.vocab_size, corpus)
    # the default corpus is counted once per tokenizer and N, then read from the cache
    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", lambda: corpus)
    first = frequent_tokens(tok, 40, tok.vocab_size)
    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", lambda: pytest.fail("counted twice"))
    assert torch.equal(frequent_tokens(tok, 40, tok.vocab_size), first)


def test_the_reduced_head_scores_its_tokens_as_the_full_head_does(tiny_llama_draft):
    full, _ = load_checkpoint(tiny_llama_draft, dtype="float32")
    model, _ = load_checkpoint(tiny_llama_draft, dtype="float32")
    ids = torch.tensor([0, 1, 5, 17, 100, 311])
    reduce_vocab(model, ids)
    x = torch.arange(3, 20)
    a, b = model(x, BatchMetadata.for_prompts([len(x)])), full(x, BatchMetadata.for_prompts([len(x)]))
    assert a.shape == (len(x), len(ids))
    torch.testing.assert_close(a, b[:, ids], rtol=1e-5, atol=1e-5)


def test_greedy_output_is_plain_greedy_output_with_an_int4_reduced_draft(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", lambda: ["def add(a, b): return a + b", "the end"])
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32", kv_cache_gib=0.01).generate(prompts, params)
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_draft), draft_quantization="int4", draft_vocab_size=64,
              dtype="float32", kv_cache_gib=0.01, num_speculative_tokens=3)
    draft = llm.engine.runners[1][0].model
    assert draft.quantization == "int4" and draft.lm_head.out_features == 64 and len(llm.engine.drafter.draft_ids) == 64
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1))
    assert all(len(o.token_ids) == 8 for o in sampled)


@pytest.mark.parametrize("options,message", [
    (dict(draft_vocab_size=64), "draft_vocab_size=64 is for a draft model"),
    (dict(draft_model="ngram", draft_vocab_size=64), "draft_vocab_size=64 is for a draft model"),
    (dict(draft_model="EAGLE", draft_vocab_size=64), "with its own draft vocabulary"),
    (dict(draft_model="DRAFT", draft_vocab_size=0), r"draft_vocab_size must be an int in \[1"),
    (dict(draft_model="DRAFT", draft_vocab_size=64, quantization="int8"), "int8 draft is not supported"),
])
def test_bad_draft_vocab_options_are_refused_by_name(tiny_llama, tiny_llama_draft, tiny_llama_eagle, options, message):
    paths = {"DRAFT": str(tiny_llama_draft), "EAGLE": str(tiny_llama_eagle)}
    options = {k: paths.get(v, v) for k, v in options.items()}
    with pytest.raises(ValueError, match=message):
        EngineOptions(model=str(tiny_llama), **options)
