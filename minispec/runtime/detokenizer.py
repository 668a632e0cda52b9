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
"""

from __future__ import annotations

from bisect import bisect_right
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
