"""Chunked prefill: a prompt longer than what is left of a step's token budget is fed a chunk per
step, so the sequences already decoding keep getting their tokens every step (vLLM's
`enable_chunked_prefill` with `max_num_batched_tokens`; Agrawal et al. 2024, Sarathi-Serve).

The budget bounds every token a step feeds the target: prompt tokens, whole or in chunks, and
each verification row (a sequence's newest token and up to k drafts, or a tree's slots). Each
engine step walks its sequences in admission order: one whose uncached tokens and drafts fit
what is left runs the step; a prompt that does not fit gets instead a chunk of what is left
(never its newest token), fed here in one target forward before the step, and sits the step
out; once the budget is spent the rest sit it out too (the scheduler admits no one then). Once
all but its newest token are cached, a prompt joins the step like any other, whose forward feeds
that token and gives its first logits. The oldest sequence always steps: the scheduler refuses a
budget smaller than one verification row, so nothing waits forever.

A drafter that reads the target's features (an EAGLE head) is handed those of every chunk, so it
drafts from the sequence's first step on; a draft model is fed each chunk too (`Drafter.feed_prompt`),
so in a chain step it is fed no more than the target (a catch-up of one or two tokens, then one
per later draft). Outside the budget: an EAGLE head's catch-up over the features it was handed
(the whole prompt, when it first drafts), a draft model catching up on the tokens of steps that
prompt lookup drafted, and the frontiers a draft tree feeds its drafter.

How it plugs in: `TokenBudget` is the scheduler's `StepBudget` (it counts every token a step
feeds, `step_feed`, and admits while some is left), and `ChunkedPrefill` is the engine's
`StepFeature` (runtime/step_feature.py): before each step it plans the chunks (`plan_chunks`,
with the k chosen for the step), feeds them (`feed_chunks`) and takes their sequences out.

Why the output stays exact: a chunk writes the K/V of the prompt's own tokens at their own
positions, as the whole prefill would (with row_invariant=True bit for bit; otherwise computed in
another batch shape, as a verification row already is), and nothing is sampled from a chunk; a
sequence that sits a step out draws nothing in it.
"""

from __future__ import annotations

from ..drafters.base import Drafter
from .metrics import StepTimes
from .runner import Feed, ModelRunner
from ..core.scheduler import Scheduler, StepBudget
from .sequence import Sequence
from .step_feature import StepFeature


class TokenBudget(StepBudget):
    """The step budget with chunked prefill: every token the step feeds the target, the running
    sequences' first (a prompt mid-chunk with all it has left); a newcomer is admitted while some
    is left, whatever its length (what does not fit is fed in chunks)."""

    def __init__(self, max_num_batched_tokens: int, row: int):
        """row: one sequence's verification step (its newest token and its draft slots)."""
        if max_num_batched_tokens < row:  # (else the oldest could never step: a hang)
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one sequence's "
                             f"verification step of {row} tokens (its newest token and {row - 1} draft slots): "
                             f"raise it to {row} or more")
        super().__init__(max_num_batched_tokens)

    def left(self, scheduler: Scheduler, scheduled: list[Sequence]) -> int:
        return self.max_num_batched_tokens - sum(step_feed(scheduler, s) for s in scheduled)

    def fits(self, seq: Sequence, left: int) -> bool:
        return left > 0

    def cost(self, scheduler: Scheduler, seq: Sequence) -> int:
        return step_feed(scheduler, seq)


class ChunkedPrefill(StepFeature):
    """Before each step: what does not fit the step's budget sits it out, a prompt fed a chunk."""

    def __init__(self, max_num_batched_tokens: int):
        self.max_num_batched_tokens = max_num_batched_tokens

    def before(self, engine, seqs: list[Sequence], k: int) -> tuple[list[Sequence], int]:
        chunks = plan_chunks(seqs, self.max_num_batched_tokens, engine.scheduler.extra_slots or k)
        if not chunks:
            return seqs, k
        feed_chunks(seqs, chunks, engine.target, engine.drafter, engine.times)
        return [s for i, s in enumerate(seqs) if i not in chunks], k


def step_feed(scheduler: Scheduler, seq: Sequence) -> int:
    """The most tokens the next step feeds the target for seq: its uncached tokens (a prompt, or
    a decode's newest token) plus the drafts it may get."""
    return scheduler.step_tokens(seq) - seq.target_table.num_cached


def plan_chunks(seqs: list[Sequence], budget: int, k: int) -> dict[int, int]:
    """{index in seqs: prompt tokens to feed now} for the sequences that sit the step out: those
    whose uncached tokens and k drafts do not fit what the budget leaves, in order. A prompt gets
    what is left, never its newest token; 0 for the others (a decode, or nothing left)."""
    chunks = {}
    for i, s in enumerate(seqs):
        need = len(s) - s.target_table.num_cached  # what the step would feed it, its newest token included
        if need + k <= budget:
            budget -= need + k
            continue
        chunks[i] = min(need - 1, max(budget, 0))
        budget -= chunks[i]
    return chunks


def feed_chunks(seqs: list[Sequence], chunks: dict[int, int], target: ModelRunner, drafter: Drafter,
                times: StepTimes) -> None:
    """One target forward over the planned chunks (their logits unused; a chunk of 0 is skipped),
    their features to a drafter that reads them, their tokens to one that caches tokens. The
    engine's catch-up of a recomputed sequence (engine.py) is such a chunk too: all but its newest token."""
    chunks = {i: n for i, n in chunks.items() if n > 0}
    if not chunks:
        return
    chunked = [seqs[i] for i in chunks]
    starts = [s.target_table.num_cached for s in chunked]
    feeds = [Feed(s.target_table, s.tokens[start : start + chunks[i]]) for s, start, i in zip(chunked, starts, chunks)]
    layers = drafter.target_layers
    with times.timing("target_s", target.device, also="prefill_s"):
        if layers:
            _, hidden = target.forward(feeds, hidden_layers=layers)  # [sum(chunks), len(layers) * H]
            drafter.observe(chunked, starts, [len(f.tokens) for f in feeds], hidden)
        else:
            target.forward(feeds)
    with times.timing("draft_s", target.device, also="draft_prefill_s"):  # (a cost of the first token, not of drafting)
        drafter.feed_prompt(chunked, [start + len(f.tokens) for start, f in zip(starts, feeds)])
