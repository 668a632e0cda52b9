"""The incremental detokenizer (minispec/runtime/detokenizer.py): at every emitted token its text
equals decoding the whole output after the prompt (`Tokenizer.decode_after`), for a byte-level
BPE (GPT-2 / Llama 3 / Qwen2 / SmolLM2 style) and a SentencePiece BPE with byte fallback (Llama 2 /
Mistral style), through characters split across tokens and special tokens; and a call decodes
only the tokens since the last complete character (plus 5 of context), not the whole output.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minispec.io.tokenizer import Tokenizer
from minispec.runtime.detokenizer import IncrementalDetokenizer

FIXED = settings(derandomize=True, deadline=None, max_examples=200, suppress_health_check=list(HealthCheck))


def byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece BPE as HF converts Llama 2's: '▁'-words, <0xXX> byte tokens (here the UTF-8
    bytes of 'é' and '€'), decoded through Replace / ByteFallback / Fuse / Strip."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = ["<s>", "</s>", "▁a", "▁b", "c", "▁", "<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>"]
    tok = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.add_special_tokens(["</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok, [1], 0)


@pytest.fixture(scope="module")
def tokenizers(tiny_llama):
    return {"byte-level": Tokenizer.from_dir(tiny_llama), "sentencepiece": byte_fallback_tokenizer()}


@FIXED
@given(kind=st.sampled_from(["byte-level", "sentencepiece"]), data=st.data())
def test_incremental_text_equals_decoding_the_whole_output(tokenizers, kind, data):
    tok = tokenizers[kind]
    ids = st.integers(0, tok.vocab_size - 1)
    prompt = data.draw(st.lists(ids, max_size=8), label="prompt")
    output = data.draw(st.lists(ids, min_size=1, max_size=30), label="output")
    detok = IncrementalDetokenizer()
    for n in range(1, len(output) + 1):
        same_where_well_formed(detok.text(tok, prompt, output[:n]), tok.decode_after(prompt, output[:n]))
    cut = data.draw(st.integers(0, len(output)), label="cut")  # an EOS or stop token's text left out
    same_where_well_formed(detok.text(tok, prompt, output[:cut]), tok.decode_after(prompt, output[:cut]))


def same_where_well_formed(incremental: str, whole: str) -> None:
    """Equal wherever the whole decode is well-formed (see the next test for where it is not)."""
    if "\ufffd" not in whole:
        assert incremental == whole


def test_a_settled_character_stays_when_a_broken_one_follows(tokenizers):
    """Byte fallback replaces a whole run of byte tokens that is not valid UTF-8: 'é' then a lone
    first byte decode to three U+FFFD together; the incremental text keeps the 'é' it settled, as
    vLLM's detokenizer does, and completes the next character when its byte comes."""
    tok, detok = tokenizers["sentencepiece"], IncrementalDetokenizer()
    e_acute = [6, 7]  # <0xC3> <0xA9>
    assert tok.decode_after([], e_acute + [6]) == "\ufffd" * 3
    texts = [detok.text(tok, [], (e_acute * 2)[:n]) for n in range(1, 5)]
    assert texts == ["\ufffd", "é", "é\ufffd", "éé"]


def test_a_word_after_a_long_run_of_byte_tokens_keeps_its_space(tokenizers):
    """Llama 2 / Mistral write CJK text as runs of byte tokens; a context window starting inside
    such a run decodes to U+FFFD only, and the next word lost its leading space ('éééa')."""
    tok, detok = tokenizers["sentencepiece"], IncrementalDetokenizer()
    output = [6, 7] * 4 + [2, 8, 9, 10, 3]  # é é é é ▁a € ▁b
    texts = [detok.text(tok, [2], output[:n]) for n in range(1, len(output) + 1)]
    assert texts[-1] == tok.decode_after([2], output) == "éééé a€ b"
    assert [t for t in texts if "\ufffd" not in t] == [tok.decode_after([2], output[:n]) for n in range(1, len(output) + 1)
                                                       if "\ufffd" not in tok.decode_after([2], output[:n])]


def test_a_word_after_a_prompt_ending_in_a_run_of_byte_tokens_keeps_its_space(tokenizers):
    """The prompt-side twin: a prompt's last 5 tokens starting inside a run of byte tokens decode to
    U+FFFD only, and the first output word lost its leading space ('the' for ' the'; found in review)."""
    tok = tokenizers["sentencepiece"]
    prompt, output = [6, 7, 8, 9, 10, 6, 7, 6, 7], [2, 3]  # é € é é | ▁a ▁b: the last 5 start on €'s last byte
    assert tok.decode(prompt[-5:]).endswith("\ufffd")  # (the window starts on a continuation byte)
    assert tok.decode_after(prompt, output) == " a b" == IncrementalDetokenizer().text(tok, prompt, output)


class Counting:
    """A tokenizer that records how many ids each call decodes."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.sizes = tok, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tok.decode(ids)

    def decode_after(self, context, ids):
        self.sizes.append(min(len(context), 5) + len(ids))
        return self.tok.decode_after(context, ids)


def test_a_call_decodes_only_the_new_tokens(tokenizers):
    """400 tokens of text, one call per token: each decodes the new token plus a few of context
    (was: the whole output, O(n^2) a request)."""
    tok = tokenizers["byte-level"]
    output = tok.encode("the quick brown fox jumps over the lazy dog; " * 40)[:400]
    counting, detok = Counting(tok), IncrementalDetokenizer()
    for n in range(1, len(output) + 1):
        text = detok.text(counting, [7, 8], output[:n])
    assert text == tok.decode_after([7, 8], output) and len(output) == 400
    assert max(counting.sizes) <= 8
