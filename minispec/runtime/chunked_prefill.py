"""Chunked prefill: a prompt longer than what is left of a step's token budget is fed a chunk per
step, so the sequences already decoding keep getting their tokens every step (vLLM's
`enable_chunked_prefill` with `max_num_batched_tokens`; Agrawal et al. 2024, Sarathi-Serve).

Each engine step first counts what its speculative step will feed: every sequence's uncached
tokens plus up to k drafts, in admission order. A sequence whose prompt does not fit what is left
of `max_num_batched_tokens` gets instead a chunk of it (never its newest token), fed here in one
target forward before the step, and sits the step out; once all but its newest token are cached
it joins the step like any other, whose forward feeds that token and gives its first logits. A
drafter that reads the target's features (an EAGLE head) is handed those of every chunk, so it
drafts from the sequence's first step on.

Why the output stays exact: a chunk writes the K/V of the prompt's own tokens at their own
positions, as the whole prefill would (with row_invariant=True bit for bit; otherwise computed in
another batch shape, as a verification row already is), and nothing is sampled from a chunk.
"""

from __future__ import annotations

from ..drafters.base import Drafter
from .metrics import StepTimes
from .runner import Feed, ModelRunner
from .sequence import Sequence


def plan_chunks(seqs: list[Sequence], budget: int, k: int, min_chunk: int) -> dict[int, int]:
    """{index in seqs: tokens to feed now} for the sequences whose uncached tokens do not fit what
    the step's budget leaves (every sequence counting its uncached tokens and k drafts, in order).
    Each gets what is left, at least min_chunk, never its newest token; the others run the step."""
    chunks = {}
    for i, s in enumerate(seqs):
        need = len(s) - s.target_table.num_cached  # what the step would feed it, its newest token included
        if need + k <= budget or need <= 1:
            budget -= need + k
            continue
        chunks[i] = min(need - 1, max(budget, min_chunk))
        budget -= chunks[i]
    return chunks


def feed_chunks(seqs: list[Sequence], chunks: dict[int, int], target: ModelRunner, drafter: Drafter,
                times: StepTimes) -> None:
    """One target forward over the planned chunks (their logits unused), and their features to a
    drafter that reads them. The engine's catch-up of a recomputed sequence (engine.py) is such a
    chunk too: all but its newest token."""
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
