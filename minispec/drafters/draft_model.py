"""A draft model: a small model of the same class as the target, with its own weights, config and
paged KV cache, drafting token by token (the loop is `AutoregressiveDrafter.propose`).

The draft's first forward of a step catches up on the tokens it has not cached (the whole prompt
at first, then the 1 or 2 tokens the last step accepted past its drafts); each later forward feeds
the token it just drafted. Under static shapes a long catch-up, after steps that prompt lookup
drafted, comes in bucket-sized pieces first (`feed_ahead`). A prompt fed to the target in chunks
(runtime/chunked_prefill.py) is fed to the draft in the same chunks (`feed_prompt`), so its first
step catches up on its newest token.

Its q lives on the target's vocabulary: a draft whose embedding is padded to another size (the
same tokenizer) has its extra columns dropped and missing ones get q = 0, and a draft with a
reduced vocabulary (reduced_vocab.py) scores its N tokens only.
"""

from __future__ import annotations

import torch

from ..runtime.layout import Prepared
from ..runtime.runner import Feed, ModelRunner
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from .base import AutoregressiveDrafter


class ModelDrafter(AutoregressiveDrafter):
    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None, vocab_size: int | None = None):
        """vocab_size: the target's, when the draft's embedding is padded to another size."""
        super().__init__(confidence_threshold)
        self.runner = runner
        self.vocab_size = vocab_size or runner.model.cfg.vocab_size
        self.draft_ids = runner.model.vocab_ids  # a reduced vocabulary (reduced_vocab.py), else None

    def draftable(self, seq: Sequence, n: int) -> int:
        """The i-th draft token is sampled after feeding position len(seq) - 2 + i: the draft's context bounds n."""
        return max(0, min(n, self.runner.max_positions - len(seq) + 1))

    def first_feeds(self, seqs: list[Sequence], active: list[int]) -> tuple[list[Feed], dict]:
        """Catch up on the tokens the draft has not cached (after `feed_ahead`'s pieces)."""
        return [Feed(seqs[b].draft_table, seqs[b].tokens[seqs[b].draft_table.num_cached :]) for b in active], {}

    def first_forward(self, seqs: list[Sequence], active: list[int]) -> tuple[torch.Tensor, None]:
        self.feed_ahead([seqs[b] for b in active])
        feeds, _ = self.first_feeds(seqs, active)
        return self.logits(feeds), None

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.widen(out), None

    def next_forward(self, seqs: list[Sequence], active: list[int], tokens: list[list[int]], carry: None
                     ) -> tuple[torch.Tensor, None]:
        return self.logits([Feed(seqs[b].draft_table, [tokens[b][-1]]) for b in active]), None

    def tree_forward(self, feeds: list[Feed], carry: None, rows: list[int]) -> tuple[torch.Tensor, None]:
        """Tree nodes need only their tokens (the tree mask says what each sees)."""
        return self.logits(feeds), None

    def logits(self, feeds: list[Feed]) -> torch.Tensor:
        """Draft logits on the target's vocabulary [n, V] (a reduced vocabulary's: [n, N])."""
        return self.widen(self.runner.forward(feeds))  # [n, V_draft] -> [n, V]

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [n, V_draft] on the target's vocabulary (see the module docstring)."""
        if self.draft_ids is not None:  # [n, N]: column j is target id draft_ids[j]
            return logits
        V, Vd = self.vocab_size, logits.shape[-1]
        if Vd > V:
            return logits[:, :V]
        if Vd < V:
            return torch.cat([logits, logits.new_full((logits.shape[0], V - Vd), float("-inf"))], dim=-1)
        return logits

    def feed_ahead(self, seqs: list[Sequence], upload: Upload | None = None) -> list[tuple[Prepared, dict]]:
        """Under static shapes, a catch-up past the prompt that is longer than the runner's largest
        query length (the tokens of steps that prompt lookup drafted: drafters/lookup.py) is fed
        in pieces of that length first, so that every forward past a prompt fits a bucket. The
        K/V are those of one forward; a prompt still goes dynamically, whole. Without an upload
        each piece runs now; with one (a staged step) each is prepared into it, to run on the
        device before the first draft forward (`run_staged`), and they are returned in order."""
        static, pieces = self.runner.static, []
        while static is not None:
            Q, tables = static.query_len, [s.draft_table for s in seqs]
            feeds = [Feed(t, s.tokens[t.num_cached : t.num_cached + Q]) for s, t in zip(seqs, tables)
                     if t.num_cached >= len(s.prompt_ids) and len(s) - t.num_cached > Q]
            if not feeds:
                break
            if upload is None:
                self.runner.forward(feeds)
            else:  # (prepare counts the piece as cached, so the next piece starts after it)
                pieces.append((self.runner.prepare(feeds, upload), {}))
        return pieces

    def feed_prompt(self, seqs: list[Sequence], ends: list[int]) -> None:
        """Cache the draft's K/V of each prompt up to position ends[b] (the logits are unused)."""
        feeds = [Feed(s.draft_table, s.tokens[s.draft_table.num_cached : end])
                 for s, end in zip(seqs, ends) if s.draft_table.num_cached < end]
        if feeds:
            self.runner.forward(feeds)

    def rollback(self, seqs: list[Sequence]) -> None:
        """Forget draft K/V past the accepted tokens (the newest token is fed next step)."""
        for s in seqs:
            s.draft_table.truncate(len(s) - 1, self.runner.cache.allocator)
