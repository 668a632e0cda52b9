"""The drafter interface, plain decoding's no-op drafter, and one draft loop for two drafters.

A drafter proposes, for each sequence b of a step, up to num_draft[b] tokens and the draft
distribution q each was drawn from. The step (speculative.py) calls, in order:

    propose(seqs, num_draft) -> Proposal   before the target's verification
    rollback(seqs)                         after it: forget what the target rejected

`DraftLoop` is the one autoregressive loop: at depth i it asks `next_logits` for each active
sequence's logits over the next token, warps them with the request's options and draws d_i
(argmax when greedy, else by inverse CDF with the request's keyed DRAFT uniform). A row whose
logits are not finite proposes nothing from there on: a broken draft lowers acceptance, never
exactness, because the target verifies whatever q the drafter reports. Two drafters share it:

  * `DraftModelDrafter`: a small model of the target's class with its own paged KV cache; its
    first forward of a step catches up on the tokens it has not cached, each later one feeds
    the token it just drafted;
  * `NgramDrafter`: no model; its "logits" are 0 at the token that followed the latest earlier
    occurrence of the sequence's last n tokens and -inf elsewhere (n-gram drafting as in
    Saxena 2023), so its q is one-hot at that token, whatever the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .randomness import Purpose, uniform
from .runner import Feed, ModelRunner
from .sampling import finite_rows, sample, warp_probs
from .sequence import Sequence


@dataclass
class Proposal:
    """What a drafter proposes for B sequences. tokens: per sequence, its n_b drafted ids.
    probs: [B, K+1, V] (K = max n_b, V the target's vocabulary), q at each drafted position and
    zeros after; None when q is one-hot at each drafted token (greedy requests only)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int) -> "Proposal":
        return cls([[] for _ in range(batch)])


class Drafter:
    """The interface; the default drafts nothing and remembers nothing."""

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> Proposal:
        return Proposal.empty(len(seqs))

    def rollback(self, seqs: list[Sequence]) -> None:
        """The step emitted its tokens: drop whatever was built on rejected drafts."""


class NoDrafter(Drafter):
    """Plain decoding: the step drafts nothing and the target samples one token (n = 0)."""


class DraftLoop(Drafter):
    """One autoregressive draft loop; a subclass supplies `next_logits` (and `vocab_size`)."""

    vocab_size: int  # the width of q: the target's vocabulary
    columns: slice | torch.Tensor = slice(None)  # the target ids of the logits' columns

    def draftable(self, seq: Sequence, n: int) -> int:
        """How many of the n tokens asked for can be drafted for seq now."""
        return n

    def next_logits(self, seqs: list[Sequence], active: list[int], drafted: list[list[int]]) -> torch.Tensor:
        """Logits [len(active), V] of the next draft token of each active sequence, given the
        tokens it drafted so far this step (drafted[b] for seqs[b])."""
        raise NotImplementedError

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
        """What plugs in between the logits and the warp (the default changes nothing); it must be
        what the target's verification applies at the same position, or q would not be the law
        the drafts were drawn from."""
        return logits

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> Proposal:
        num_draft = [self.draftable(s, n) if n > 0 else 0 for s, n in zip(seqs, num_draft)]
        active = [b for b, n in enumerate(num_draft) if n > 0]
        if not active:
            return Proposal.empty(len(seqs))
        B, K = len(seqs), max(num_draft)
        greedy = all(s.params.greedy for s in seqs)  # then every q is one-hot: no probs tensor
        device = self.device
        proposal = Proposal([[] for _ in seqs], None if greedy else torch.zeros(B, K + 1, self.vocab_size, device=device))
        for i in range(K):
            logits = self.next_logits(seqs, active, proposal.tokens)  # [n, V]
            logits = self.adjust(logits, [seqs[b] for b in active], [proposal.tokens[b] for b in active])
            ids, usable, go_on, q = self.draw(seqs, active, logits, greedy, i)
            for row, b in enumerate(active):
                if usable[row]:
                    proposal.tokens[b].append(ids[row])
                    if not greedy:
                        proposal.probs[b, i, self.columns] = q[row]
            active = [b for row, b in enumerate(active) if usable[row] and go_on[row] and num_draft[b] > i + 1]
            if not active:
                break
        return proposal

    def draw(self, seqs: list[Sequence], active: list[int], logits: torch.Tensor, greedy: bool, depth: int
             ) -> tuple[list[int], list[bool], list[bool], torch.Tensor | None]:
        """One draft per active row, at position len(s) + depth: (target ids, usable rows, rows
        that may go on drafting, q [n, V] or None when greedy), with one host copy."""
        logits, ok = drop_nonfinite(logits)  # [n, V], [n]
        q = None
        if greedy:
            drawn = logits.argmax(-1)  # [n]
        else:
            q = warp_probs(logits, [seqs[b].params for b in active])  # [n, V]
            u = torch.tensor(draft_uniforms([seqs[b] for b in active], depth), dtype=torch.float64)  # [n]
            drawn = sample(q, u)
        ids, usable = torch.stack([drawn, ok.long()]).tolist()
        return ids, [bool(x) for x in usable], [True] * len(ids), q

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def drop_nonfinite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft row whose logits are not finite proposes nothing from there on (it can only lower
    acceptance; the target's verification keeps the output exact). logits [n, V] -> (the logits
    with such rows zeroed, so warping and sampling them stays in range, [n] bool usable rows)."""
    ok = finite_rows(logits)  # [n]
    return torch.where(ok[:, None], logits, 0.0), ok


def draft_uniforms(seqs: list[Sequence], depth: int) -> list[float]:
    """Each sequence's DRAFT uniform for its draft at position len(s) + depth, keyed by the step
    (its first position len(s)) as well (randomness.py)."""
    return [uniform(s.key, len(s) + depth, Purpose.DRAFT, len(s)) for s in seqs]


class DraftModelDrafter(DraftLoop):
    """A small model of the target's class, with its own runner (and paged cache): a sequence's
    K/V there live in seq.draft_table. Its vocabulary must be the target's (the same token ids)."""

    def __init__(self, runner: ModelRunner, vocab_size: int | None = None):
        self.runner = runner
        self.vocab_size = vocab_size or runner.vocab_size
        if runner.vocab_size != self.vocab_size:
            raise ValueError(f"the draft's vocabulary ({runner.vocab_size}) is not the target's ({self.vocab_size})")

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def draftable(self, seq: Sequence, n: int) -> int:
        """The i-th draft is sampled after feeding position len(seq) - 2 + i: the draft's context bounds n."""
        return max(0, min(n, self.runner.max_positions - len(seq) + 1))

    def next_logits(self, seqs: list[Sequence], active: list[int], drafted: list[list[int]]) -> torch.Tensor:
        """Depth 0 feeds what the draft has not cached (the prompt at first, then the one or two
        tokens the last step emitted past its accepted drafts); later depths the draft just drawn."""
        tables = [seqs[b].draft_table for b in active]
        feeds = [Feed(t, seqs[b].tokens[t.num_cached :] + drafted[b][-1:]) for t, b in zip(tables, active)]
        return self.runner.forward(feeds)  # [n, V]

    def rollback(self, seqs: list[Sequence]) -> None:
        """Keep the draft's K/V of the sequence's tokens only (its drafts past the accepted ones go)."""
        for s in seqs:
            s.draft_table.truncate(min(s.draft_table.num_cached, len(s) - 1), self.runner.cache.allocator)


class NgramDrafter(DraftLoop):
    """Match the last n tokens (n from max_n down to min_n) against the sequence's earlier tokens
    and propose what followed the latest match, one token a depth, through the shared loop."""

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def follower(self, tokens: list[int]) -> int | None:
        """The token that followed the latest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n]
        return None

    def next_logits(self, seqs: list[Sequence], active: list[int], drafted: list[list[int]]) -> torch.Tensor:
        logits = torch.full((len(active), self.vocab_size), float("-inf"))  # [n, V]: no match -> no draft
        for row, b in enumerate(active):
            token = self.follower(seqs[b].tokens + drafted[b])
            if token is not None and token < self.vocab_size:
                logits[row, token] = 0.0
        return logits
