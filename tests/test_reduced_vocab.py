"""A reduced draft vocabulary (FR-Spec; minispec/drafters/reduced_vocab.py): the draft model's LM head
over N frequent tokens, q = 0 elsewhere. Exactness under sampling: test_speculative_statistical.py
(a reduced-vocabulary draft, the target putting mass outside it); here the list, the head, greedy
identity and the options, and the cache of token counts: counted once per tokenizer and corpus
whatever the N, written atomically, and a damaged file counted again with a warning naming it.
"""

from __future__ import annotations

import json
import os
import re

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
    # the default corpus is counted once per tokenizer, then read from the cache
    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", lambda: corpus)
    first = frequent_tokens(tok, 40, tok.vocab_size)
    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", lambda: pytest.fail("counted twice"))
    assert torch.equal(frequent_tokens(tok, 40, tok.vocab_size), first)


CORPUS = ["def add(a, b): return a + b"] * 3 + ["the end", "while True: print('the end')"]


class CountingEncoder:
    """A tokenizers.Tokenizer that counts its encode_batch calls (everything else passed through)."""

    def __init__(self, tok, calls: dict):
        self._tok, self._calls = tok, calls

    def encode_batch(self, texts):
        self._calls["encode"] += 1
        return self._tok.encode_batch(texts)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture
def counted(tiny_llama, tmp_path, monkeypatch):
    """(the tiny tokenizer, the cache's vocab folder, calls): a cache in tmp_path, the default
    corpus replaced by CORPUS, and calls counting how often it is read and tokenized."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    _, tok = load_checkpoint(tiny_llama, dtype="float32")
    calls = {"read": 0, "encode": 0}

    def corpus():
        calls["read"] += 1
        return list(CORPUS)

    monkeypatch.setattr(reduced_vocab, "stdlib_corpus", corpus)
    tok.tok = CountingEncoder(tok.tok, calls)
    return tok, tmp_path / "vocab", calls


def test_a_second_size_is_taken_from_the_counts_made_for_the_first(counted):
    """Counting the corpus takes about a minute on a real tokenizer: it is done once, whatever N
    (each N used to tokenize the whole corpus again), and each N is what counting gives."""
    tok, _, calls = counted
    first = frequent_tokens(tok, 40, tok.vocab_size)
    second = frequent_tokens(tok, 50, tok.vocab_size)
    assert calls == {"read": 1, "encode": 1}
    assert torch.equal(second, frequent_tokens(tok, 50, tok.vocab_size, CORPUS))
    assert set(first.tolist()) < set(second.tolist())
    assert torch.equal(frequent_tokens(tok, 40, tok.vocab_size), first) and calls["read"] == 1


def test_a_draft_with_fewer_ids_gets_ids_in_its_own_range(counted):
    """The cache is of the tokenizer's counts; the N ids are chosen among the draft's ids. A
    list cached for one vocabulary used to be handed to a draft with a smaller one (ids out of
    its range: IndexError in its LM head)."""
    tok, _, _ = counted
    assert frequent_tokens(tok, 40, tok.vocab_size).max() >= 50  # (some ids past the smaller vocabulary)
    ids = frequent_tokens(tok, 40, 50)
    assert torch.equal(ids, frequent_tokens(tok, 40, 50, CORPUS))
    assert len(set(ids.tolist())) == 40 and int(ids.max()) < 50


def edit_counts(change):
    """A damage to the cache file that parses it, applies change(data) and writes it back."""
    def damage(text: str) -> str:
        data = json.loads(text)
        change(data)
        return json.dumps(data)
    return damage


DAMAGES = {
    "truncated": lambda text: text[: len(text) // 2],
    "a dict of something else": lambda text: json.dumps({"ids": [0, 1, 2]}),
    "a list of 3 ids": lambda text: json.dumps([0, 1, 2]),
    "a list with an id out of range": lambda text: json.dumps(list(range(39)) + [10**6]),
    "a count missing": edit_counts(lambda data: data["counts"].pop()),
    "a negative count": edit_counts(lambda data: data["counts"].__setitem__(5, -1)),
    "a fractional count": edit_counts(lambda data: data["counts"].__setitem__(5, 1.5)),
    "counts as a dict": edit_counts(lambda data: data.__setitem__("counts", {"0": 1})),
    "another tokenizer's counts": edit_counts(lambda data: data.__setitem__("tokenizer", "0" * 64)),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_cache_file_is_counted_again_with_a_warning_naming_it(counted, damage):
    """Whatever is wrong with the cache file (cut short by a write killed part-way, another shape,
    a count missing or not a non-negative int, another tokenizer's), it is counted again and
    replaced, with a warning naming the file; the ids are those of a good cache. It used to be
    trusted: a JSONDecodeError naming no file, a TypeError, or ids out of range or too few."""
    tok, folder, calls = counted
    expected = frequent_tokens(tok, 40, tok.vocab_size)
    [path] = list(folder.iterdir())
    path.write_text(DAMAGES[damage](path.read_text()))
    with pytest.warns(RuntimeWarning, match=re.escape(str(path))):
        again = frequent_tokens(tok, 40, tok.vocab_size)
    assert torch.equal(again, expected) and calls["encode"] == 2
    assert torch.equal(frequent_tokens(tok, 40, tok.vocab_size), expected)  # the file was replaced: good again
    assert calls["encode"] == 2
    assert list(folder.iterdir()) == [path]


def test_the_cache_file_appears_whole_or_not_at_all(counted, monkeypatch):
    """The counts are written beside the cache file and renamed over it: interrupted before the
    rename, there is no cache file (and no partial one left over), and the next call counts again.
    It used to be written in place, where an interrupt left a truncated file."""
    tok, folder, calls = counted

    def interrupt(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(os, "replace", interrupt)
        with pytest.raises(KeyboardInterrupt):
            frequent_tokens(tok, 40, tok.vocab_size)
    assert not folder.exists() or not list(folder.iterdir())
    assert torch.equal(frequent_tokens(tok, 40, tok.vocab_size), frequent_tokens(tok, 40, tok.vocab_size, CORPUS))
    assert calls["encode"] == 3 and len(list(folder.iterdir())) == 1


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """write_atomic: a reader finds the old contents or all of the new, never a part, and an
    interrupted write leaves nothing beside the file."""
    from minispec.io.paths import write_atomic

    path = tmp_path / "sub" / "cache.json"
    write_atomic(path, "old")
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            write_atomic(path, "new" * 1000)
    assert path.read_text() == "old" and list(path.parent.iterdir()) == [path]
    write_atomic(path, "new")
    assert path.read_text() == "new" and list(path.parent.iterdir()) == [path]


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
