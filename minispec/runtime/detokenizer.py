"""A request's output text, decoded incrementally, as vLLM's detokenizer decodes it.

The text of output ids o_1..o_n is what they add after the prompt (`Tokenizer.decode_after`).
Decoding all n ids at every emitted token (for stop strings, for a stream's next delta) costs
O(n) per token, O(n^2) per request. Instead the text is settled at points s where it was
complete (it did not end in U+FFFD, the replacement a byte-level or byte-fallback decoder writes
for a character whose bytes are not all there yet), and a call decodes only what follows:

    text(o_1..o_n) = text(o_1..o_s) + [decode(o_c..o_n) minus its prefix decode(o_c..o_s)]

where c is an earlier settle point at least 5 tokens back (0 at the start). Starting the context
at a settle point matters: it begins on a character boundary, so a byte-fallback decoder (Llama 2,
Mistral), which replaces a whole run of byte tokens when the run is not valid UTF-8, decodes it
as the whole output decodes it, and a SentencePiece word's leading space survives. A call thus
decodes the tokens since the last settle point plus about 5 of context, whatever the length.

The text side of a request lives here too: `TextState` (a sequence's `seq.text`, made when its
text is first needed) holds its detokenizer and where stop strings cut the text. A sequence's
`append` calls `match_stop_strings` once its output is past min_tokens, when its request has
stop strings; `output_text` is what a request's output reads.

Why the output stays exact: the text is a function of the token ids, which nothing here
touches; a stop string only ends a request (as EOS does) after the token that completes it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Protocol

from ..io.tokenizer import CONTEXT_TOKENS


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...

    def decode_after(self, context: list[int], ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """The text of one sequence's output ids, which only grow (or are cut back: decoded anew)."""

    def __init__(self):
        self.points = [0]  # settle points, ascending: output lengths at which the text was complete
        self.settled_text = ""  # the text of output_ids[: points[-1]]

    def text(self, tokenizer: Decoder, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The text `output_ids` add after `prompt_ids` (`tokenizer.decode_after`)."""
        if self.points[-1] > len(output_ids):  # cut back past the settled text: start over
            self.points, self.settled_text = [0], ""
        s = self.points[-1]
        tail = self.tail(tokenizer, prompt_ids, output_ids, s) if len(output_ids) > s else ""
        if tail is None:  # the decoder changed text before the settle point: decode it all again
            self.points, self.settled_text, tail = [0], "", tokenizer.decode_after(prompt_ids, output_ids)
        full = self.settled_text + tail
        if tail and not tail.endswith("\ufffd"):
            self.points.append(len(output_ids))
            self.settled_text = full
            del self.points[: max(0, len(self.points) - 64)]  # (the context never reaches further back)
        return full

    def tail(self, tokenizer: Decoder, prompt_ids: list[int], output_ids: list[int], s: int) -> str | None:
        """The text of output_ids[s:] after the settled text; U+FFFD while a character is incomplete
        (a byte-fallback decoder then replaces the whole run of byte tokens, settled bytes too);
        None if the decoder rewrote text before s."""
        if s == 0:
            return tokenizer.decode_after(prompt_ids, output_ids)
        c = self.points[max(0, bisect_right(self.points, s - CONTEXT_TOKENS) - 1)]  # a settle point >= 5 back
        before = tokenizer.decode(output_ids[c:s])
        full = tokenizer.decode(output_ids[c:])
        if full.startswith(before):
            return full[len(before):]
        return "\ufffd" if full.endswith("\ufffd") else None


@dataclass
class TextState:
    """One request's text side: its output's text so far and where a stop string cuts it."""

    detokenizer: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    stop_text_end: int | None = None  # output text is cut here when a stop string matched
    stop_floor: int | None = None  # characters of the first min_tokens tokens' text (stop strings end past it)


def text_state(seq) -> TextState:
    """seq's text side, made on first use. (seq: a runtime.sequence.Sequence, here and below; not
    imported, as sequence.py imports this module.)"""
    if seq.text is None:
        seq.text = TextState()
    return seq.text


def full_text(seq, tokenizer: Decoder) -> str:
    """What the output ids add after the prompt, decoded incrementally, less the last token's text
    when an EOS or a stop token ended the request (vLLM leaves it out, unless
    include_stop_str_in_output)."""
    ids = seq.output_ids
    if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str) and not seq.params.include_stop_str_in_output:
        ids = ids[:-1]
    return text_state(seq).detokenizer.text(tokenizer, seq.prompt_ids, ids)


def output_text(seq, tokenizer: Decoder) -> str:
    """The request's output text, cut before a matched stop string (after it, with
    include_stop_str_in_output)."""
    text = full_text(seq, tokenizer)
    end = text_state(seq).stop_text_end
    return text if end is None else text[:end]


def match_stop_strings(seq, tokenizer: Decoder) -> None:
    """The earliest stop string in the output text that ends past the text of the first
    min_tokens tokens (vLLM's rule) ends the request; its text ends before the string, or after
    it with include_stop_str_in_output. Called once the output is longer than min_tokens."""
    p, state = seq.params, text_state(seq)
    text = full_text(seq, tokenizer)
    if state.stop_floor is None:
        state.stop_floor = len(tokenizer.decode_after(seq.prompt_ids, seq.output_ids[: p.min_tokens])) if p.min_tokens else 0
    floor = state.stop_floor
    hits = [(i, s) for i, s in ((text.find(s, max(0, floor - len(s) + 1)), s) for s in p.stop) if i >= 0]
    if hits:
        i, stop = min(hits)
        state.stop_text_end = i + len(stop) if p.include_stop_str_in_output else i
        seq.finish_reason, seq.stop_reason = "stop", stop
