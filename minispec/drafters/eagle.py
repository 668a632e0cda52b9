"""The EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840): drafting with the head of model/eagle.py,
which reads the target's own hidden states.

One round for a sequence x_0 .. x_{n-1} (the target has cached positions < n-1 and handed over
their features after its last verification; the draft has cached positions < c):
  1. catch-up: one forward over positions c .. n-2 with the REAL target features h_c .. h_{n-2}
     and tokens x_{c+1} .. x_{n-1}. Its last row proposes d_1. This rewrites the K/V that the
     previous round's chained steps computed from the draft's own (approximate) features, so a
     proposal depends only on the accepted prefix, never on which drafts were rejected.
  2. chained steps j = 2..k: position n+j-3 reads (g of the previous row, d_{j-1}), proposes d_j.
  3. rollback (after the target's verification): the draft forgets positions >= n-1; the next
     catch-up starts there.
Under static shapes a catch-up longer than the runner's largest bucket (after steps that prompt
lookup drafted, whose features wait unconsumed) is fed in bucket-sized pieces (`feed_ahead`).
A new sequence drafts nothing in its first step: the target's prefill emits its first token and
hands over the features of every prompt position, so the first catch-up runs over the whole
prompt (a preempted one, recomputed, gets its features first and drafts at once: engine.py).
The draft proposes from q = warp(logits scattered into a full-vocabulary row of -inf), the same
temperature / top-k / top-p warp as the target's p, so q(x) = 0 outside the draft vocabulary and
speculative sampling stays exact (speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.eagle import EagleModel
from ..runtime.layout import Prepared
from ..runtime.runner import Feed, ModelRunner
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from .base import AutoregressiveDrafter


@dataclass
class PendingFeatures:
    """Target features the draft has not consumed yet: rows [n, 3H] for positions start .. start+n-1."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.shape[0]


class EagleDrafter(AutoregressiveDrafter):
    """Drafts from the target's features (`target_layers`, handed over by `observe` after each
    verification). State per sequence: `seq.draft_state`, its pending features."""

    def __init__(self, runner: ModelRunner, confidence_threshold: float | None = None):
        super().__init__(confidence_threshold)
        self.runner = runner
        self.model: EagleModel = runner.model
        self.target_layers = self.model.config.aux_layers
        self.vocab_size = self.model.config.layer.vocab_size
        self.draft_ids = self.model.draft_to_target(torch.arange(self.model.config.draft_vocab_size, device=runner.device))

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        """Keeps the features of the positions the target kept (< seq.target_table.num_cached,
        after its rollback) as the sequence's pending features."""
        row = 0
        for s, start, n in zip(seqs, starts, num_fed):
            kept = hidden[row : row + max(0, s.target_table.num_cached - start)]
            row += n
            pending = s.draft_state
            if pending is not None and pending.end == start:
                pending.rows = torch.cat([pending.rows, kept])
            else:
                s.draft_state = PendingFeatures(start, kept)

    def draftable(self, s: Sequence, n: int) -> int:
        """n if s can draft now: the features for every position the draft has not cached are
        there, and the draft's context allows n tokens; else 0. Never in a new sequence's first
        step (the one that emits its first token): its prefill brings the features, and where a
        prompt came in chunks (runtime/chunked_prefill.py) and they are there already, drafting
        anyway would draft where the same request fed whole does not, and under the standard rule
        a draft steers what is sampled (seeded outputs would depend on the server's token budget)."""
        pending = s.draft_state
        ready = (bool(s.output_ids) and pending is not None and pending.start == s.draft_table.num_cached
                 and pending.end == len(s) - 1 and pending.end > pending.start and len(s) - 2 + n <= self.runner.max_positions)
        return n if ready else 0

    def first_feeds(self, seqs: list[Sequence], active: list[int]) -> tuple[list[Feed], dict]:
        """Catch-up: positions draft.num_cached .. len-2, tokens x_{p+1}, the real target features
        (consumed: observe() starts anew after the verification), after `feed_ahead`'s pieces."""
        feeds = [Feed(seqs[b].draft_table, seqs[b].tokens[seqs[b].draft_table.num_cached + 1 :]) for b in active]
        hidden = torch.cat([seqs[b].draft_state.rows for b in active])  # [sum, 3H]
        for b in active:
            seqs[b].draft_state = None
        return feeds, {"hidden": hidden, "project": True}

    def first_forward(self, seqs: list[Sequence], active: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up's logits [n, V_d] and g [n, H]."""
        self.feed_ahead([seqs[b] for b in active])
        feeds, args = self.first_feeds(seqs, active)
        return self.runner.forward(feeds, **args)

    def split(self, out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return out  # (logits [n, V_d], g [n, H])

    def chain_args(self, carry: torch.Tensor) -> dict:
        return {"hidden": carry, "project": False}

    def feed_ahead(self, seqs: list[Sequence], upload: Upload | None = None) -> list[tuple[Prepared, dict]]:
        """Under static shapes, a catch-up past the prompt that is longer than the runner's largest
        query length (pending features of steps that prompt lookup drafted: drafters/lookup.py)
        is fed in pieces of that length first, consuming their features, so that every forward
        past a prompt fits a bucket. The K/V are those of one forward; a prompt's catch-up still
        goes dynamically, whole. Without an upload each piece runs now; with one (a staged step)
        each is prepared into it and returned in order with its features as model arguments, to
        run on the device before the first draft forward (`run_staged`)."""
        static, pieces = self.runner.static, []
        while static is not None:
            Q = static.query_len
            ahead = [s for s in seqs if s.draft_table.num_cached >= len(s.prompt_ids) and s.draft_state.rows.shape[0] > Q]
            if not ahead:
                break
            feeds = [Feed(s.draft_table, s.tokens[s.draft_state.start + 1 : s.draft_state.start + 1 + Q]) for s in ahead]
            hidden = torch.cat([s.draft_state.rows[:Q] for s in ahead])  # [len(ahead) * Q, 3H]
            args = {"hidden": hidden, "project": True}
            for s in ahead:
                s.draft_state = PendingFeatures(s.draft_state.start + Q, s.draft_state.rows[Q:])
            if upload is None:
                self.runner.forward(feeds, **args)
            else:  # (prepare counts the piece as cached, so the next piece starts after it)
                pieces.append((self.runner.prepare(feeds, upload), args))
        return pieces

    def next_forward(self, seqs: list[Sequence], active: list[int], tokens: list[list[int]], carry: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chained: the next position reads the drafted token and the previous step's own output g."""
        feeds = [Feed(seqs[b].draft_table, [tokens[b][-1]]) for b in active]
        return self.runner.forward(feeds, hidden=carry, project=False)

    tree_root_offset = -2  # the catch-up's last row (position len - 2) proposes the root's children

    def tree_forward(self, feeds: list[Feed], carry: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree nodes read the token and their parent's output g (rows of the previous forward's)."""
        return self.runner.forward(feeds, hidden=carry[torch.tensor(rows, device=carry.device)], project=False)

    def rollback(self, seqs: list[Sequence]) -> None:
        """Forget the chained positions: the next catch-up starts at the first position whose
        target features are pending (the target's verified positions since the last catch-up)."""
        for s in seqs:
            keep = s.draft_state.start if s.draft_state is not None else len(s) - 1
            s.draft_table.truncate(keep, self.runner.cache.allocator)
